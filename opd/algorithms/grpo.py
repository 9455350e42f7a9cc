"""GRPO: outcome rewards and group-relative advantages, no teacher (the baseline of PivotOPD).

One step, top to bottom:

1. **Rollout.** ``rollout.episodes_per_step`` episodes, ``rollout.group_size`` of them on each
   sampled task (a group).
2. **Advantages.** Each episode's return, normalised within its group
   (:func:`opd.losses.group_advantages`): the episodes that did better than their siblings are
   pushed up, the others down.
3. **Update.** The recipe's losses, normally ``ppo_clip`` alone (the teacher is not consulted;
   losses that need its grades are refused by the config).
4. **Sync.** The trainer's weights go into the rollout engine.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from opd.algorithms.vanilla_opd import build_token_batch, episode_metrics, sample_tasks
from opd.runtime.actors import sync_weights


def train_step(ctx: Any, step: int) -> dict[str, float]:
    """Run one GRPO step; ``ctx`` is the driver's :class:`opd.runtime.driver.RunContext`."""
    cfg, workers = ctx.cfg, ctx.workers
    start = time.perf_counter()
    tasks = sample_tasks(ctx.train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, step, cfg.rollout.group_size)
    trajs, gen = ray.get(workers.rollout.collect.remote(ctx.env_factory, tasks, ctx.train_settings, cfg.run.seed * 100003 + step))
    t_gen = time.perf_counter()
    batch = build_token_batch(trajs, None, ctx.fmt.pad_id, ctx.fmt, cfg.rollout.group_size)
    train_metrics = ray.get(workers.trainer.train_step.remote(batch))
    t_train = time.perf_counter()
    sync = sync_weights(workers)
    end = time.perf_counter()
    metrics = {k: v for k, v in train_metrics.items() if not k.startswith("time/")}
    metrics.update(episode_metrics(trajs, gen))
    metrics.update({
        "time/generation_s": t_gen - start,
        "time/teacher_scoring_s": 0.0,
        "time/training_s": t_train - t_gen,
        "time/weight_sync_s": sync["weight_sync_s"],
        "time/step_s": end - start,
    })
    return metrics
