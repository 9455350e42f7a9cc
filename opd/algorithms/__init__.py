"""Algorithms: one file each, composing a rollout strategy, a teacher view and losses.

Each module reads top to bottom (its docstring: "One step, top to bottom", then where it departs
from its paper) and ends with an :class:`opd.algorithms.base.Algorithm`: its ``train_step(ctx,
step) -> metrics``, called by the driver once per training step, and the recipe rules it adds.
The pieces every step shares live in :mod:`opd.algorithms.step`. :data:`ALGORITHMS` is the one
registry of names; add a module and its name here to add an algorithm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opd.algorithms.base import Algorithm

ALGORITHMS = {
    "vanilla_opd": "opd.algorithms.vanilla_opd",
    "grpo": "opd.algorithms.grpo",
    "pivot_opd": "opd.algorithms.pivot_opd",
    "actfirst_opd": "opd.algorithms.actfirst_opd",
}


def get_algorithm(name: str) -> Algorithm:
    """The :class:`opd.algorithms.base.Algorithm` registered as ``name`` (its module is imported
    only now: the registry itself imports nothing)."""
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    algorithm = importlib.import_module(ALGORITHMS[name]).ALGORITHM
    assert algorithm.name == name, f"{ALGORITHMS[name]} declares {algorithm.name!r}, registered as {name!r}"
    return algorithm
