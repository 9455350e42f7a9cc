"""A FrozenLake text env that fails on purpose, for the fault-isolation tests.

On tasks whose number is 1 modulo ``every``, the step of turn ``at_turn`` misbehaves (``fault``):

    * ``raise``, ``hang``, ``crash``: raises, sleeps an hour, or kills its process;
    * ``allocate``: allocates ``allocate_mb`` MiB (in 64 MiB pieces, each written);
    * ``spin``: computes in a loop for ``spin_s`` seconds of wall-clock time;
    * ``unserialisable``: returns an info holding an object JSON cannot carry;
    * ``huge``: returns an observation of ``huge_chars`` characters;
    * ``forge``: writes ``forged`` straight onto its process's pipe to the pool, as a
      compromised engine could: ``pickle`` (a pickle that, if loaded, creates ``marker_path``),
      ``garbage`` (bytes that are not JSON), ``oversized`` (``huge_chars`` bytes, past the pool's
      own size check) or ``bad_shape`` (the protocol's JSON with a 3-value step result).

``fault="slow"`` instead makes every step of every task take ``step_delay_s`` longer, like an
engine that computes; ``fault="unseeded"`` puts its process's id into every observation, like an
engine whose state is not a function of its seed and actions. Every other task plays exactly like ``opd/FrozenLakeText-v0``.
Registered as ``opdtest/FaultyFrozenLake-v0`` when imported (a recipe names this module in
``env.module``, as a user's own environment package would be).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from multiprocessing.connection import Connection

import gymnasium

from environments.frozenlake import FrozenLakeTextEnv


class FaultyFrozenLakeEnv(FrozenLakeTextEnv):
    """FrozenLake whose step misbehaves on some tasks (tests only): see the module docstring."""

    def __init__(self, fault: str = "raise", every: int = 4, at_turn: int = 2, step_delay_s: float = 0.0,
                 allocate_mb: int = 2048, spin_s: float = 60.0, huge_chars: int = 2**20, forged: str = "pickle",
                 marker_path: str = "", **kwargs):
        super().__init__(**kwargs)
        self.fault, self.every, self.at_turn, self.step_delay_s = fault, every, at_turn, step_delay_s
        self.allocate_mb, self.spin_s, self.huge_chars = allocate_mb, spin_s, huge_chars
        self.forged, self.marker_path = forged, marker_path

    def faulty(self, task: str) -> bool:
        return int(task.rsplit("-", 1)[1]) % self.every == 1

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        return (f"{obs} [process {os.getpid()}]" if self.fault == "unseeded" else obs), info

    def step(self, action: str):
        if self.fault == "unseeded":
            obs, *rest = super().step(action)
            return (f"{obs} [process {os.getpid()}]", *rest)
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
            if self.fault == "allocate":
                pieces = [bytearray(b"x" * 2**26) for _ in range(self.allocate_mb // 64)]
                return f"held {len(pieces)} pieces", 0.0, False, False, {}
            if self.fault == "spin":
                end = time.monotonic() + self.spin_s
                while time.monotonic() < end:  # all CPU, no sleeping
                    pass
            if self.fault == "unserialisable":
                obs, reward, terminated, truncated, info = super().step(action)
                return obs, reward, terminated, truncated, {**info, "engine_state": object()}
            if self.fault == "huge":
                return "x" * self.huge_chars, 0.0, False, False, {}
            if self.fault == "forge":
                self._forge()
        return super().step(action)

    def _forge(self) -> None:
        conn = _pipe_to_pool()
        if self.forged == "pickle":
            conn.send_bytes(pickle.dumps(LeavesAMark(self.marker_path)))
        elif self.forged == "garbage":
            conn.send_bytes(b"\x80\x04 not json \xff")
        elif self.forged == "oversized":
            conn.send_bytes(b"x" * self.huge_chars)
        elif self.forged == "bad_shape":
            conn.send_bytes(json.dumps({"status": "ok", "result": ["obs", 0.0, False]}).encode())
        time.sleep(3600)  # the pool has its answer; nothing else follows


class LeavesAMark:
    """Unpickling this creates ``path``: what a hostile pickle could do (run any callable), harmlessly."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _pipe_to_pool() -> Connection:
    """The child's end of its pipe to the pool, found in the frames that called ``step``."""
    frame = sys._getframe()
    while frame is not None:
        conn = frame.f_locals.get("conn")
        if isinstance(conn, Connection):
            return conn
        frame = frame.f_back
    raise RuntimeError("not running in an EnvWorkerPool child")


if "opdtest/FaultyFrozenLake-v0" not in gymnasium.registry:
    gymnasium.register(id="opdtest/FaultyFrozenLake-v0", entry_point="tests.data.faulty_env:FaultyFrozenLakeEnv")
