"""Greedy success on the held-out tasks, played by the student or the teacher, with every
episode kept as readable text in the run directory (``trajectories/{who}_step_N.jsonl``).

Example:
    >>> record = evaluate(ctx, "student", step=25)  # doctest: +SKIP
    >>> record["eval/student_success"]  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

from opd.algorithms.base import Role, RunContext
from opd.training.checkpoint import atomic_write_text
from opd.trajectory import Trajectory, success_rate


def evaluate(ctx: RunContext, who: Role, step: int = 0) -> dict[str, float]:
    """``who`` plays each of ``ctx.eval_tasks`` once, greedily (``ctx.eval_settings``); returns
    ``eval/{who}_success``, ``eval/{who}_turns`` (mean per episode) and ``eval/{who}_time_s``."""
    trajs, gen = ctx.workers.collect(who, ctx.env_factory, ctx.eval_tasks, ctx.eval_settings, ctx.cfg.run.seed)
    write_trajectories(Path(ctx.cfg.run.output_dir) / "trajectories" / f"{who}_step_{step}.jsonl", trajs)
    return {
        f"eval/{who}_success": success_rate(trajs),
        f"eval/{who}_turns": sum(len(t.turns) for t in trajs) / max(len(trajs), 1),
        f"eval/{who}_time_s": gen["generation_s"],
    }


def write_trajectories(path: Path, trajs: list[Trajectory]) -> None:
    """One JSON line per episode: task, outcome, and each turn's action, observation and info."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for traj in trajs:
        turns = [{"action": t.action_text, "observation": t.observation, "reward": t.reward, **t.info} for t in traj.turns]
        lines.append(json.dumps({"task": traj.task, "success": traj.success, "end_reason": traj.end_reason,
                                 "error": traj.error, "turns": turns}))
    atomic_write_text(path, "\n".join(lines) + "\n")
