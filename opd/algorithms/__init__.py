"""Algorithms: one file each, composing a rollout strategy, a teacher view and losses.

An algorithm module exposes ``train_step(ctx, step) -> metrics``; the driver calls it once per
training step (see :mod:`opd.runtime.driver`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

ALGORITHMS = {
    "vanilla_opd": "opd.algorithms.vanilla_opd",
    "grpo": "opd.algorithms.grpo",
    "pivot_opd": "opd.algorithms.pivot_opd",
    "actfirst_opd": "opd.algorithms.actfirst_opd",
}


def get_algorithm(name: str) -> ModuleType:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    return importlib.import_module(ALGORITHMS[name])
