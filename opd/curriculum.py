"""Curricula: which states the student learns in, step by step (docs/curricula.md).

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

Two more ways to the same end, each falling away on its own schedule: episodes that start from a
replayed prefix of a reference episode (ReOPD; :func:`draw_starts`, replayed and checked by
:func:`opd.rollout.vanilla.replay_starts`), and turns the teacher plays inside the student's
episodes (Guided-OPD; :func:`guide_share_at`, :func:`opd.rollout.vanilla.guided_turn`). Turns the
student did not play are context too (:func:`is_context`).

Departures from TCOD: the depth counts turns (its stages are in turns too), the schedule is
by training step rather than by epoch, and the teacher still scores the context turns (their
scores carry no loss; skipping them would save teacher time, not change the update).

Example:
    >>> from opd.schema import CurriculumConfig
    >>> cfg = CurriculumConfig(depth="forward", start_depth=2, full_depth_step=5, horizon=10)
    >>> [depth_at(cfg, step, 10) for step in (1, 2, 3, 5, 9)]
    [2, 4, 6, 10, 10]
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any, Callable

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
    episode (``forward``), the last ``depth`` (``backward``), or all (``off``); a turn the student
    did not play (:func:`is_context`) is never trained."""
    for traj in trajs:
        n = len(traj.turns)
        for t, turn in enumerate(traj.turns):
            window = mode == "off" or (t < depth if mode == "forward" else t >= n - depth)
            turn.trained = window and not is_context(turn)


def is_context(turn) -> bool:
    """A turn the student did not play: replayed from a reference, or played by the teacher."""
    return bool(turn.info.get("replayed") or turn.info.get("teacher_played"))


def guide_share_at(cfg: CurriculumConfig, step: int) -> float:
    """The share of turns the teacher plays at ``step``: ``guide_share`` at step 1, falling
    linearly to 0 at ``guide_end_step``."""
    if cfg.guide_share <= 0 or step >= cfg.guide_end_step:
        return 0.0
    return cfg.guide_share * (1 - (step - 1) / max(cfg.guide_end_step - 1, 1))


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


def prefix_fraction_at(cfg: CurriculumConfig, step: int) -> float:
    """The longest prefix at ``step``, as a share of its reference's turns: ``prefix_fraction`` at
    step 1, falling linearly to 0 at ``prefix_end_step``."""
    if cfg.prefix_source == "off" or step >= cfg.prefix_end_step:
        return 0.0
    return cfg.prefix_fraction * (1 - (step - 1) / max(cfg.prefix_end_step - 1, 1))


def draw_starts(cfg: CurriculumConfig, references: dict, tasks: list[str], seed: int,
                step: int) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Step ``step``'s starts, one per episode: ``prefix_share`` of them (a pure function of
    ``(seed, step)``) replay the first L turns of their task's reference, L drawn evenly from 0
    to the step's share of its turns (never the last turn: the student always plays one); the
    others start from the reset (an empty start)."""
    rng = random.Random(f"{seed}:{step}:prefix")
    fraction = prefix_fraction_at(cfg, step)
    starts = []
    for task in tasks:
        ref = references.get(task)
        chosen = rng.random() < cfg.prefix_share
        longest = int(fraction * (len(ref.actions) - 1)) if ref is not None else 0
        length = rng.randint(0, longest) if chosen and longest > 0 else 0
        starts.append(tuple(zip(ref.actions[:length], ref.observations[:length])) if length else ())
    return tuple(starts)


class Curriculum:
    """A run's curriculum: each step's episode settings (a forward depth's turns, the prefixes
    its episodes start from) and which of their turns train.

    Args:
        cfg: the recipe.
        references: ``tasks -> {task: Reference}``, the prefixes' reference episodes (the driver
            loads them as ActFirst's, :func:`opd.rollout.references.load_references`); needed
            when ``curriculum.prefix_source`` is on.
    """

    def __init__(self, cfg: Any, references: Callable[[list[str]], dict] | None = None):
        self.cfg = cfg.curriculum
        self.seed = int(cfg.run.seed)
        self.horizon = horizon_of(cfg) if self.cfg.depth != "off" else 0
        self.references = references

    @property
    def on(self) -> bool:
        return self.cfg.depth != "off" or self.cfg.prefix_source != "off" or self.cfg.guide_share > 0

    def depth(self, step: int) -> int:
        return depth_at(self.cfg, step, self.horizon) if self.cfg.depth != "off" else 0

    def settings(self, settings: Any, step: int, tasks: list[str] | None = None) -> Any:
        """``settings`` for step ``step``'s episodes of ``tasks``: a forward curriculum plays
        ``depth`` turns; episodes start from their drawn prefixes."""
        if self.cfg.depth == "forward" and self.depth(step) < self.horizon:
            settings = replace(settings, max_turns=self.depth(step))
        if tasks is not None and prefix_fraction_at(self.cfg, step) > 0 and self.references is not None:
            settings = replace(settings, starts=draw_starts(self.cfg, self.references(tasks), tasks, self.seed, step))
        if guide_share_at(self.cfg, step) > 0:
            settings = replace(settings, guide_share=guide_share_at(self.cfg, step))
        return settings

    def mark(self, trajs: list[Trajectory], step: int) -> dict[str, float]:
        """Mark step ``step``'s episodes' trained turns (the replayed ones are context already);
        the metrics to log (none when off)."""
        if not self.on:
            return {}
        metrics = {}
        if self.cfg.depth != "off":
            depth = self.depth(step)
            mark_trained_turns(trajs, depth, self.cfg.depth if depth < self.horizon else "off")
            metrics["curriculum/depth"] = float(depth)
        turns = [turn for traj in trajs for turn in traj.turns]
        if self.cfg.prefix_source != "off":
            metrics["curriculum/prefix_turns"] = sum(bool(t.info.get("replayed")) for t in turns) / max(len(trajs), 1)
        if self.cfg.guide_share > 0:
            metrics["curriculum/guide_share"] = guide_share_at(self.cfg, step)
            metrics["curriculum/teacher_turns"] = sum(bool(t.info.get("teacher_played")) for t in turns) / max(len(trajs), 1)
        metrics["curriculum/trained_turn_share"] = sum(t.trained for t in turns) / max(len(turns), 1)
        return metrics
