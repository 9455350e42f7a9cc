"""ActFirst-OPD: act first by inverse dynamics along a reference, distil full responses later.

One step, top to bottom:

1. **References.** Reference trajectories of the training tasks (the env's expert, the
   teacher's greedy rollouts or a user's dataset; :mod:`opd.rollout.references`), built on
   first use and reused by every later run of the same settings.
2. **Rollout** (in the rollout actor, :mod:`opd.rollout.actfirst`). The student plays each
   turn with a fast action-only answer: by inverse dynamics (its context plus the reference
   next observation) while the episode stays aligned with the reference, autonomously after
   the first failed transition check. Every context ``c_t`` is queued at once for a full
   think-then-act response (standard prompt, no reference) that a background thread
   generates while the episodes go on; those actions are never executed.
3. **Supervision.** The teacher scores each full response in the state-grounded view (task,
   executed actions, observations): exactly the context the response was sampled from.
4. **Update.** One row per turn: ``c_t`` followed by the full response, loss on the response
   only, with the recipe's losses (by default the sampled reverse KL as a per-token advantage
   with a PPO-clipped ratio against the behaviour logprobs of the full response).
5. **Sync.** The trainer's new weights go into the rollout engine, timed.

Evaluation is the driver's: standard think-then-act, no reference.

Departures from the paper: the full responses are batched by a background thread over the HF
engine rather than by a continuously batching server (see :mod:`opd.rollout.actfirst`), and a
training row per turn is a separate sequence (no prefix sharing in the student's forward).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import ray
import torch

from opd.algorithms.vanilla_opd import episode_metrics, sample_tasks
from opd.chat import render_context
from opd.generation.base import TokenScores
from opd.losses import group_advantages
from opd.rollout.actfirst import ActFirstSettings, TransitionCheck, collect_actfirst
from opd.rollout.references import load_references
from opd.runtime.actors import sync_weights
from opd.trajectory import TokenBatch, Trajectory


def build_turn_batch(trajs: list[Trajectory], scores: list[TokenScores], pad_id: int, fmt,
                     group_size: int = 1) -> TokenBatch:
    """One row per turn: the state-grounded context ``c_t`` then the full response ``y_t``.

    ``loss_mask`` is 1.0 on ``y_t`` only, ``behaviour_logprobs`` are ``y_t``'s sampling
    logprobs, the teacher's scores (``sampled``, ``topk`` or ``full``) sit on ``y_t``'s
    positions, ``turn_index`` is ``t``, and every row of an episode carries that episode's
    group-relative advantage (groups of ``group_size`` consecutive trajectories).

    Example:
        >>> batch = build_turn_batch(trajs, scores, fmt.pad_id, fmt)  # doctest: +SKIP
        >>> len(batch) == sum(len(t.turns) for t in trajs)  # doctest: +SKIP
        True
    """
    rows, spans, owners = [], [], []
    for b, (traj, score) in enumerate(zip(trajs, scores)):
        flat = 0
        for t, turn in enumerate(traj.turns):
            context = render_context(traj, t, "state_grounded", fmt)
            n = len(turn.response_ids)
            rows.append({
                "input_ids": context + turn.response_ids,
                "attention_mask": [1] * (len(context) + n),
                "loss_mask": [0.0] * len(context) + [1.0] * n,
                "behaviour_logprobs": [0.0] * len(context) + list(turn.response_logprobs),
                "teacher_logprobs": [0.0] * len(context) + list(score.logprobs[flat : flat + n]),
                "turn_index": [-1] * len(context) + [t] * n,
            })
            spans.append((len(context), len(context) + n, flat, flat + n))
            owners.append(b)
            flat += n
    batch = TokenBatch.from_rows(rows, pad_id)
    B, T = batch.input_ids_BT.shape
    if scores and scores[0].topk_ids is not None:
        K = scores[0].topk_ids.shape[1]
        ids_BTK = torch.zeros(B, T, K, dtype=torch.long)
        logp_BTK = torch.full((B, T, K), float("-inf"))
        tail_BT = torch.zeros(B, T)
        for r, ((start, end, lo, hi), b) in enumerate(zip(spans, owners)):
            ids_BTK[r, start:end] = scores[b].topk_ids[lo:hi]
            logp_BTK[r, start:end] = scores[b].topk_logprobs[lo:hi]
            tail_BT[r, start:end] = scores[b].tail_logprob[lo:hi]
        batch = replace(batch, teacher_topk_ids_BTK=ids_BTK, teacher_topk_logprobs_BTK=logp_BTK, teacher_tail_logprob_BT=tail_BT)
    if scores and scores[0].full_logprobs is not None:
        full_BTV = torch.zeros(B, T, scores[0].full_logprobs.shape[1])
        for r, ((start, end, lo, hi), b) in enumerate(zip(spans, owners)):
            full_BTV[r, start:end] = scores[b].full_logprobs[lo:hi]
        batch = replace(batch, teacher_full_logprobs_BTV=full_BTV)
    rewards = torch.tensor([traj.total_reward for traj in trajs])
    episode_advantage = group_advantages(rewards, torch.arange(len(trajs)) // max(1, group_size))
    return replace(batch, advantage_B=episode_advantage[torch.tensor(owners, dtype=torch.long)])


def actfirst_settings(ctx: Any) -> ActFirstSettings:
    """The rollout settings of ``ctx``'s recipe (training sampling, the ``actfirst`` section)."""
    cfg = ctx.cfg
    return ActFirstSettings(episode=ctx.train_settings, inverse_dynamics=bool(cfg.actfirst.inverse_dynamics),
                            action_max_new_tokens=int(cfg.actfirst.action_max_new_tokens),
                            check=TransitionCheck(cfg.actfirst.transition_check, cfg.env.id, cfg.env.module))


def train_step(ctx: Any, step: int) -> dict[str, float]:
    """Run one ActFirst-OPD step; ``ctx`` is the driver's :class:`opd.runtime.driver.RunContext`."""
    from rich.console import Console

    cfg, workers = ctx.cfg, ctx.workers
    start = time.perf_counter()
    tasks = sample_tasks(ctx.train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, step, cfg.rollout.group_size)
    references = None
    if cfg.actfirst.inverse_dynamics:
        teacher_play = lambda part: ray.get(workers.teacher.collect.remote(  # noqa: E731
            ctx.env_factory, part, ctx.eval_settings, cfg.run.seed))[0]
        references = load_references(cfg, Console(stderr=True).log, tasks, teacher_play)
    t_refs = time.perf_counter()
    trajs, stats, extra = ray.get(workers.rollout.run.remote(
        collect_actfirst, ctx.env_factory, tasks, references, actfirst_settings(ctx), cfg.run.seed * 100003 + step))
    t_gen = time.perf_counter()
    scores = ray.get(workers.teacher.score.remote(trajs, cfg.supervision))
    t_score = time.perf_counter()
    batch = build_turn_batch(trajs, scores, ctx.fmt.pad_id, ctx.fmt, cfg.rollout.group_size)
    train_metrics = ray.get(workers.trainer.train_step.remote(batch))
    t_train = time.perf_counter()
    sync = sync_weights(workers)
    end = time.perf_counter()
    metrics = {k: v for k, v in train_metrics.items() if not k.startswith("time/")}
    metrics.update(stats.metrics())
    metrics.update(episode_metrics(trajs, {**extra, "generated_tokens": float(stats.fast_tokens + stats.full_tokens),
                                           "generation_s": stats.generation_s}))
    metrics.update({
        "train_rows": float(len(batch)),
        "teacher_payload_mb": sum(s.nbytes() for s in scores) / 2**20,
        "teacher_logprob_per_token": sum(sum(s.logprobs) for s in scores) / max(stats.full_tokens, 1),
        "time/references_s": t_refs - start,
        "time/generation_s": t_gen - t_refs,
        "time/teacher_scoring_s": t_score - t_gen,
        "time/training_s": t_train - t_score,
        "time/weight_sync_s": sync["weight_sync_s"],
        "time/step_s": end - start,
    })
    reverse_kl = [v for k, v in metrics.items() if k.endswith("/reverse_kl")]
    if reverse_kl:
        metrics["reverse_kl_per_token"] = reverse_kl[0]
    return metrics
