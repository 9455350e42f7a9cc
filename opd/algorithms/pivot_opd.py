"""PivotOPD: find the pivotal mistake of each failed episode, prevent it with reverse KL, teach
the recovery with forward KL toward a hinted self-teacher, all in one PPO update with GRPO
advantages.

One step, top to bottom:

1. **Group rollouts.** ``rollout.group_size`` episodes per task; outcome rewards give GRPO
   advantages (as in :mod:`opd.algorithms.grpo`).
2. **Teacher grades.** The teacher scores every response token in the state-grounded view
   (the preventive term's target).
3. **Pivots** of the failed episodes (``pivot.finder``):
   - ``judge``: the teacher reads the state-grounded transcript and answers with the pivotal
     turn, a gold action and the recovery actions (:mod:`opd.supervision.pivot`); an answer that
     does not parse falls back to ``pivot.judge_fallback`` and is counted;
   - ``teacher_logprob``: the turn whose executed action the teacher finds least likely;
   - ``kl``: the turn where the per-token KL estimate ``log mu - log pi_T`` peaks;
   - ``expert``: the first turn where the environment's expert would have acted otherwise.

   The heuristics take the gold and recovery actions from ``pivot.hint_source``: the teacher's
   greedy action at each of those states, or the environment's expert.
4. **Self-teacher.** For each of the ``pivot.recovery_turns`` turns after a pivot, the student
   itself reads the same context plus a hint (the gold action and that turn's recovery action)
   and writes a response; its top-k distribution over that response, still with the hint, is the
   target. The training row is the hint-free context followed by that response.
5. **One update**: ``L = ppo_clip + lambda_prev * pivot_preventive + lambda_rec * pivot_recovery``,
   the weights being the recipe's loss weights. ``pivot_preventive`` is reverse KL on the pivot
   turn's committed response; ``pivot_recovery`` is forward KL on the self-teacher's responses.
6. **Sync** the weights into the rollout engine.

Departures from the paper: the hint is one line appended to the observation (our wording,
:func:`opd.supervision.pivot.hint_text`); the heuristic finders are offered next to the judge because a tiny CPU
teacher cannot write judgements.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from opd.algorithms.base import Algorithm, PolicyHost, RunContext, require_groups
from opd.algorithms.step import StepClock, build_token_batch, episode_metrics, step_tasks, student_episodes, train_and_sync
from opd.chat import next_prompt_ids, render_context
from opd.generation.base import SamplingParams, ScoreRequest, TokenScores
from opd.schema import ConfigError, OPDConfig
from opd.supervision.pivot import (Judgement, PivotStats, hint_text, judge_prompt_ids, parse_judgement,
                                   pivot_by_expert, pivot_by_max_kl, pivot_by_min_logprob)
from opd.trajectory import TokenBatch, Trajectory


@dataclass
class RecoverySample:
    """One self-teacher response at a recovery turn: its hint-free context (the training row's
    prefix), the response ids, and the hinted self-teacher's top-k over them."""

    context_ids: list[int]
    response_ids: list[int]
    turn: int
    scores: TokenScores
    followed_hint: bool  # the response's action is the hinted recovery action


# -- pivot finding ----------------------------------------------------------------------------
def per_turn_scores(traj: Trajectory, teacher_logprobs: list[float]) -> tuple[list[float], list[float]]:
    """Per turn: the teacher's logprob of the executed action (summed over its tokens; the whole
    response where the action span is empty) and the mean KL estimate ``log mu - log pi_T``."""
    action_lp, kl = [], []
    cursor = 0
    for turn in traj.turns:
        n = len(turn.response_ids)
        teacher = teacher_logprobs[cursor : cursor + n]
        cursor += n
        span = teacher[turn.action_start : turn.action_end] or teacher
        action_lp.append(float(sum(span)) if span else math.nan)
        diffs = [b - t for b, t in zip(turn.response_logprobs, teacher)]
        kl.append(sum(diffs) / len(diffs) if diffs else math.nan)
    return action_lp, kl


def expert_pivot(traj: Trajectory) -> int | None:
    """The first turn where the environment's expert would have acted otherwise."""
    return pivot_by_expert([t.action_text for t in traj.turns], [i.get("expert_action") for i in traj.state_infos()])


def heuristic_pivot(finder: str, traj: Trajectory, teacher_logprobs: list[float]) -> int | None:
    if finder == "expert":
        return expert_pivot(traj)
    action_lp, kl = per_turn_scores(traj, teacher_logprobs)
    return pivot_by_min_logprob(action_lp) if finder == "teacher_logprob" else pivot_by_max_kl(kl)


def judge_episodes(worker: PolicyHost, trajs: list[Trajectory], recovery_turns: int, max_new_tokens: int) -> list[str]:
    """In the teacher's worker: the teacher's greedy judgement of each failed episode, as text."""
    prompts = [judge_prompt_ids(worker.fmt, worker.tokenizer, t.initial_observation,
                                [(turn.action_text, turn.observation) for turn in t.turns], recovery_turns)
               for t in trajs]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(worker.fmt.im_end_id,))
    return [worker.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in worker.engine.generate(prompts, params)]


def greedy_actions(worker: PolicyHost, contexts: list[list[int]], max_new_tokens: int) -> list[str]:
    """In a worker: the greedy action of its model after each context (ids)."""
    if not contexts:
        return []
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(worker.fmt.im_end_id,))
    out = []
    for completion in worker.engine.generate(contexts, params):
        start, end = worker.fmt.action_span(completion.response_ids)
        out.append(worker.tokenizer.decode(completion.response_ids[start:end], skip_special_tokens=True).strip())
    return out


def find_pivots(ctx: RunContext, trajs: list[Trajectory], scores: list[TokenScores],
                need_hints: bool = True) -> tuple[dict[int, Judgement], PivotStats]:
    """A :class:`Judgement` for each failed episode where a pivot was found, keyed by index.
    Without ``need_hints`` (no recovery term) the heuristics name no gold or recovery actions."""
    cfg = ctx.cfg.pivot
    k = int(cfg.recovery_turns) if need_hints else 0
    failed = [i for i, t in enumerate(trajs) if not t.success and t.turns and t.end_reason != "env_error"]
    stats = PivotStats()
    judged: dict[int, Judgement | None] = {}
    if cfg.finder == "judge" and failed:
        texts = ctx.workers.run("teacher", judge_episodes, [trajs[i] for i in failed], k, cfg.judge_max_new_tokens)
        judged = {i: parse_judgement(text, len(trajs[i].turns), k) for i, text in zip(failed, texts)}
    pivots: dict[int, int] = {}
    for i in failed:
        traj = trajs[i]
        expert_turn = expert_pivot(traj)
        if cfg.finder == "judge" and judged[i] is not None:
            pivots[i] = judged[i].pivot_turn
        else:
            finder = cfg.judge_fallback if cfg.finder == "judge" else cfg.finder
            pivot = heuristic_pivot(finder, traj, scores[i].logprobs)
            if pivot is not None:
                pivots[i] = pivot
        stats.record(pivots.get(i), judge_parsed=(judged[i] is not None) if cfg.finder == "judge" else None,
                     expert_turn=expert_turn)
    # Gold and recovery actions for the pivots the judge did not name.
    todo = [(i, j) for i, p in pivots.items() if judged.get(i) is None and need_hints
            for j in range(p, min(p + k + 1, len(trajs[i].turns)))]
    if ctx.cfg.pivot.hint_source == "expert":
        actions = [trajs[i].state_infos()[j].get("expert_action") or "" for i, j in todo]
    else:
        contexts = [render_context(trajs[i], j, "state_grounded", ctx.fmt) for i, j in todo]
        actions = ctx.workers.run("teacher", greedy_actions, contexts, ctx.cfg.rollout.max_new_tokens)
    named: dict[int, list[str]] = {}
    for (i, _), action in zip(todo, actions):
        named.setdefault(i, []).append(action)
    judgements = {}
    for i, p in pivots.items():
        if judged.get(i) is not None:
            judgements[i] = judged[i]
        elif not need_hints:
            judgements[i] = Judgement(p, "", ())
        elif named.get(i) and named[i][0]:
            # Recovery actions stay aligned with their turns: stop at the first state with none.
            judgements[i] = Judgement(p, named[i][0], tuple(itertools.takewhile(bool, named[i][1:])))
    return judgements, stats


# -- the self-teacher ---------------------------------------------------------------------------
def self_teacher(worker: PolicyHost, requests: list[tuple[Trajectory, int, str]], max_new_tokens: int, temperature: float,
                 top_k: int, seed: int) -> list[RecoverySample]:
    """In the rollout worker: for each (trajectory, turn, hint) the student's response with the
    hint in context, and its top-k distribution over that response (hint still in context)."""
    if not requests:
        return []
    fmt, tok = worker.fmt, worker.tokenizer
    plain, hinted = [], []
    for traj, j, hint in requests:
        context = render_context(traj, j, "full", fmt)
        prefix = context[: len(context) - len(traj.turns[j].prompt_ids)]
        plain.append(context)
        hinted.append(prefix + next_prompt_ids(fmt, tok, f"{traj.turns[j - 1].observation}\n{hint}"))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(fmt.im_end_id,), seed=seed)
    completions = worker.engine.generate(hinted, params)
    score_requests = []
    for context, completion in zip(hinted, completions):
        ids = context + completion.response_ids
        n, m = len(ids), len(context)
        score_requests.append(ScoreRequest(ids, list(range(n)), [0] * n, list(range(m, n)), list(range(m - 1, n - 1))))
    scores = worker.engine.score(score_requests, mode="topk", top_k=top_k)
    samples = []
    for context, completion, (_, j, hint), score in zip(plain, completions, requests, scores):
        start, end = fmt.action_span(completion.response_ids)
        action = tok.decode(completion.response_ids[start:end], skip_special_tokens=True).strip()
        samples.append(RecoverySample(context, completion.response_ids, j, score, action == hint.rsplit("Now do: ", 1)[-1]))
    return samples


def recovery_rows(samples: list[RecoverySample], pad_id: int) -> TokenBatch:
    """One row per self-teacher response: no ``loss_mask_BT`` tokens (PPO and the teacher's terms
    skip it), the ``recovery`` mask on the response and the self-teacher's top-k there."""
    rows = []
    for s in samples:
        m, n = len(s.context_ids), len(s.response_ids)
        rows.append({"input_ids": s.context_ids + s.response_ids, "attention_mask": [1] * (m + n),
                     "turn_index": [-1] * m + [s.turn] * n})
    batch = TokenBatch.from_rows(rows, pad_id)
    B, T = batch.input_ids_BT.shape
    K = samples[0].scores.topk_ids.shape[1]
    mask_BT, tail_BT = torch.zeros(B, T), torch.zeros(B, T)
    ids_BTK, logp_BTK = torch.zeros(B, T, K, dtype=torch.long), torch.full((B, T, K), float("-inf"))
    for b, s in enumerate(samples):
        span = slice(len(s.context_ids), len(s.context_ids) + len(s.response_ids))
        mask_BT[b, span] = 1.0
        ids_BTK[b, span], logp_BTK[b, span], tail_BT[b, span] = s.scores.topk_ids, s.scores.topk_logprobs, s.scores.tail_logprob
    return replace(batch, masks_BT={"recovery": mask_BT}, teacher_topk_ids_BTK=ids_BTK, teacher_topk_logprobs_BTK=logp_BTK,
                   teacher_tail_logprob_BT=tail_BT)


def pivot_mask(batch: TokenBatch, judgements: dict[int, Judgement]) -> torch.Tensor:
    """``[B, T]`` 1.0 on the response tokens of each failed episode's pivotal turn."""
    mask_BT = torch.zeros_like(batch.loss_mask_BT)
    for i, judgement in judgements.items():
        mask_BT[i] = ((batch.turn_index_BT[i] == judgement.pivot_turn) & (batch.loss_mask_BT[i] > 0)).float()
    return mask_BT


# -- the step ------------------------------------------------------------------------------------
def pivot_marks(judgements: dict[int, Judgement], requests: list[tuple[Trajectory, int, str]],
                trajs: list[Trajectory]) -> dict[int, dict[int, list[str]]]:
    """The turns a report marks: each failure's pivotal turn, and the turns after it that got a
    self-teacher response."""
    marks: dict[int, dict[int, list[str]]] = {i: {jd.pivot_turn: ["pivot"]} for i, jd in judgements.items()}
    index = {id(traj): i for i, traj in enumerate(trajs)}
    for traj, turn, _ in requests:
        marks.setdefault(index[id(traj)], {}).setdefault(turn, []).append("recovery")
    return marks


def train_step(ctx: RunContext, step: int) -> dict[str, float]:
    """Run one PivotOPD step."""
    cfg = ctx.cfg
    clock = StepClock()
    tasks, seed = step_tasks(ctx, step)
    trajs, gen = student_episodes(ctx, step)  # tasks' episodes (started a step ahead with run.async_steps: 1)
    clock.lap("generation")
    scores = ctx.workers.score(trajs, cfg.supervision)
    clock.lap("teacher_scoring")
    recovery = any(loss.name == "pivot_recovery" for loss in cfg.losses)
    judgements, stats = find_pivots(ctx, trajs, scores, need_hints=recovery)
    clock.lap("pivot_finding")

    requests = []
    if recovery:
        for i, jd in judgements.items():
            for offset, action in enumerate(jd.recovery_actions[: cfg.pivot.recovery_turns], start=1):
                if jd.pivot_turn + offset < len(trajs[i].turns):
                    requests.append((trajs[i], jd.pivot_turn + offset, hint_text(jd.pivot_turn, jd.gold_action, action)))
    samples = ctx.workers.run("student", self_teacher, requests, cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                              cfg.pivot.hint_top_k, seed)
    clock.lap("self_teacher")
    ctx.episodes.train_sample(step, trajs, scores, pivot_marks(judgements, requests, trajs))

    batch = build_token_batch(trajs, scores, ctx.fmt.pad_id, ctx.fmt, cfg.rollout.group_size)
    masks = {"pivot": pivot_mask(batch, judgements), "recovery": torch.zeros_like(batch.loss_mask_BT)}
    batch = replace(batch, masks_BT=masks)
    if samples:
        batch = TokenBatch.concat([batch, recovery_rows(samples, ctx.fmt.pad_id)], ctx.fmt.pad_id)
    metrics = train_and_sync(ctx, batch, clock)
    metrics.update(episode_metrics(trajs, gen, cfg.rollout.group_size))
    metrics.update(stats.as_metrics())
    metrics.update({
        "pivot/failures": float(stats.failures),
        "pivot/judged": float(stats.judged),
        "pivot/recovery_rows": float(len(samples)),
        "pivot/hint_followed": sum(s.followed_hint for s in samples) / max(len(samples), 1),
    })
    return clock.finish(metrics)


def check_config(cfg: OPDConfig, source: str) -> None:
    require_groups(cfg, source, "pivot_opd")
    if cfg.supervision.scoring != "sampled" or cfg.supervision.cross_tokenizer:
        raise ConfigError(f"{source}: algorithm 'pivot_opd' needs 'supervision.scoring: sampled' without "
                          "cross_tokenizer (the top-k fields carry the self-teacher's recovery targets).")


ALGORITHM = Algorithm("pivot_opd", train_step, check_config, masks=("pivot", "recovery"), pipelines=True)
