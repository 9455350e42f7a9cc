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

from opd.algorithms.base import Algorithm, BatchPlan, PolicyHost, RunContext
from opd.algorithms.step import (StepClock, episode_metrics, mix_metrics, step_tasks, teacher_metrics, train_and_sync,
                                 with_group_advantages, with_reverse_kl_headline)
from opd.generation.base import TokenScores
from opd.rollout.actfirst import ActFirstSettings, ActFirstStats, TransitionCheck, run_actfirst_episodes
from opd.rollout.references import load_references
from opd.schema import ConfigError, OPDConfig
from opd.supervision.teacher_view import packed_row, with_teacher_scores
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
    rows, positions = [], []
    for traj in trajs:
        row, index = packed_row(traj, fmt)
        behaviour = [lp for turn in traj.turns for lp in turn.response_logprobs]
        for k, i in enumerate(index):
            row["behaviour_logprobs"][i] = behaviour[k]
        rows.append(row)
        positions.append(index)
    batch = with_teacher_scores(TokenBatch.from_rows(rows, pad_id), positions, scores)
    return with_group_advantages(batch, trajs, group_size)


def actfirst_settings(ctx: RunContext, step: int = 1) -> ActFirstSettings:
    """The rollout settings of ``ctx``'s recipe at ``step`` (training sampling, a forward depth
    curriculum's turns, the ``actfirst`` section)."""
    cfg = ctx.cfg
    return ActFirstSettings(episode=ctx.settings_for(step), inverse_dynamics=bool(cfg.actfirst.inverse_dynamics),
                            action_max_new_tokens=int(cfg.actfirst.action_max_new_tokens),
                            check=TransitionCheck(cfg.actfirst.transition_check, cfg.env.id, cfg.env.module),
                            decode_during_env_steps=bool(cfg.actfirst.decode_during_env_steps))


def collect_actfirst(worker: PolicyHost, env_factory, tasks: list[str], references: dict | None,
                     settings: ActFirstSettings, seed: int) -> tuple[list[Trajectory], ActFirstStats, dict[str, float]]:
    """In the rollout worker (``ctx.workers.run("student", collect_actfirst, ...)``):
    :func:`opd.rollout.actfirst.run_actfirst_episodes` with the worker's engine and environment
    pool; also returns ``env_restarts`` and ``env_replays``."""
    from opd.rollout.env_pool import pool_counts

    envs = worker.envs(env_factory, settings.episode)
    before = pool_counts(envs)
    trajs, stats = run_actfirst_episodes(worker.engine, env_factory, tasks, references, worker.tokenizer, worker.fmt,
                                         settings, seed, envs=envs)
    return trajs, stats, {key: n - before[key] for key, n in pool_counts(envs).items()}


def train_step(ctx: RunContext, step: int) -> dict[str, float]:
    """Run one ActFirst-OPD step."""
    from rich.console import Console

    cfg = ctx.cfg
    clock = StepClock()
    tasks, seed = step_tasks(ctx, step)
    references = None
    if cfg.actfirst.inverse_dynamics:
        teacher_play = lambda part: ctx.workers.collect(  # noqa: E731
            "teacher", ctx.env_factory, part, ctx.eval_settings, cfg.run.seed)[0]
        references = load_references(cfg, Console(stderr=True).log, tasks, teacher_play)
    clock.lap("references")
    trajs, stats, extra = ctx.workers.run("student", collect_actfirst, ctx.env_factory, tasks, references,
                                          actfirst_settings(ctx, step), seed)
    if ctx.curriculum is not None:  # which turns train (a depth curriculum's window)
        extra = {**extra, **ctx.curriculum.mark(trajs, step)}
    clock.lap("generation")
    scored = ctx.workers.score_for_training(trajs, cfg.supervision)  # the whole answer goes teacher -> trainer
    clock.lap("teacher_scoring")
    scores = scored.light  # each token's teacher logprob
    ctx.episodes.train_sample(step, trajs, scores, {i: {t: ["aligned"] for t in stats.aligned_turns(i)}
                                                    for i in range(len(trajs))})
    plan = BatchPlan(build_episode_batch, trajs, scored, (ctx.fmt.pad_id, ctx.fmt, cfg.rollout.group_size))
    metrics = train_and_sync(ctx, plan, clock)
    metrics.update(stats.metrics())
    metrics.update(episode_metrics(trajs, {**extra, "generated_tokens": float(stats.fast_tokens + stats.full_tokens),
                                           "generation_s": stats.generation_s}, cfg.rollout.group_size))
    metrics.update(teacher_metrics(scored))
    metrics.update(mix_metrics(trajs, scores, ctx.routes))
    metrics["teacher_logprob_per_token"] = sum(sum(s.logprobs) for s in scores) / max(stats.full_tokens, 1)
    return clock.finish(with_reverse_kl_headline(metrics))


def check_config(cfg: OPDConfig, source: str) -> None:
    if cfg.supervision.teacher_view != "state_grounded" or cfg.supervision.cross_tokenizer:
        raise ConfigError(f"{source}: algorithm 'actfirst_opd' needs 'supervision.teacher_view: state_grounded' without "
                          "cross_tokenizer: its full responses were sampled from the state-grounded context (the "
                          "executed fast actions), so that is the only view that grades them in-distribution.")


# Evaluated as it trains its full responses: think-then-act after contexts of actions and
# observations only (no reference).
ALGORITHM = Algorithm("actfirst_opd", train_step, check_config, eval_history="state_grounded")
