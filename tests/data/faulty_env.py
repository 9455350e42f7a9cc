"""A FrozenLake text env that fails on purpose, for the fault-isolation tests.

On tasks whose number is 1 modulo ``every``, the step of turn ``at_turn`` raises, hangs or kills
its process (``fault``); ``fault="slow"`` instead makes every step of every task take
``step_delay_s`` longer, like an engine that computes. Every other task plays exactly like
``opd/FrozenLakeText-v0``.
Registered as ``opdtest/FaultyFrozenLake-v0`` when imported (a recipe names this module in
``env.module``, as a user's own environment package would be).
"""

from __future__ import annotations

import os
import time

import gymnasium

from environments.frozenlake import FrozenLakeTextEnv


class FaultyFrozenLakeEnv(FrozenLakeTextEnv):
    """FrozenLake whose step raises, hangs or crashes on some tasks (tests only)."""

    def __init__(self, fault: str = "raise", every: int = 4, at_turn: int = 2, step_delay_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.fault, self.every, self.at_turn, self.step_delay_s = fault, every, at_turn, step_delay_s

    def faulty(self, task: str) -> bool:
        return int(task.rsplit("-", 1)[1]) % self.every == 1

    def step(self, action: str):
        if self.fault == "slow":
            time.sleep(self.step_delay_s)
            return super().step(action)
        if self.faulty(self._task) and self._turn + 1 == self.at_turn:
            if self.fault == "raise":
                raise RuntimeError(f"simulated engine failure on {self._task}")
            if self.fault == "hang":
                time.sleep(3600)
            if self.fault == "crash":
                os._exit(3)
        return super().step(action)


if "opdtest/FaultyFrozenLake-v0" not in gymnasium.registry:
    gymnasium.register(id="opdtest/FaultyFrozenLake-v0", entry_point="tests.data.faulty_env:FaultyFrozenLakeEnv")
