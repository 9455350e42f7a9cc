"""An actor whose process is killed mid-run (SIGKILL, as the OOM killer or a lost node would):
the run restarts every role from the last complete checkpoint and finishes with the metrics of a
run that was never interrupted; with ``run.max_restarts=0`` it stops with a message naming the
actor, the cause and the checkpoint to resume from.

The runs are the real ``opd train`` in a child process (Ray, DeepSpeed, the environment pool);
the test kills the actor's own process (``ray::StudentTrainer`` / ``ray::RolloutWorker``) once
the run has written its second checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
STEPS = 4


def _command(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run_dir}", f"run.total_steps={STEPS}",
            "run.save_every_steps=1", "run.keep_checkpoints=5", f"student.bootstrap.cache_dir={cache}",
            f"teacher.bootstrap.cache_dir={cache}", *extra]


def _step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each training step's logged values that do not depend on timing."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = ("time/", "memory/")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(timed) and not k.endswith(("_s", "per_s"))
                        and isinstance(v, (int, float))}
            for r in rows if "time/step_s" in r}


def _run_killing(actor: str, run_dir: Path, cache: Path, *extra: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run the recipe, SIGKILL the ``actor``'s process once checkpoint step_2 is complete;
    returns the finished process and the pid killed."""
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen(_command(run_dir, cache, *extra), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    killed = 0
    try:
        deadline = time.monotonic() + 900
        while not killed and time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists():
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if f"ray::{actor}" in " ".join(child.cmdline()):
                            os.kill(child.pid, signal.SIGKILL)
                            killed = child.pid
                            break
                    except psutil.Error:
                        continue
            time.sleep(0.2)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (run_dir.parent / f"{run_dir.name}.log").read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, ""), killed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    run_dir = base / "whole"
    done = subprocess.run(_command(run_dir, base / "cache"), cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return base, _step_metrics(run_dir)


def test_a_killed_trainer_is_restarted_and_the_run_ends_as_if_uninterrupted(uninterrupted):
    base, expected = uninterrupted
    run_dir = base / "killed_trainer"
    done, pid = _run_killing("StudentTrainer", run_dir, base / "cache")
    assert pid, "the trainer's process was not found"
    assert done.returncode == 0, done.stdout[-3000:]
    assert "the trainer actor died" in done.stdout and "restarting every role from step_" in done.stdout
    got = _step_metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # no step lost, none logged twice
    for step in expected:
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS


GROUP = ("resources.trainer_ranks=2", "resources.trainer_cpus=0.5", "trainer.zero_stage=3")


def test_a_killed_rank_of_a_zero3_trainer_group_resumes_from_its_shards_as_if_uninterrupted(uninterrupted):
    """Two trainer ranks under ZeRO-3: each checkpoint holds a shard per rank; one rank killed
    mid-run, the group restarts from them and ends with the metrics of an uninterrupted
    two-rank run."""
    base, _ = uninterrupted
    whole = base / "group_whole"
    done = subprocess.run(_command(whole, base / "cache", *GROUP), cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    expected = _step_metrics(whole)
    shards = list((whole / "checkpoints" / f"step_{STEPS}" / "ds" / "state").glob("*optim_states.pt"))
    assert len(shards) == 2, shards
    run_dir = base / "group_killed"
    done, pid = _run_killing("StudentTrainer", run_dir, base / "cache", *GROUP)
    assert pid, "no trainer rank's process was found"
    assert done.returncode == 0, done.stdout[-3000:]
    assert "the trainer actor died" in done.stdout and "restarting every role from step_" in done.stdout
    got = _step_metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


def test_with_no_restart_left_a_killed_rollout_worker_stops_the_run_naming_it(uninterrupted):
    base, _ = uninterrupted
    run_dir = base / "killed_rollout"
    done, pid = _run_killing("RolloutWorker", run_dir, base / "cache", "run.max_restarts=0")
    assert pid, "the rollout worker's process was not found"
    assert done.returncode == 1, done.stdout[-3000:]  # a failed run (2 is a refused recipe or checkpoint)
    message = " ".join(done.stdout.split())  # the console wraps long lines
    assert "error: the rollout actor died during" in message
    assert "no restart left (run.max_restarts=0)" in message
    assert f"last complete checkpoint: {run_dir / 'checkpoints' / 'step_'}" in message
    assert "resume with: opd train" in message and "--resume" in message


def test_a_preempted_run_saves_its_step_stops_with_143_and_resumes_as_if_uninterrupted(uninterrupted):
    """SIGTERM to the driver (a spot instance reclaimed, an eviction, ``ray job stop``) once step 2
    is logged: it finishes the step under way, saves it (no checkpoint was due: save_every_steps is
    100), ends every role, prints the resume command and exits 143; the resumed run ends with the
    metrics of the run that was never interrupted (issue 51, item 1)."""
    base, expected = uninterrupted
    run_dir = base / "preempted"
    command = [*_command(run_dir, base / "cache"), "run.save_every_steps=100"]
    log = open(base / "preempted.log", "w")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            if 2 in (_step_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else {}):
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.1)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = " ".join((base / "preempted.log").read_text().split())
    assert proc.returncode == 143, out[-3000:]
    done = max(_step_metrics(run_dir))
    assert 2 <= done < STEPS
    assert (f"preempted: stopped on SIGTERM after {done} of {STEPS} steps: saved checkpoint "
            f"{run_dir / 'checkpoints' / f'step_{done}'} (step {done}); every role was ended") in out, out[-3000:]
    assert f"resume with: opd train {TINY}" in out and out.rstrip().endswith("--resume")
    assert "SIGTERM received" in out and "*** SIGTERM received" not in out  # ours, not Ray's stack dump
    assert not psutil.Process().children(recursive=True) or all(
        "ray::" not in " ".join(c.cmdline()) for c in psutil.Process().children(recursive=True))

    resumed = subprocess.run([*command, "--resume"], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                             timeout=900)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    got = _step_metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # each step once
    for step in expected:
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
