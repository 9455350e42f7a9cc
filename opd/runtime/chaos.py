"""A seeded chaos run: processes of a run on Ray killed at chosen moments, to show that the run
loses nothing (``tests/integration/test_chaos.py``, ``bench/chaos.py``).

Turned on by the driver's environment only, never by a recipe::

    OPD_CHAOS="seed=3,faults=8" opd train recipes/quickstart.yaml run.max_restarts=20

The schedule is drawn from the seed before the run starts: each fault is a call the driver waits
on, the how-many-th time it waits on it in this process (restarts included), and the process
that takes part in that call to SIGKILL, a random moment after the call was sent (a fraction of
the quickest of its recent waits, so that most kills land inside it):

===================  ==========================================================
call                 killed
===================  ==========================================================
``collect``          a rollout replica, or one of its environment processes
``score``            a teacher replica
``train_step``       a trainer rank
``update_weights``   a rollout replica loading, or a trainer rank exporting
``save_checkpoint``  a trainer rank while it writes a checkpoint
``load_checkpoint``  a trainer rank while a restarted run loads one
===================  ==========================================================

With at least eight faults every row of the table gets one (both targets of a call with two);
the rest fall at random. Each fault goes to
``chaos.jsonl`` in the run directory when it fires (what was killed, its pid, when, whether the
call was still under way) and, for an environment process, whether its episode was carried on
(``replayed``) or lost. A killed actor is what a lost node or the OOM killer does: the run
restarts every role from the last complete checkpoint (``run.max_restarts``); a killed
environment process is replayed by the pool (:mod:`opd.rollout.env_pool`).

The processes are found on this machine (the pids of the actors, and their children for the
environments): a chaos run is a one-machine run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ENV_VAR = "OPD_CHAOS"

# The calls a fault can fall in, and who takes part in each (a fault of the first call picks
# between a rollout replica and one of its environment processes, of the fourth between a
# rollout replica and a trainer rank).
TARGETS = {"collect": ("rollout", "env"), "score": ("teacher",), "train_step": ("trainer",),
           "update_weights": ("rollout", "trainer"), "save_checkpoint": ("trainer",),
           "load_checkpoint": ("trainer",)}


class ChaosError(ValueError):
    """An ``OPD_CHAOS`` value that cannot be read."""


@dataclass
class Fault:
    """One scheduled kill: the ``occurrence``-th wait on ``call``, ``target`` (a role, or ``env``)
    replica ``index``, ``delay`` (a fraction of the call's usual time) after it was sent."""

    call: str
    occurrence: int
    target: str
    index: int
    delay: float
    # filled in when it fires
    pid: int = 0
    after_s: float = 0.0
    landed: str = ""  # "during" the call, "after" it returned, "missed" (no process to kill) or "unreached"
    outcome: str = ""  # for an environment process: "replayed" or "episode lost"


def parse(spec: str) -> tuple[int, int]:
    """``"seed=S,faults=F"`` -> ``(S, F)``."""
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in ("seed", "faults") or not value.strip().isdigit():
            raise ChaosError(f"{ENV_VAR}={spec!r}: expected 'seed=S,faults=F' (non-negative integers), "
                             f"got {part!r}")
        values[key] = int(value)
    return values.get("seed", 0), values.get("faults", 6)


def schedule(seed: int, faults: int, total_steps: int, save_every: int) -> list[Fault]:
    """``faults`` faults drawn from ``seed`` for a run of ``total_steps`` steps saving every
    ``save_every``: every (call, target) pair once first (when there are eight or more), then
    pairs at random; no two on the same wait."""
    rng = random.Random(seed)
    pairs = [(call, target) for call, targets in TARGETS.items() for target in targets]
    kinds = pairs + [rng.choice(pairs) for _ in range(faults - len(pairs))] if faults >= len(pairs) \
        else rng.sample(pairs, faults)
    saves = max(1, total_steps // max(1, save_every))
    # How often each call is waited on in a run without faults: a collect, a score, a train step
    # and a sync a step (the first of each left alone: the run has not shown its pace yet); the
    # checkpoints; a load only in a restarted attempt.
    last = {"collect": total_steps, "score": total_steps, "train_step": total_steps,
            "update_weights": total_steps, "save_checkpoint": saves, "load_checkpoint": 2}
    first = {"collect": 2, "score": 2, "train_step": 2, "update_weights": 2, "save_checkpoint": 1,
             "load_checkpoint": 1}
    taken: set[tuple[str, int]] = set()
    out = []
    for call, target in kinds:
        free = [n for n in range(first[call], max(first[call], last[call]) + 1) if (call, n) not in taken]
        if not free:
            continue
        n = rng.choice(free)
        taken.add((call, n))
        out.append(Fault(call, n, target, rng.randrange(1 << 16), round(rng.uniform(0.0, 0.8), 3)))
    return sorted(out, key=lambda f: (f.call, f.occurrence))


def _own_pid(_instance: Any) -> int:
    return os.getpid()


class Chaos:
    """The injector of one driver process: :meth:`attach` to each attempt's workers, which call
    :meth:`around` for every wait."""

    def __init__(self, faults: list[Fault], log_path: Path, log: Callable[[str], None] = print):
        self.faults = {(f.call, f.occurrence): f for f in faults}
        self.log_path, self.log = log_path, log
        self.waits: dict[str, int] = {}
        self.seconds: dict[str, list[float]] = {}
        self.pids: dict[str, list[int]] = {}

    @classmethod
    def from_environment(cls, total_steps: int, save_every: int, run_dir: Path,
                         log: Callable[[str], None] = print) -> "Chaos | None":
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        seed, faults = parse(spec)
        planned = schedule(seed, faults, total_steps, save_every or total_steps)
        log(f"[yellow]chaos[/] ({ENV_VAR}={spec}): {len(planned)} fault(s) scheduled: " +
            ", ".join(f"{f.target} in {f.call} #{f.occurrence}" for f in planned))
        return cls(planned, run_dir / "chaos.jsonl", log)

    def attach(self, workers: Any) -> None:
        """The pids of a fresh attempt's actors (asked now, while they are idle), and every wait
        of ``workers`` (:class:`opd.runtime.actors.RayWorkers`) through :meth:`around`."""
        roles = {"teacher": workers.teachers, "rollout": workers.rollouts, "trainer": workers.trainers}
        refs = {role: [a.__ray_call__.remote(_own_pid) for a in actors] for role, actors in roles.items()}
        self.pids = {role: workers._await(r, role, "getpid") for role, r in refs.items()}
        workers.chaos = self

    def around(self, call: str, wait: Callable[[], Any]) -> Any:
        """``wait()`` (a ``ray.get``), with this wait's fault, if one is due, fired during it."""
        n = self.waits[call] = self.waits.get(call, 0) + 1
        fault = self.faults.pop((call, n), None)
        timer, returned = None, threading.Event()
        if fault is not None:
            # the quickest of this call's recent waits: a kill at a fraction of it lands inside most calls
            usual = min(self.seconds[call][-5:]) if self.seconds.get(call) else 0.5
            timer = threading.Timer(fault.delay * usual, self._fire, (fault, time.monotonic(), returned))
            timer.start()
        start = time.monotonic()
        value = None
        try:
            value = wait()
            return value
        finally:
            returned.set()
            if timer is None:
                self.seconds.setdefault(call, []).append(time.monotonic() - start)
            else:
                timer.join()
                if fault.target == "env" and fault.landed == "during" and value is not None:
                    replays = sum(part[1].get("env_replays", 0) for part in value)  # each replica's (trajs, counts)
                    fault.outcome = "replayed" if replays else "episode lost"
                self._record(fault)

    def _fire(self, fault: Fault, sent: float, returned: threading.Event) -> None:
        pid = self._target_pid(fault)
        fault.after_s = round(time.monotonic() - sent, 3)
        if not pid:
            fault.landed = "missed"
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            fault.landed = "missed"
            return
        # "after": the call had returned (the next call finds the process dead)
        fault.pid, fault.landed = pid, "after" if returned.is_set() else "during"
        who = "an environment process of rollout" if fault.target == "env" else fault.target
        self.log(f"[yellow]chaos[/]: killed {who} (pid {pid}) {fault.after_s:.2f} s into {fault.call} "
                 f"#{fault.occurrence}" + (" (it had returned)" if fault.landed == "after" else ""))

    def _target_pid(self, fault: Fault) -> int:
        if fault.target != "env":
            pids = self.pids.get(fault.target, [])
            return pids[fault.index % len(pids)] if pids else 0
        import psutil

        envs = []
        for pid in self.pids.get("rollout", []):
            try:
                for server in psutil.Process(pid).children():  # the forkserver; its children are environments
                    envs.extend(c.pid for c in server.children())
            except psutil.Error:
                continue
        return sorted(envs)[fault.index % len(envs)] if envs else 0

    def close(self) -> None:
        """The end of the run: the faults whose wait never came are recorded as ``unreached``."""
        for fault in self.faults.values():
            fault.landed = "unreached"
            self._record(fault)
        self.faults.clear()

    def _record(self, fault: Fault) -> None:
        if not self.log_path.parent.is_dir():  # a run stopped before its directory was made
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(asdict(fault)) + "\n")


def fault_table(path: Path) -> list[dict[str, Any]]:
    """``chaos.jsonl`` read back: one row per fault fired."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Logged values that count the faults themselves, not the training: they differ from an unbroken run's.
FAULT_COUNTS = ("env_restarts", "env_replays")


def step_values(run_dir: Path) -> dict[int, list[dict[str, float]]]:
    """Each step's logged values that depend neither on timing nor on faults, as lists: a step
    logged twice has two entries."""
    from opd.evaluation.run_dir import RunDir

    out: dict[int, list[dict[str, float]]] = {}
    for record in RunDir(run_dir).steps():
        values = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"
                  and not k.startswith(("time/", "memory/")) and not k.endswith(("_s", "per_s")) and k not in FAULT_COUNTS}
        out.setdefault(int(record["step"]), []).append(values)
    return out


def value_differences(whole: Path, other: Path, rel: float = 1e-6) -> list[str]:
    """Where ``other``'s :func:`step_values` (the first of a step logged twice) differ from
    ``whole``'s, the run without faults, by more than ``rel``: one line per step and key."""
    expected, logged = step_values(whole), step_values(other)
    out = []
    for step in sorted(expected.keys() | logged.keys()):
        want, got = expected.get(step, [{}])[0], logged.get(step, [{}])[0]
        for key in sorted(want.keys() | got.keys()):
            a, b = want.get(key), got.get(key)
            if a is None or b is None or abs(a - b) > rel * max(1.0, abs(a)):
                out.append(f"step {step} {key}: {a} without faults, {b} with")
    return out


def report(chaotic: Path, whole: Path | None = None, rel: float = 1e-6) -> dict[str, Any]:
    """What a chaos run in ``chaotic`` came to, against the same recipe run without faults in
    ``whole``: the faults by call and target (fired, landed during the call, environment
    episodes replayed or lost), the restarts, the steps logged (each should be once), whether
    the final checkpoint verifies, and the logged values that differ (relative ``rel``)."""
    from opd.evaluation.run_dir import RunDir
    from opd.training.checkpoint import CheckpointError, complete_checkpoints, verify_checkpoint

    faults = fault_table(chaotic / "chaos.jsonl")
    kinds: dict[tuple[str, str], dict[str, int]] = {}
    for f in faults:
        row = kinds.setdefault((f["call"], f["target"]), {"fired": 0, "during": 0, "after": 0, "missed": 0,
                                                          "unreached": 0, "replayed": 0, "lost": 0})
        row["fired"] += f["landed"] in ("during", "after")
        row[f["landed"]] += 1
        row["replayed"] += f["outcome"] == "replayed"
        row["lost"] += f["outcome"] == "episode lost"
    logged = step_values(chaotic)
    summary = RunDir(chaotic).summary() or {}
    steps = int(summary.get("steps", 0))
    last = complete_checkpoints(chaotic)
    try:
        verified = bool(last) and verify_checkpoint(last[-1])["step"] == steps
    except CheckpointError:
        verified = False
    differences = value_differences(whole, chaotic, rel) if whole is not None else []
    return {
        "faults": [{"call": c, "target": t, **row} for (c, t), row in sorted(kinds.items())],
        "fired": sum(row["fired"] for row in kinds.values()),
        "restarts": int(summary.get("restarts", 0)),
        "steps": steps,
        "steps_logged": sorted(logged),
        "steps_logged_twice": sorted(s for s, rows in logged.items() if len(rows) > 1),
        "final_checkpoint": last[-1].name if last else None,
        "final_checkpoint_verifies": verified,
        "differences": differences,
    }


def markdown(result: dict[str, Any]) -> str:
    """:func:`report`'s result as Markdown: the table of faults, then the checks."""
    lines = ["| call | killed | fired | during the call | after it | no process to kill | call not reached | "
             "episodes replayed | episodes lost |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["faults"]:
        killed = "an environment process" if row["target"] == "env" else f"a {row['target']}"
        lines.append(f"| `{row['call']}` | {killed} | {row['fired']} | {row['during']} | {row['after']} | "
                     f"{row['missed']} | {row['unreached']} | {row['replayed'] if row['target'] == 'env' else ''} | "
                     f"{row['lost'] if row['target'] == 'env' else ''} |")
    twice = result["steps_logged_twice"]
    lines += ["", f"- faults fired: {result['fired']}; restarts of every role from a checkpoint: {result['restarts']}",
              f"- steps logged: {len(result['steps_logged'])} of {result['steps']}, "
              f"{'none twice' if not twice else 'twice: ' + ', '.join(map(str, twice))}",
              f"- final checkpoint {result['final_checkpoint']}: "
              f"{'verifies' if result['final_checkpoint_verifies'] else 'DOES NOT VERIFY'}",
              "- logged values against the run without faults: " +
              ("all equal" if not result["differences"] else f"{len(result['differences'])} differ, e.g. "
               + "; ".join(result["differences"][:3]))]
    return "\n".join(lines)
