"""Turn-depth curricula: which turns of its episodes the student learns in, step by step.

On long episodes vanilla multi-turn OPD can break down: an early mistake takes the student into
states the teacher never visits, where its grades mean little, and the KL climbs while success
falls. TCOD (arXiv 2604.24005) controls the depth of the episode the student trains on, growing it
from ``curriculum.start_depth`` turns to the whole horizon by step ``curriculum.full_depth_step``:

- ``forward``: forward-to-backward; only the first d turns are played (an episode ends after
  them, ``end_reason="depth_limit"``) and trained, so the student first learns the states near
  the start, where it and the teacher agree on where they are.
- ``backward``: backward-to-forward; every turn is played, only the last d of each episode train.

The depth grows ``linear``-ly (evenly, from step 1 to ``full_depth_step``) or in ``step``-s (in
``curriculum.stages`` equal jumps). A turn outside the window stays in the episode as context
(:attr:`opd.trajectory.Turn.trained` is false: no loss on its tokens, in every algorithm's batch)
and is marked ``context`` in the episode files. Each step logs ``curriculum/depth``.

Departures from the paper: the depth counts turns (its stages are in turns too), the schedule is
by training step rather than by epoch, and the teacher still scores the context turns (their
scores carry no loss; skipping them would save teacher time, not change the update).

Example:
    >>> from opd.schema import CurriculumConfig
    >>> cfg = CurriculumConfig(depth="forward", start_depth=2, full_depth_step=5, horizon=10)
    >>> [depth_at(cfg, step, 10) for step in (1, 2, 3, 5, 9)]
    [2, 4, 6, 10, 10]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from opd.schema import ConfigError, CurriculumConfig
from opd.trajectory import Trajectory


def depth_at(cfg: CurriculumConfig, step: int, horizon: int) -> int:
    """The number of turns trained at ``step`` (1-based) out of ``horizon``; ``horizon`` when the
    curriculum is off or its schedule has ended."""
    if cfg.depth == "off" or step >= cfg.full_depth_step:
        return horizon
    start = min(cfg.start_depth, horizon)
    progress = (step - 1) / max(cfg.full_depth_step - 1, 1)  # 0 at step 1, 1 at full_depth_step
    if cfg.schedule == "step":
        progress = int(progress * cfg.stages) / cfg.stages
    return min(horizon, start + round((horizon - start) * progress))


def mark_trained_turns(trajs: list[Trajectory], depth: int, mode: str) -> None:
    """Set each turn's :attr:`~opd.trajectory.Turn.trained`: the first ``depth`` turns of every
    episode (``forward``), the last ``depth`` (``backward``), or all (``off``)."""
    for traj in trajs:
        n = len(traj.turns)
        for t, turn in enumerate(traj.turns):
            turn.trained = mode == "off" or (t < depth if mode == "forward" else t >= n - depth)


def horizon_of(cfg: Any, env: Any = None) -> int:
    """``curriculum.horizon``, else the env's ``max_turns`` (from its kwargs, or the env made
    here when ``env`` is None).

    Raises:
        ConfigError: the curriculum is on and neither gives a horizon.
    """
    if cfg.curriculum.horizon:
        return int(cfg.curriculum.horizon)
    turns = (cfg.env.kwargs or {}).get("max_turns")
    if turns is None:
        if env is None:
            from opd.envs import EnvFactory

            env = EnvFactory.of(cfg.env)()
            try:
                turns = getattr(env.unwrapped, "max_turns", None)
            finally:
                env.close()
        else:
            turns = getattr(env.unwrapped, "max_turns", None)
    if not turns:
        raise ConfigError(f"key 'curriculum.horizon' is 0 and env {cfg.env.id!r} has no max_turns; set "
                          "curriculum.horizon to the number of turns of a whole episode.")
    return int(turns)


class DepthCurriculum:
    """A run's turn-depth curriculum: the episode settings of each step, and its turns' marks."""

    def __init__(self, cfg: Any):
        self.cfg = cfg.curriculum
        self.horizon = horizon_of(cfg) if self.cfg.depth != "off" else 0

    @property
    def on(self) -> bool:
        return self.cfg.depth != "off"

    def depth(self, step: int) -> int:
        return depth_at(self.cfg, step, self.horizon) if self.on else 0

    def settings(self, settings: Any, step: int) -> Any:
        """``settings`` for step ``step``'s episodes: a forward curriculum plays ``depth`` turns."""
        if self.cfg.depth == "forward" and self.depth(step) < self.horizon:
            return replace(settings, max_turns=self.depth(step))
        return settings

    def mark(self, trajs: list[Trajectory], step: int) -> dict[str, float]:
        """Mark step ``step``'s episodes' trained turns; the metrics to log (none when off)."""
        if not self.on:
            return {}
        depth = self.depth(step)
        mark_trained_turns(trajs, depth, self.cfg.depth if depth < self.horizon else "off")
        turns = [turn for traj in trajs for turn in traj.turns]
        return {"curriculum/depth": float(depth),
                "curriculum/trained_turn_share": sum(t.trained for t in turns) / max(len(turns), 1)}
