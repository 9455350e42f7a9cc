"""Vanilla on-policy distillation, and state-grounded OPD, for multi-turn agents.

One step, top to bottom:

1. **Rollout.** The student plays ``episodes_per_step`` training tasks (think-then-act at every
   turn), recording each token exactly as sampled with its behaviour logprob.
2. **Supervision.** The teacher scores every student response token (``supervision.scoring``:
   its logprob of the token, its top-k, or its full distribution) under its view of the turn:
   ``full`` (the student's own history, as in vanilla OPD) or ``state_grounded`` (the task, the
   executed actions and the observations only: no student reasoning reaches the teacher, so
   its grades stay in-distribution). All turns of a trajectory share one packed forward.
3. **Update.** One sequence per trajectory (every turn's context in the student's own view is
   a prefix of it) with the recipe's losses, by default the sampled reverse KL used as a
   per-token advantage ``log pi_T - log mu`` with a PPO-clipped importance ratio. Episodes of
   the same task (``rollout.group_size``) also get GRPO advantages, for ``ppo_clip``.
4. **Sync.** The trainer's new weights go into the rollout engine, timed.

Departure from the papers: the per-token advantage is not discounted or summed over future
tokens (each token is graded on its own, as in Tinker's OPD recipe); the papers' multi-turn
OPD does the same for the reverse-KL term.
"""

from __future__ import annotations

from opd.algorithms.base import Algorithm, BatchPlan, RunContext
from opd.algorithms.step import (StepClock, build_token_batch, episode_metrics, kl_by_turn, mix_metrics,
                                 student_episodes, teacher_metrics, train_and_sync, with_reverse_kl_headline)
from opd.trajectory import Trajectory



def train_step(ctx: RunContext, step: int) -> dict[str, float]:
    """Run one OPD step."""
    clock = StepClock()
    trajs, gen = student_episodes(ctx, step)
    clock.lap("generation")
    # The scores go from the teacher to the trainer, which builds the batch: the driver keeps the
    # trajectories and each token's teacher logprob, never the top-k or full distributions.
    scored = ctx.workers.score_for_training(trajs, ctx.cfg.supervision)
    clock.lap("teacher_scoring")
    ctx.episodes.train_sample(step, trajs, scored.light)
    build_args = (ctx.fmt.pad_id, ctx.fmt, ctx.cfg.rollout.group_size)
    metrics = train_and_sync(ctx, BatchPlan(build_token_batch, trajs, scored, build_args), clock)
    metrics.update(episode_metrics(trajs, gen))
    metrics.update(lockstep_decode_metrics(trajs))
    metrics.update(teacher_metrics(scored))
    metrics.update(kl_by_turn(trajs, scored.light))
    metrics.update(mix_metrics(trajs, scored.light, ctx.routes))
    return clock.finish(with_reverse_kl_headline(metrics))


def lockstep_decode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """The decode steps of a lockstep rollout (one ``generate`` call per turn for every live
    episode, :func:`opd.rollout.vanilla.run_episodes`) and their mean width: turn ``t`` runs as
    many steps as its longest response, each over the rows still generating. ActFirst's stream
    logs the same (``actfirst/stream_steps``), so the bench can compare the cost of a step."""
    steps = rows = 0
    for t in range(max((len(traj.turns) for traj in trajs), default=0)):
        lengths = [len(traj.turns[t].response_ids) for traj in trajs if len(traj.turns) > t]
        steps += max(lengths)
        rows += sum(lengths)
    return {"rollout/decode_steps": float(steps), "rollout/decode_rows_mean": rows / max(steps, 1)}


ALGORITHM = Algorithm("vanilla_opd", train_step, pipelines=True)
