"""ActFirst-OPD: act first by inverse dynamics along a reference, distil full responses later.

One step, top to bottom:

1. **References.** Reference trajectories of the training tasks (the env's expert, the
   teacher's greedy rollouts or a user's dataset; :mod:`opd.rollout.references`), built on
   first use and reused by every later run of the same settings.
2. **Rollout** (in the rollout actor, :mod:`opd.rollout.actfirst`). The student plays each
   turn with a fast action-only answer: by inverse dynamics (its context plus the reference
   next observation) while the episode stays aligned with the reference, autonomously after
   the first failed transition check. Every context ``c_t`` is added at once to the engine's
   stream (continuous batching) for a full think-then-act response (standard prompt, no
   reference), decoded alongside the later fast turns; those actions are never executed.
3. **Supervision.** The teacher scores each full response in the state-grounded view (task,
   executed actions, observations): exactly the context the response was sampled from.
4. **Update.** One packed row per episode: the state-grounded trunk with each full response
   as a branch after its context (the layout the teacher scored), loss on the responses only,
   with the recipe's losses (by default the sampled reverse KL as a per-token advantage with a
   PPO-clipped ratio against the behaviour logprobs of the full responses).
5. **Sync.** The trainer's new weights go into the rollout engine, timed.

Evaluation is the driver's: standard think-then-act, no reference.

Departure from the paper: the training rows are packed per episode (branch attention), which
changes nothing in the gradient but the cost.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import ray
import torch

from opd.algorithms.vanilla_opd import episode_metrics, sample_tasks
from opd.generation.base import TokenScores
from opd.losses import group_advantages
from opd.rollout.actfirst import ActFirstSettings, TransitionCheck, collect_actfirst
from opd.rollout.references import load_references
from opd.runtime.actors import sync_weights
from opd.supervision.teacher_view import packed_row
from opd.trajectory import TokenBatch, Trajectory


def build_episode_batch(trajs: list[Trajectory], scores: list[TokenScores], pad_id: int, fmt,
                        group_size: int = 1) -> TokenBatch:
    """One packed row per episode: the state-grounded trunk (task, executed actions,
    observations) with each full response ``y_t`` as a branch after its context ``c_t``, the
    layout the teacher scored (:func:`opd.supervision.teacher_view.pack_trajectory`). One
    forward trains every turn of the episode, where a row per turn would recompute ``c_t`` in
    every later row (about T/2 times the tokens).

    ``loss_mask`` is 1.0 on the ``y_t`` tokens only, ``behaviour_logprobs`` are their sampling
    logprobs, the teacher's scores (``sampled``, ``topk`` or ``full``) sit on them, ``turn_index``
    is ``t``, ``position_ids`` / ``branch_ids`` describe the packing, and each row carries its
    episode's group-relative advantage (groups of ``group_size`` consecutive trajectories).

    Example:
        >>> batch = build_episode_batch(trajs, scores, fmt.pad_id, fmt)  # doctest: +SKIP
        >>> len(batch) == len(trajs)  # doctest: +SKIP
        True
    """
    rows, targets = [], []
    for traj, score in zip(trajs, scores):
        row, index = packed_row(traj, fmt)
        row["teacher_logprobs"] = [0.0] * len(row["input_ids"])
        behaviour = [lp for turn in traj.turns for lp in turn.response_logprobs]
        for k, i in enumerate(index):
            row["behaviour_logprobs"][i] = behaviour[k]
            row["teacher_logprobs"][i] = score.logprobs[k]
        rows.append(row)
        targets.append(torch.tensor(index, dtype=torch.long))
    batch = TokenBatch.from_rows(rows, pad_id)
    B, T = batch.input_ids_BT.shape
    if scores and scores[0].topk_ids is not None:
        K = scores[0].topk_ids.shape[1]
        ids_BTK = torch.zeros(B, T, K, dtype=torch.long)
        logp_BTK = torch.full((B, T, K), float("-inf"))
        tail_BT = torch.zeros(B, T)
        for r, (score, index) in enumerate(zip(scores, targets)):
            ids_BTK[r, index] = score.topk_ids
            logp_BTK[r, index] = score.topk_logprobs
            tail_BT[r, index] = score.tail_logprob
        batch = replace(batch, teacher_topk_ids_BTK=ids_BTK, teacher_topk_logprobs_BTK=logp_BTK, teacher_tail_logprob_BT=tail_BT)
    if scores and scores[0].full_logprobs is not None:
        full_BTV = torch.zeros(B, T, scores[0].full_logprobs.shape[1])
        for r, (score, index) in enumerate(zip(scores, targets)):
            full_BTV[r, index] = score.full_logprobs
        batch = replace(batch, teacher_full_logprobs_BTV=full_BTV)
    rewards = torch.tensor([traj.total_reward for traj in trajs])
    return replace(batch, advantage_B=group_advantages(rewards, torch.arange(len(trajs)) // max(1, group_size)))


def actfirst_settings(ctx: Any) -> ActFirstSettings:
    """The rollout settings of ``ctx``'s recipe (training sampling, the ``actfirst`` section)."""
    cfg = ctx.cfg
    return ActFirstSettings(episode=ctx.train_settings, inverse_dynamics=bool(cfg.actfirst.inverse_dynamics),
                            action_max_new_tokens=int(cfg.actfirst.action_max_new_tokens),
                            check=TransitionCheck(cfg.actfirst.transition_check, cfg.env.id, cfg.env.module),
                            decode_during_env_steps=bool(cfg.actfirst.decode_during_env_steps))


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
    batch = build_episode_batch(trajs, scores, ctx.fmt.pad_id, ctx.fmt, cfg.rollout.group_size)
    train_metrics = ray.get(workers.trainer.train_step.remote(batch))
    t_train = time.perf_counter()
    sync = sync_weights(workers)
    end = time.perf_counter()
    metrics = {k: v for k, v in train_metrics.items() if not k.startswith("time/")}
    metrics.update(stats.metrics())
    metrics.update(episode_metrics(trajs, {**extra, "generated_tokens": float(stats.fast_tokens + stats.full_tokens),
                                           "generation_s": stats.generation_s}))
    metrics.update({
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
