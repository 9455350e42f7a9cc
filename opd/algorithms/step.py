"""The pieces every algorithm's step shares, so that each algorithm file shows only its own.

A step is: draw the step's tasks and seed (:func:`step_tasks`) and collect the student's episodes
(:func:`student_episodes`, which may have started them during the previous step), have the teacher
score them, build the :class:`opd.trajectory.TokenBatch`, train, sync the weights
(:func:`train_and_sync`), and report what happened (:func:`episode_metrics`, :class:`StepClock`).
The algorithms call these in their own order, with their own steps in between.

Example:
    >>> clock = StepClock()  # doctest: +SKIP
    >>> trajs, gen = student_episodes(ctx, step)  # doctest: +SKIP
    >>> clock.lap("generation")  # doctest: +SKIP
    >>> metrics = train_and_sync(ctx, build_token_batch(trajs, None, ctx.fmt.pad_id, ctx.fmt), clock)  # doctest: +SKIP
    >>> return clock.finish(metrics)  # doctest: +SKIP
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Callable

import torch

from opd.algorithms.base import BatchPlan, RunContext, Scored
from opd.chat import ChatFormat, student_sequence
from opd.generation.base import TokenScores
from opd.losses import group_advantages
from opd.mixture import TeacherRoutes, by_environment
from opd.schema import OPDConfig
from opd.supervision.teacher_view import with_teacher_scores
from opd.trajectory import TokenBatch, Trajectory, success_rate


# -- tasks and seeds ---------------------------------------------------------------------------
def sample_tasks(tasks: list[str], n: int, seed: int, step: int, group_size: int = 1) -> list[str]:
    """Step ``step``'s training tasks, each repeated ``group_size`` times in a row: a pure
    function of (seed, step), so a resumed run draws exactly the tasks an uninterrupted one would."""
    rng = random.Random(f"{seed}:{step}")
    return [task for _ in range(n // group_size) for task in [tasks[rng.randrange(len(tasks))]] * group_size]


def step_seed(cfg: OPDConfig, step: int) -> int:
    """The sampling seed of step ``step``: a pure function of (run seed, step), as the tasks are."""
    return cfg.run.seed * 100003 + step


def student_episodes(ctx: RunContext, step: int) -> tuple[list[Trajectory], dict[str, float]]:
    """Step ``step``'s training episodes (its :func:`step_tasks`, played by the student) and their
    generation figures. With ``run.async_steps: 1`` they were started during the previous step
    (:class:`opd.algorithms.base.StepRollouts`), and this starts the next step's before
    returning; the figures then also carry ``rollout/staleness`` (updates between the weights
    that played them and the ones that train on them)."""
    upcoming = step_tasks(ctx, step + 1) if ctx.rollouts.wants(step) else None
    trajs, gen, staleness = ctx.rollouts.episodes(ctx, step, step_tasks(ctx, step), upcoming)
    if ctx.rollouts.ahead:
        gen = {**gen, "rollout/staleness": float(staleness)}
    if ctx.curriculum is not None:  # which turns train (a depth curriculum's window)
        gen = {**gen, **ctx.curriculum.mark(trajs, step)}
    return trajs, gen


def step_tasks(ctx: RunContext, step: int) -> tuple[list[str], int]:
    """Step ``step``'s training tasks (``rollout.episodes_per_step``, in groups of
    ``rollout.group_size``; with ``env.mix`` each environment's share) and its sampling seed."""
    rollout = ctx.cfg.rollout
    if ctx.mix is not None:  # env.mix: each environment's share of the step, in the mix's order
        tasks = ctx.mix.sample(rollout.episodes_per_step, ctx.cfg.run.seed, step, rollout.group_size)
    else:
        tasks = sample_tasks(ctx.train_tasks, rollout.episodes_per_step, ctx.cfg.run.seed, step, rollout.group_size)
    return tasks, step_seed(ctx.cfg, step)


# -- the batch -----------------------------------------------------------------------------------
def with_group_advantages(batch: TokenBatch, trajs: list[Trajectory], group_size: int) -> TokenBatch:
    """``batch`` (one row per trajectory, in order) with each row's group-relative advantage of
    its episode's return; a group is ``group_size`` consecutive trajectories (the same task)."""
    rewards = torch.tensor([traj.total_reward for traj in trajs])
    groups = torch.arange(len(trajs)) // max(1, group_size)
    return replace(batch, advantage_B=group_advantages(rewards, groups))


def build_token_batch(trajs: list[Trajectory], scores: list[TokenScores] | None, pad_id: int, fmt: ChatFormat,
                      group_size: int = 1) -> TokenBatch:
    """One row per trajectory (the student's own view, :func:`opd.chat.student_sequence`) with the
    teacher's scores placed on its response tokens (none for ``scores=None``, e.g. GRPO), and
    group-relative advantages of the episodes' returns (groups of ``group_size`` consecutive
    trajectories, which played the same task)."""
    rows = [student_sequence(traj, fmt) for traj in trajs]
    batch = TokenBatch.from_rows(rows, pad_id)
    if scores:
        # Token n of a trajectory's flat scores sits at the n-th response position of its row.
        positions = [[p for start, end in row["response_positions"] for p in range(start, end)] for row in rows]
        batch = with_teacher_scores(batch, positions, scores)
    return with_group_advantages(batch, trajs, group_size)


# -- train, sync, report --------------------------------------------------------------------------
class StepClock:
    """Wall time of a step's phases: :meth:`lap` closes the phase that ran since the last lap.

    :meth:`finish` reports each as ``time/<phase>_s``, the four phases every step reports
    (``generation``, ``teacher_scoring``, ``training``, ``weight_sync``) at 0 where a step has
    no such phase, and ``time/step_s`` from the clock's creation.
    """

    PHASES = ("generation", "teacher_scoring", "training", "weight_sync")

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self.last
        self.last = now

    def record(self, phase: str, seconds: float) -> None:
        """A phase timed elsewhere (e.g. inside a worker); the lap still starts here."""
        self.lap(phase)
        self.seconds[phase] = seconds

    def finish(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` with the phases' times and the step's total."""
        times = {f"time/{phase}_s": 0.0 for phase in self.PHASES}
        times.update({f"time/{phase}_s": seconds for phase, seconds in self.seconds.items()})
        return {**metrics, **times, "time/step_s": time.perf_counter() - self.start}


def train_and_sync(ctx: RunContext, batch: TokenBatch | BatchPlan, clock: StepClock) -> dict[str, float]:
    """Train on ``batch``, or on the batch a :class:`BatchPlan` builds next to the trainer
    (timed as the ``training`` phase from the clock's last lap, so building the batch counts),
    then sync the weights to the rollout engine (``weight_sync``). Returns the trainer's
    metrics, without its own inner timings, and ``weight_sync_mb`` (what a rollout replica
    received: the model, or a LoRA student's adapters)."""
    train_metrics = ctx.workers.train_built(batch) if isinstance(batch, BatchPlan) else ctx.workers.train(batch)
    clock.lap("training")
    synced = ctx.workers.sync_weights()
    clock.record("weight_sync", synced["weight_sync_s"])
    ctx.rollouts.updates += 1
    return {**{k: v for k, v in train_metrics.items() if not k.startswith("time/")},
            "weight_sync_mb": synced.get("weight_sync_mb", 0.0)}


def episode_metrics(trajs: list[Trajectory], gen: dict[str, float], group_size: int = 1) -> dict[str, float]:
    """What every algorithm logs about a step's episodes and their generation: ``success``,
    ``return`` (the mean of the episodes' summed rewards: partial credit shows here, not in
    ``success``) and, for groups of ``group_size`` > 1 episodes of one task (GRPO's), the mean
    spread of the return within a group (``return/group_std``, 0 where every sibling scored the
    same and the group teaches nothing)."""
    turns = [turn for t in trajs for turn in t.turns]
    stale = {k: v for k, v in gen.items() if k == "rollout/staleness" or k.startswith("curriculum/")}
    returns = [t.total_reward for t in trajs]
    groups = {"return/group_std": group_spread(returns, group_size)} if group_size > 1 and trajs else {}
    return stale | groups | {
        "success": success_rate(trajs),
        "return": sum(returns) / max(len(returns), 1),
        "turns_per_episode": len(turns) / max(len(trajs), 1),
        "env_errors": float(sum(t.end_reason == "env_error" for t in trajs)),
        "env_restarts": gen.get("env_restarts", 0.0),
        "env_replays": gen.get("env_replays", 0.0),
        "valid_action_rate": sum(bool(turn.info.get("valid_action", False)) for turn in turns) / max(len(turns), 1),
        "tokens_per_s": gen["generated_tokens"] / max(gen["generation_s"], 1e-9),
    }


def group_spread(values: list[float], group_size: int) -> float:
    """The mean over groups of ``group_size`` consecutive ``values`` of their population standard
    deviation (the spread GRPO's advantages divide by)."""
    groups = [values[i:i + group_size] for i in range(0, len(values), group_size)]
    spreads = [(sum((v - sum(g) / len(g)) ** 2 for v in g) / len(g)) ** 0.5 for g in groups]
    return sum(spreads) / max(len(spreads), 1)


def teacher_metrics(scores: list[TokenScores] | Scored) -> dict[str, float]:
    """The size of the teacher's answer, which crosses from its worker to the trainer."""
    size = scores.payload_bytes if isinstance(scores, Scored) else sum(s.nbytes() for s in scores)
    return {"teacher_payload_mb": size / 2**20}


def sampled_kl(trajs: list[Trajectory], scores: list[TokenScores],
               key: Callable[[Trajectory, int], str]) -> dict[str, float]:
    """Per ``key(trajectory, turn index from 1)``: the mean over the response tokens of trained
    turns of the student's behaviour logprob minus the teacher's (the sampled reverse KL at the
    sampling temperature)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for traj, score in zip(trajs, scores):
        start = 0
        for t, turn in enumerate(traj.turns, start=1):
            n = len(turn.response_ids)
            if turn.trained and n:
                teacher = score.logprobs[start:start + n]
                k = key(traj, t)
                sums[k] = sums.get(k, 0.0) + sum(b - a for b, a in zip(turn.response_logprobs, teacher))
                counts[k] = counts.get(k, 0) + n
            start += n
    return {k: sums[k] / counts[k] for k in sorted(counts)}


def kl_by_turn(trajs: list[Trajectory], scores: list[TokenScores]) -> dict[str, float]:
    """``kl_turn/<t>`` (``t`` from 01, two digits so that the keys sort): :func:`sampled_kl` of
    the trained turns at index ``t``. Compounding errors show as a KL that rises with ``t``
    (docs/curricula.md)."""
    return sampled_kl(trajs, scores, lambda traj, t: f"kl_turn/{t:02d}")


def mix_metrics(trajs: list[Trajectory], scores: list[TokenScores] | None,
                routes: TeacherRoutes | None) -> dict[str, float]:
    """A mixed or multi-teacher step's figures apart (docs/teachers.md): ``success/<env>`` and
    ``return/<env>`` per environment of ``env.mix``, and ``kl/<teacher>`` (:func:`sampled_kl`)
    per teacher when there are several; nothing for a run of one environment."""
    if routes is None or list(routes.env_teacher) == [""]:
        return {}
    out: dict[str, float] = {}
    for env, group in by_environment(trajs).items():
        out[f"success/{env}"] = success_rate(group)
        out[f"return/{env}"] = sum(t.total_reward for t in group) / len(group)
    if scores is not None and len(set(routes.env_teacher.values())) > 1:
        out.update(sampled_kl(trajs, scores, lambda traj, t: f"kl/{routes.teacher_of(traj.task)}"))
    return out


def with_reverse_kl_headline(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with ``reverse_kl_per_token``, the first loss term's reverse KL to the teacher
    (what the progress line and the report plot show), when a term reports one."""
    reverse_kl = [v for k, v in metrics.items() if k.endswith("/reverse_kl")]
    return {**metrics, "reverse_kl_per_token": reverse_kl[0]} if reverse_kl else metrics
