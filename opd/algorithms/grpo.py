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

from opd.algorithms.base import Algorithm, RunContext, require_groups
from opd.algorithms.step import (StepClock, build_token_batch, episode_metrics, mix_metrics, student_episodes,
                                 train_and_sync)
from opd.schema import OPDConfig


def train_step(ctx: RunContext, step: int) -> dict[str, float]:
    """Run one GRPO step."""
    clock = StepClock()
    trajs, gen = student_episodes(ctx, step)
    clock.lap("generation")
    ctx.episodes.train_sample(step, trajs)
    batch = build_token_batch(trajs, None, ctx.fmt.pad_id, ctx.fmt, ctx.cfg.rollout.group_size)
    metrics = train_and_sync(ctx, batch, clock)
    metrics.update(episode_metrics(trajs, gen, ctx.cfg.rollout.group_size))
    metrics.update(mix_metrics(trajs, None, ctx.routes))
    return clock.finish(metrics)


def check_config(cfg: OPDConfig, source: str) -> None:
    require_groups(cfg, source, "grpo")


ALGORITHM = Algorithm("grpo", train_step, check_config, uses_teacher=False, pipelines=True)
