"""Vanilla on-policy distillation, and state-grounded OPD, for multi-turn agents.

One step, top to bottom:

1. **Rollout.** The student plays ``episodes_per_step`` training tasks (think-then-act at every
   turn), recording each token exactly as sampled with its behaviour logprob.
2. **Supervision.** The teacher scores every student response token under its view of the turn:
   ``full`` (the student's own history, as in vanilla OPD) or ``state_grounded`` (the task, the
   executed actions and the observations only: no student reasoning reaches the teacher, so
   its grades stay in-distribution). All turns of a trajectory share one packed forward.
3. **Update.** One sequence per trajectory (every turn's context in the student's own view is
   a prefix of it) with the recipe's losses, by default the sampled reverse KL used as a
   per-token advantage ``log pi_T - log mu`` with a PPO-clipped importance ratio.
4. **Sync.** The trainer's new weights go into the rollout engine, timed.

Departure from the papers: the per-token advantage is not discounted or summed over future
tokens (each token is graded on its own, as in Tinker's OPD recipe); the papers' multi-turn
OPD does the same for the reverse-KL term.
"""

from __future__ import annotations

import random
import time
from typing import Any

import ray

from opd.chat import student_sequence
from opd.rollout.vanilla import success_rate
from opd.runtime.actors import sync_weights
from opd.trajectory import TokenBatch, Trajectory


def sample_tasks(tasks: list[str], n: int, seed: int, step: int) -> list[str]:
    """Step ``step``'s training tasks: a pure function of (seed, step), so a resumed run draws
    exactly the tasks an uninterrupted one would."""
    rng = random.Random(f"{seed}:{step}")
    return [tasks[rng.randrange(len(tasks))] for _ in range(n)]


def build_token_batch(trajs: list[Trajectory], teacher_scores: list[list[list[float]]], pad_id: int, fmt) -> TokenBatch:
    """One row per trajectory, teacher logprobs placed on the response tokens."""
    rows = []
    for traj, per_turn in zip(trajs, teacher_scores):
        row = student_sequence(traj, fmt)
        teacher = [0.0] * len(row["input_ids"])
        for (start, end), scores in zip(row["response_positions"], per_turn):
            teacher[start:end] = scores
        row["teacher_logprobs"] = teacher
        rows.append(row)
    return TokenBatch.from_rows(rows, pad_id)


def train_step(ctx: Any, step: int) -> dict[str, float]:
    """Run one OPD step; ``ctx`` is the driver's :class:`opd.runtime.driver.RunContext`."""
    cfg, workers = ctx.cfg, ctx.workers
    start = time.perf_counter()
    tasks = sample_tasks(ctx.train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, step)
    trajs, gen = ray.get(workers.rollout.collect.remote(ctx.env_factory, tasks, ctx.train_settings, cfg.run.seed * 100003 + step))
    t_gen = time.perf_counter()
    scores = ray.get(workers.teacher.score.remote(trajs, cfg.supervision.teacher_view, cfg.supervision.score_batch_size))
    t_score = time.perf_counter()
    batch = build_token_batch(trajs, scores, ctx.fmt.pad_id, ctx.fmt)
    train_metrics = ray.get(workers.trainer.train_step.remote(batch))
    t_train = time.perf_counter()
    sync = sync_weights(workers)
    end = time.perf_counter()
    metrics = {k: v for k, v in train_metrics.items() if not k.startswith("time/")}
    metrics.update({
        "success": success_rate(trajs),
        "turns_per_episode": sum(len(t.turns) for t in trajs) / len(trajs),
        "env_errors": float(sum(t.end_reason == "env_error" for t in trajs)),
        "valid_action_rate": _valid_rate(trajs),
        "tokens_per_s": gen["generated_tokens"] / max(gen["generation_s"], 1e-9),
        "time/generation_s": t_gen - start,
        "time/teacher_scoring_s": t_score - t_gen,
        "time/training_s": t_train - t_score,
        "time/weight_sync_s": sync["weight_sync_s"],
        "time/step_s": end - start,
    })
    reverse_kl = [v for k, v in metrics.items() if k.endswith("/reverse_kl")]
    if reverse_kl:
        metrics["reverse_kl_per_token"] = reverse_kl[0]
    return metrics


def _valid_rate(trajs: list[Trajectory]) -> float:
    turns = [turn for t in trajs for turn in t.turns]
    return sum(bool(turn.info.get("valid_action", False)) for turn in turns) / max(len(turns), 1)
