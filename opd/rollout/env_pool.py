"""Environments out of the policy's process: one child process per episode slot, every call
bounded by a timeout.

An environment that raises, crashes its process (a segfault in a native engine, ``os._exit``)
or hangs cannot take the rollout worker down with it: the slot's call comes back as an
:class:`EnvFailure`, the child is killed and a fresh one is started on the slot's next use, and
every other slot goes on untouched. The rollout loop marks the failed episode
(``end_reason="env_error"``) and keeps the rest.

Children come from a ``forkserver`` that imported the environments once, so a new child costs
milliseconds, not an interpreter start-up; they never inherit the policy's threads or CUDA
state.

:class:`InProcessEnvs` offers the same calls with the environments in this process (no timeout):
for tests, debugging and the scripted bootstrap.

Example:
    >>> with EnvWorkerPool(EnvFactory("opd/FrozenLakeText-v0"), timeout_s=30) as pool:  # doctest: +SKIP
    ...     (obs, info), = pool.reset_many([(0, "fl4-train-00001", 0)])
    ...     (result,) = pool.step_many([(0, "down")])
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

EnvFactoryType = Callable[[], Any]


@dataclass(frozen=True)
class EnvFailure:
    """Why a slot's call produced no result: ``error`` (the env raised), ``crash`` (its process
    died) or ``timeout`` (no answer in time), with a message for the trajectory."""

    kind: str
    message: str


def _serve(conn: Connection, factory: EnvFactoryType) -> None:
    """Child process: one environment, commands in, results (or the exception's text) out."""
    env = None
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:
            return
        if command == "close":
            if env is not None:
                env.close()
            return
        try:
            if env is None:
                env = factory()
            if command == "reset":
                task, seed = args
                result = env.reset(seed=seed, options={"task": task})
            else:
                result = env.step(args[0])
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - every env failure goes back as data
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


@contextlib.contextmanager
def _main_module_hidden():
    """While a child starts, hide this process's ``__main__`` from multiprocessing.

    A child would otherwise import the parent's main module first: in a Ray actor that is Ray's
    worker script, which imports all of Ray into every environment process (measured: 32 such
    children made a quickstart step 6x slower), and in a user's unguarded script it would rerun
    the script. Environments never need it: they are built from the picklable factory.
    """
    main = sys.modules["__main__"]
    saved_spec = getattr(main, "__spec__", None)
    saved_file = main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


class _Slot:
    def __init__(self, ctx, factory: EnvFactoryType):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, factory), daemon=True)
        with _main_module_hidden():
            self.process.start()
        child.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class EnvWorkerPool:
    """Environments in child processes, one per slot, with a per-call timeout.

    Args:
        factory: picklable zero-argument callable making one environment (:class:`opd.envs.EnvFactory`).
        timeout_s: how long a reset or step may take before the slot counts as hung.
        preload: modules the forkserver imports once, so children start warm.
    """

    def __init__(self, factory: EnvFactoryType, timeout_s: float = 60.0, preload: tuple[str, ...] = ("environments",)):
        self.factory = factory
        self.timeout_s = float(timeout_s)
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(preload))
        self._slots: dict[int, _Slot] = {}
        self.restarts = 0

    def _slot(self, i: int) -> _Slot:
        if i not in self._slots:
            self._slots[i] = _Slot(self._ctx, self.factory)
        return self._slots[i]

    def _call_many(self, calls: list[tuple[int, tuple]], while_waiting: Callable[[], bool] | None = None,
                   grace_s: float = 0.0) -> list[Any]:
        """Send every call, then gather the answers against one deadline.

        ``while_waiting`` is the caller's own work, run in this thread while no answer is in:
        one short unit per call, returning ``False`` when there is none left (then this waits
        for the answers without calling it again). It first runs after ``grace_s`` without an
        answer: answers that come sooner are not held up by a unit of work. The deadline holds
        either way.
        """
        results: dict[int, Any] = {}
        waiting: dict[Connection, int] = {}
        for i, message in calls:
            slot = self._slot(i)
            try:
                slot.conn.send(message)
                waiting[slot.conn] = i
            except (BrokenPipeError, OSError):
                results[i] = self._fail(i, "crash", "its process had died before the call")
        deadline = time.monotonic() + self.timeout_s
        busy = while_waiting is not None  # until the caller's work runs out
        grace = grace_s if busy else 0.0
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, min(grace, deadline - time.monotonic())))
            grace = 0.0
            if not ready and busy and time.monotonic() < deadline:
                busy = while_waiting()
                continue
            if not ready:
                ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for conn, i in waiting.items():
                    results[i] = self._fail(i, "timeout", f"no answer within {self.timeout_s:g} s (env.timeout_s); "
                                                          "the environment's process was killed")
                break
            for conn in ready:
                i = waiting.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    code = self._slots[i].process.exitcode
                    results[i] = self._fail(i, "crash", f"its process died (exit code {code})")
                    continue
                results[i] = payload if status == "ok" else EnvFailure("error", payload.strip())
        return [results[i] for i, _ in calls]

    def _fail(self, i: int, kind: str, message: str) -> EnvFailure:
        self._slots.pop(i).kill()
        self.restarts += 1
        return EnvFailure(kind, f"environment {kind}: {message}")

    def reset_many(self, resets: list[tuple[int, str, int]]) -> list[Any]:
        """``[(slot, task, seed)] -> [(obs, info) | EnvFailure]``."""
        return self._call_many([(i, ("reset", task, seed)) for i, task, seed in resets])

    def step_many(self, steps: list[tuple[int, str]], while_waiting: Callable[[], bool] | None = None,
                  grace_s: float = 0.0) -> list[Any]:
        """``[(slot, action)] -> [(obs, reward, terminated, truncated, info) | EnvFailure]``;
        ``while_waiting`` runs while the children step (see :meth:`_call_many`)."""
        return self._call_many([(i, ("step", action)) for i, action in steps], while_waiting, grace_s)

    def close(self) -> None:
        for slot in self._slots.values():
            try:
                slot.conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        for slot in self._slots.values():
            slot.process.join(timeout=2)
            if slot.process.is_alive():
                slot.process.kill()
            slot.conn.close()
        self._slots.clear()

    def __enter__(self) -> "EnvWorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcessEnvs:
    """The pool's calls with the environments in this process: no isolation, no timeout."""

    def __init__(self, factory: EnvFactoryType):
        self.factory = factory
        self._envs: dict[int, Any] = {}
        self.restarts = 0

    def _run(self, i: int, call: Callable[[Any], Any]) -> Any:
        try:
            if i not in self._envs:
                self._envs[i] = self.factory()
            return call(self._envs[i])
        except Exception as exc:  # noqa: BLE001
            self._envs.pop(i, None)
            return EnvFailure("error", f"{type(exc).__name__}: {exc}")

    def reset_many(self, resets: list[tuple[int, str, int]]) -> list[Any]:
        return [self._run(i, lambda env: env.reset(seed=seed, options={"task": task})) for i, task, seed in resets]

    def step_many(self, steps: list[tuple[int, str]], while_waiting: Callable[[], bool] | None = None,
                  grace_s: float = 0.0) -> list[Any]:
        """The steps one after another in this thread: ``while_waiting`` never runs."""
        return [self._run(i, lambda env: env.step(action)) for i, action in steps]

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()

    def __enter__(self) -> "InProcessEnvs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
