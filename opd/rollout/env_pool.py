"""Environments out of the policy's process: one child process per episode slot, every call
bounded by a timeout, every child bounded in memory and CPU time.

An environment that raises, crashes its process (a segfault in a native engine, ``os._exit``),
hangs or runs past a limit cannot take the rollout worker down with it: the slot's call comes
back as an :class:`EnvFailure`, the child is killed and a fresh one is started on the slot's next
use, and every other slot goes on untouched. The rollout loop marks the failed episode
(``end_reason="env_error"``) and keeps the rest.

A child whose process died (killed from outside, the OOM killer, a crash) is first given one
chance to carry on: a fresh child replays the episode's calls so far (its reset and steps), each
answer checked against the one the dead child gave (a hash of its bytes), and then takes the call
that failed. An environment that is a function of its seed and its actions, as every one in
``environments/`` is, continues exactly where it was, and the episode is the one an unbroken run
plays (``replays`` counts these). A replay that answers differently, or a call that crashes
again (a crash the action itself causes), is the :class:`EnvFailure` it would have been.

Children come from a ``forkserver`` that imported the environments once, so a new child costs
milliseconds, not an interpreter start-up; they never inherit the policy's threads or CUDA
state.

Trust runs one way:
    * Parent → child (the factory, pickled when a child starts, and the commands) is pickle: the
      parent is the trusted side, and it is the parent's own code that it sends.
    * Child → parent is JSON bytes (``send_bytes``/``recv_bytes``), at most ``max_result_bytes``
      a message, and the parent checks the shape: ``reset`` → ``(observation: str, info: dict)``,
      ``step`` → ``(observation: str, reward: number, terminated: bool, truncated: bool,
      info: dict)``. An environment process that is compromised (a native engine fed a hostile
      action) can send nothing that runs code in the rollout worker: the worst it can send is a
      wrong answer of the right shape. Anything else is an :class:`EnvFailure` that says what
      was wrong, and the slot restarts: the parent no longer trusts that child's replies.

JSON carries exactly what every environment in ``environments/`` returns (str, int, float, bool,
None, lists and str-keyed dicts, checked by playing each one), so for them a result is equal to
:class:`InProcessEnvs`'s. A user's environment may see these changes: tuples arrive as lists,
dict keys as strings, numpy scalars and arrays as Python numbers and lists, sets as sorted lists,
the reward as a float; any other object is an ``error`` that names where in the answer it is.

Limits, per child (0 turns one off):
    * ``memory_limit_mb``: ``RLIMIT_DATA``, set when the child starts. Not ``RLIMIT_AS``: that
      counts reserved address space, which engines reserve far more of than they use (a JVM
      reserves its whole maximum heap and a gigabyte of class space up front; glibc 64 MiB per
      thread arena). Measured: ScienceWorld's and TextWorldExpress's JVMs map 8.8 GiB on a
      23 GiB machine and do not start under an ``RLIMIT_AS`` of 4 GiB, so an address-space cap
      either breaks them or is too high to stop anything. ``RLIMIT_DATA`` counts the writable
      private memory a process has asked for (heap, anonymous maps, thread stacks): what a
      runaway allocation grows. An allocation past it fails (``MemoryError`` in Python).
      Processes the environment starts (the JVMs) inherit the limit, each with its own count;
      a JVM is also told to size its heap from the limit rather than from the machine
      (``JAVA_TOOL_OPTIONS=-XX:MaxRAM=<limit>``: heap at most a quarter of the limit), or on a
      large node its first heap alone would pass the limit.
    * ``cpu_time_limit_s``: CPU time of one call (all the child's threads), by a profiling timer
      (``ITIMER_PROF``) armed before each command and disarmed after; on expiry ``SIGPROF``
      ends the process, even inside native code. Not ``RLIMIT_CPU``: that limit is inherited by
      the processes an environment starts, and counts their whole lifetime, so it would kill
      ScienceWorld's JVM, which lives across every episode of a run, after a minute of its total
      CPU time. Interval timers are not inherited across ``fork``. CPU time of those
      processes themselves is bounded only by the wall-clock timeout.
    An environment over a limit ends as an :class:`EnvFailure` of kind ``limit`` whose message
    names the limit and how to raise it, and its slot restarts.

:class:`InProcessEnvs` offers the same calls with the environments in this process: no timeout,
no limits, no JSON (the env's own objects come back): for tests, debugging and the scripted
bootstrap.

Example:
    >>> with EnvWorkerPool(EnvFactory("opd/FrozenLakeText-v0"), timeout_s=30) as pool:  # doctest: +SKIP
    ...     (obs, info), = pool.reset_many([(0, "fl4-train-00001", 0)])
    ...     (result,) = pool.step_many([(0, "down")])
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import numpy as np

EnvFactoryType = Callable[[], Any]

# A child that ran out of memory and could not even send the error ends with this code.
_OUT_OF_MEMORY_EXIT = 86


@dataclass(frozen=True)
class EnvFailure:
    """Why a slot's call produced no result: ``error`` (the env raised, or answered something
    that is not a reset/step result), ``crash`` (its process died), ``timeout`` (no answer in
    time) or ``limit`` (it ran past ``memory_limit_mb`` or ``cpu_time_limit_s``), with a
    message for the trajectory."""

    kind: str
    message: str


@dataclass(frozen=True)
class _ChildLimits:
    memory_limit_mb: float
    cpu_time_limit_s: float
    max_result_bytes: int

    def memory_hint(self) -> str:
        return (f"its memory is limited to {self.memory_limit_mb:g} MiB (env.memory_limit_mb); raise it if the "
                "environment needs more, or set 0 for no limit")


def pool_counts(envs: Any) -> dict[str, float]:
    """A pool's counts so far (0 without one): ``env_restarts``, children started again, and
    ``env_replays``, episodes carried on after a replay. Callers log the difference around a call."""
    return {"env_restarts": float(getattr(envs, "restarts", 0)), "env_replays": float(getattr(envs, "replays", 0))}


# ----- child side -----
def _serve(conn: Connection, factory: EnvFactoryType, limits: _ChildLimits) -> None:
    """Child process: one environment, pickled commands in, JSON answers out."""
    if limits.memory_limit_mb > 0:
        limit = int(limits.memory_limit_mb * 2**20)
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        # Soft and hard alike: the environment cannot raise its own limit again.
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        # A JVM sizes its heap from the machine's memory (initial 1/64, at most 1/4), not from this
        # limit: on a 1 TiB node its first heap alone would pass 4 GiB and it would not start.
        # MaxRAM makes it size from the limit instead; flags given later (-Xmx...) still win.
        os.environ["JAVA_TOOL_OPTIONS"] = f"-XX:MaxRAM={limit} {os.environ.get('JAVA_TOOL_OPTIONS', '')}".strip()
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
            _arm_cpu_timer(limits.cpu_time_limit_s)
            try:
                if env is None:
                    env = factory()
                if command == "reset":
                    task, seed = args
                    result = env.reset(seed=seed, options={"task": task})
                else:
                    result = env.step(args[0])
                answer = _encode_result(command, result, limits.max_result_bytes)
            except MemoryError:
                raise  # below: it restarts the slot, where another exception does not
            except _UnsendableAnswer as exc:  # its message says it all; no traceback of this module
                answer = _encode({"status": "error", "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - every env failure goes back as data
                answer = _encode({"status": "error", "message": _exception_text(exc)})
            finally:
                _arm_cpu_timer(0)
        except MemoryError as exc:
            try:
                answer = _encode({"status": "out_of_memory", "message": _exception_text(exc)})
            except MemoryError:
                os._exit(_OUT_OF_MEMORY_EXIT)
        conn.send_bytes(answer)


def _arm_cpu_timer(seconds: float) -> None:
    """Ends this process with ``SIGPROF`` after ``seconds`` of its CPU time (0: disarm)."""
    if seconds > 0:
        # The default action, whatever the environment installed: terminate, even inside C code.
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_PROF, seconds)


def _exception_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"


class _UnsendableAnswer(Exception):
    """A reset/step result that JSON cannot carry, or too large a one."""


def _encode(answer: dict) -> bytes:
    return json.dumps(answer, default=_json_value).encode("ascii")


def _json_value(value: Any) -> Any:
    """``json.dumps``'s fallback: numpy scalars and arrays, sets; TypeError for anything else."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(value)  # a set's order differs from process to process
        except TypeError:
            return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _encode_result(command: str, result: Any, max_result_bytes: int) -> bytes:
    try:
        data = _encode({"status": "ok", "result": result})
    except (TypeError, ValueError, RecursionError) as exc:
        where = _unencodable_path(result, f"{command}()") or f"{command}()'s answer ({type(exc).__name__}: {exc})"
        raise _UnsendableAnswer(f"the environment's answer cannot be sent as JSON: {where}; return str, int, "
                                "float, bool, None, lists and str-keyed dicts") from None
    if len(data) > max_result_bytes:
        raise _UnsendableAnswer(f"the environment's {command}() answer is {len(data)} bytes of JSON, over "
                                f"max_result_bytes={max_result_bytes}; return less, or raise max_result_bytes")
    return data


def _unencodable_path(value: Any, path: str, depth: int = 0) -> str | None:
    """Where in ``value`` the first thing JSON cannot carry is, e.g. ``step()[4]['board']``."""
    if depth > 100:
        return f"{path} (nested over 100 deep, or a cycle)"
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        for key in value:
            if not (key is None or isinstance(key, (str, int, float, bool))):
                return f"{path} has a {type(key).__name__} key {key!r}"
        items = value.items()
    else:
        try:
            return _unencodable_path(_json_value(value), path, depth + 1)
        except TypeError:
            return f"{path} is a {type(value).__module__}.{type(value).__qualname__}"
    for key, item in items:
        where = _unencodable_path(item, f"{path}[{key!r}]", depth + 1)
        if where:
            return where
    return None


# ----- parent side -----
class _BadReply(Exception):
    """A reply that is not the protocol's JSON: the child cannot be trusted to go on."""


def _decode_reply(data: bytes) -> tuple[str, Any]:
    """``(status, result or message)`` of a child's JSON reply; ``_BadReply`` if it is not one."""
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _BadReply(f"its reply is not JSON ({type(exc).__name__}: {str(exc)[:200]}); "
                        f"first bytes: {data[:40]!r}") from None
    if not isinstance(reply, dict) or reply.get("status") not in ("ok", "error", "out_of_memory"):
        raise _BadReply(f"its reply is not an answer of the protocol: {str(reply)[:200]}")
    if reply["status"] == "ok":
        return "ok", reply.get("result")
    message = reply.get("message")
    if not isinstance(message, str):
        raise _BadReply(f"its {reply['status']} reply has no message: {str(reply)[:200]}")
    return reply["status"], message


def _checked_result(command: str, result: Any) -> tuple:
    """The reset/step result as a tuple; ValueError naming what is wrong with its shape."""
    names = ("observation", "info") if command == "reset" else \
        ("observation", "reward", "terminated", "truncated", "info")
    if not isinstance(result, list) or len(result) != len(names):
        got = f"{len(result)} values" if isinstance(result, list) else f"a {type(result).__name__}"
        raise ValueError(f"{command}() returned {got}; expected ({', '.join(names)})")
    values = dict(zip(names, result))
    expected = {"observation": str, "info": dict, "terminated": bool, "truncated": bool}
    for name, kind in expected.items():
        if name in values and not isinstance(values[name], kind):
            raise ValueError(f"{command}()'s {name} is a {type(values[name]).__name__} "
                             f"({str(values[name])[:80]!r}); expected a {kind.__name__}")
    if command == "step":
        reward = values["reward"]
        if not isinstance(reward, (int, float)):
            raise ValueError(f"step()'s reward is a {type(reward).__name__} ({str(reward)[:80]!r}); expected a number")
        result[1] = float(reward)
    return tuple(result)


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
    def __init__(self, ctx, factory: EnvFactoryType, limits: _ChildLimits):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, factory, limits), daemon=True)
        with _main_module_hidden():
            self.process.start()
        child.close()
        self.message: tuple = ("",)  # the call in flight

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class EnvWorkerPool:
    """Environments in child processes, one per slot, with a per-call timeout and per-child limits.

    Args:
        factory: picklable zero-argument callable making one environment (:class:`opd.envs.EnvFactory`).
        timeout_s: how long a reset or step may take before the slot counts as hung.
        preload: modules the forkserver imports once, so children start warm.
        memory_limit_mb: data memory a child (and each process it starts) may use, in MiB
            (``RLIMIT_DATA``); 0 for no limit. Measured peaks: 0.13 GiB for a FrozenLake, SQL or
            clinical child, 0.15-0.17 GiB for BFCL, TextWorld and ALFWorld, and 0.14 GiB plus
            a JVM of 0.2-0.35 GiB for ScienceWorld and TextWorldExpress.
        cpu_time_limit_s: CPU time one reset or step may take in the child, all its threads
            together (not counting processes it starts); 0 for no limit.
        max_result_bytes: largest JSON answer taken from a child; a larger one is an ``error``
            (the largest measured: 0.12 MB, ScienceWorld listing its admissible actions).
        replay_crashes: carry an episode on in a fresh child when its child's process died, by
            replaying the episode's calls (see the module docstring); ``False``: the crash ends it.
    """

    def __init__(self, factory: EnvFactoryType, timeout_s: float = 60.0, preload: tuple[str, ...] = ("environments",),
                 *, memory_limit_mb: float = 4096, cpu_time_limit_s: float = 60.0, max_result_bytes: int = 8 * 2**20,
                 replay_crashes: bool = True):
        for name, value in (("memory_limit_mb", memory_limit_mb), ("cpu_time_limit_s", cpu_time_limit_s),
                            ("max_result_bytes", max_result_bytes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"EnvWorkerPool: {name}={value!r} must be a finite number >= 0 (0: no limit)")
        if int(max_result_bytes) < 1024:
            raise ValueError(f"EnvWorkerPool: max_result_bytes={max_result_bytes!r} is too small for any answer; "
                             "use at least 1024 (default 8 MiB)")
        self.factory = factory
        self.timeout_s = float(timeout_s)
        self.limits = _ChildLimits(float(memory_limit_mb), float(cpu_time_limit_s), int(max_result_bytes))
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(preload))
        self._slots: dict[int, _Slot] = {}
        self.replay_crashes = replay_crashes
        # Each slot's episode so far: its calls, each with a hash of the answer it got (for a replay).
        self._episodes: dict[int, list[tuple[tuple, bytes]]] = {}
        self.restarts = 0  # children killed or found dead, and started again
        self.replays = 0  # episodes carried on in a fresh child after a replay

    def _slot(self, i: int) -> _Slot:
        if i not in self._slots:
            self._slots[i] = _Slot(self._ctx, self.factory, self.limits)
        return self._slots[i]

    def _call_many(self, calls: list[tuple[int, tuple]], while_waiting: Callable[[], bool] | None = None,
                   grace_s: float = 0.0, carry_on: bool = True) -> list[Any]:
        """Send every call, then gather the answers against one deadline; a call whose child died
        is then carried on in a fresh child where it can be (:meth:`_carried_on`).

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
                slot.message = message
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
                results[i] = self._receive(i)
        if carry_on and self.replay_crashes:
            for i, message in calls:
                if isinstance(results[i], EnvFailure) and results[i].kind == "crash":
                    results[i] = self._carried_on(i, message, results[i])
        return [results[i] for i, _ in calls]

    def _carried_on(self, i: int, message: tuple, failure: EnvFailure) -> Any:
        """Slot ``i``'s call ``message`` once more, in a fresh child that first replays the
        episode's calls so far and gets the answers the dead child gave; ``failure`` (with why)
        where a replayed answer differs or a call fails again."""
        history = self._episodes.pop(i, []) if message[0] == "step" else []
        if message[0] == "step" and not history:
            return failure  # no reset to start from: nothing to replay
        for n, (earlier, digest) in enumerate(history, 1):
            answer = self._call_one(i, earlier)
            if isinstance(answer, EnvFailure):
                return EnvFailure(failure.kind, f"{failure.message}; replaying the episode in a new process to carry "
                                                f"on failed at its call {n} of {len(history)}: {answer.message}")
            if self._episodes[i][-1][1] != digest:
                self._episodes.pop(i)
                return EnvFailure(failure.kind, f"{failure.message}; replaying the episode in a new process gave a "
                                                f"different answer at its call {n} of {len(history)} (the environment "
                                                "is not a function of its seed and actions), so it could not go on")
        answer = self._call_one(i, message)
        if isinstance(answer, EnvFailure):
            return EnvFailure(answer.kind, f"{failure.message}; carried on in a new process after replaying the "
                                           f"episode's {len(history)} call(s), it failed again: {answer.message}")
        self.replays += 1
        return answer

    def _call_one(self, i: int, message: tuple) -> Any:
        return self._call_many([(i, message)], carry_on=False)[0]

    def _remember(self, i: int, message: tuple, answer: bytes) -> None:
        """The episode's calls so far: a reset starts them afresh, a step adds to them."""
        digest = hashlib.blake2b(answer, digest_size=16).digest()
        if message[0] == "reset":
            self._episodes[i] = [(message, digest)]
        elif i in self._episodes:
            self._episodes[i].append((message, digest))

    def _receive(self, i: int) -> Any:
        """Slot ``i``'s answer: its checked result, or an EnvFailure (restarting the slot where
        the child is gone or cannot be trusted to go on)."""
        slot = self._slots[i]
        try:
            data = slot.conn.recv_bytes(self.limits.max_result_bytes)
        except (EOFError, ConnectionResetError):  # the child is gone (a reset: killed with a reply unread)
            return self._fail(i, *self._death(slot))
        except OSError as exc:  # "bad message length": over the cap, left unread
            return self._fail(i, "error", f"its answer could not be taken ({exc}): over max_result_bytes="
                                          f"{self.limits.max_result_bytes}, or not a message; the environment's "
                                          "process was restarted")
        try:
            status, payload = _decode_reply(data)
        except _BadReply as exc:
            return self._fail(i, "error", f"{exc}; the environment's process was restarted")
        if status == "out_of_memory":
            hint = self.limits.memory_hint() if self.limits.memory_limit_mb > 0 else "the machine is out of memory"
            return self._fail(i, "limit", f"it ran out of memory ({hint}); the environment's process was "
                                          f"restarted.\n{payload.strip()}")
        if status == "error":
            return EnvFailure("error", payload.strip())
        try:
            result = _checked_result(slot.message[0], payload)
        except ValueError as exc:
            return self._fail(i, "error", f"{exc}; the environment's process was restarted")
        self._remember(i, slot.message, data)
        return result

    def _death(self, slot: _Slot) -> tuple[str, str]:
        """``(kind, message)`` for a child whose pipe closed: what its exit code tells."""
        slot.process.join(timeout=2)  # the pipe can close just before the exit is reaped
        code = slot.process.exitcode
        if code == -signal.SIGPROF and self.limits.cpu_time_limit_s > 0:
            return "limit", (f"it used more than {self.limits.cpu_time_limit_s:g} s of CPU time in one call "
                             "(env.cpu_time_limit_s) and its process was ended; raise the limit if the "
                             "environment needs more, or set 0 for no limit")
        if code == _OUT_OF_MEMORY_EXIT:
            return "limit", f"it ran out of memory ({self.limits.memory_hint()}) and its process ended"
        message = f"its process died (exit code {code}"
        if isinstance(code, int) and code < 0:
            with contextlib.suppress(ValueError):
                message += f", {signal.Signals(-code).name}"
        message += ")"
        if self.limits.memory_limit_mb > 0 and code in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS):
            message += f"; if it ran out of memory: {self.limits.memory_hint()}"
        return "crash", message

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
        self._episodes.clear()

    def __enter__(self) -> "EnvWorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcessEnvs:
    """The pool's calls with the environments in this process: no isolation, no timeout, no
    memory or CPU limits, and the env's own objects back (no JSON)."""

    def __init__(self, factory: EnvFactoryType):
        self.factory = factory
        self._envs: dict[int, Any] = {}
        self.restarts = self.replays = 0  # nothing runs apart: never any

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
