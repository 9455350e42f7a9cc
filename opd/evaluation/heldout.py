"""Greedy success on the held-out tasks, played by the student or the teacher, with every
episode kept token by token in the run directory (``trajectories/eval_{who}_step_N.parquet``,
:mod:`opd.evaluation.trajectories`).

Example:
    >>> record = evaluate(ctx, "student", step=25)  # doctest: +SKIP
    >>> record["eval/student_success"]  # doctest: +SKIP
"""

from __future__ import annotations

from opd.algorithms.base import Role, RunContext
from opd.trajectory import success_rate


def evaluate(ctx: RunContext, who: Role, step: int = 0) -> dict[str, float]:
    """``who`` plays each of ``ctx.eval_tasks`` once, greedily (``ctx.eval_settings``); returns
    ``eval/{who}_success``, ``eval/{who}_turns`` (mean per episode) and ``eval/{who}_time_s``."""
    trajs, gen = ctx.workers.collect(who, ctx.env_factory, ctx.eval_tasks, ctx.eval_settings, ctx.cfg.run.seed)
    ctx.episodes.evaluation(step, who, trajs)
    return {
        f"eval/{who}_success": success_rate(trajs),
        f"eval/{who}_turns": sum(len(t.turns) for t in trajs) / max(len(trajs), 1),
        f"eval/{who}_time_s": gen["generation_s"],
    }
