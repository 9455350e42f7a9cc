"""A full disk (issue 51, item 4): on a size-limited tmpfs (mounted by the test, which needs root;
skipped elsewhere, saying so), a checkpoint save that runs out of space leaves the previous
complete checkpoint intact, leaves no half-written one, and stops naming the directory, the bytes
a checkpoint takes and the bytes free; a run whose directory cannot hold one checkpoint is
refused before any role starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


@pytest.fixture
def small_disk(tmp_path):
    """A mount point; ``mount(size)`` puts a tmpfs of that size there (unmounted at the end)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CI runs as root)")
    point = tmp_path / "disk"
    point.mkdir()
    mounted = []

    def mount(size: str) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for one in mounted:
        subprocess.run(["umount", "-l", str(one)], check=False)


def _train(run_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run_dir}", "run.total_steps=2",
           "run.save_every_steps=1", "run.keep_checkpoints=3", f"student.bootstrap.cache_dir={cache}",
           f"teacher.bootstrap.cache_dir={cache}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900,
                          env={**os.environ, "COLUMNS": "400"})


def test_a_save_that_fills_the_disk_keeps_the_last_checkpoint_and_says_how_much_is_needed(small_disk, tmp_path):
    disk = small_disk("3M")  # the tiny student's checkpoint is about 2.1 MB: step_1 fits, step_2 does not
    done = _train(disk / "run", tmp_path.parent / "cache")
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, out[-3000:]
    checkpoints = disk / "run" / "checkpoints"
    assert (f"error: no space left on the device of {checkpoints} while saving checkpoint step_2: a checkpoint "
            "takes about 2.0 MB (the size of step_1), ") in out, out[-3000:]
    assert f"The partial save was removed; the last complete checkpoint, {checkpoints / 'step_1'}, is intact" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]  # no .partial-step_2 left
    verify = subprocess.run([sys.executable, "-m", "opd.cli", "verify", str(disk / "run")], cwd=ROOT,
                            capture_output=True, text=True)
    assert verify.returncode == 0 and "ok   step_1 (step 1)" in verify.stdout


def test_a_run_directory_too_small_for_one_checkpoint_is_refused_before_any_role_starts(small_disk, tmp_path):
    disk = small_disk("1M")
    done = _train(disk / "run", tmp_path.parent / "cache")
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, out[-3000:]
    assert f"error: too little space in {disk / 'run'} for one checkpoint: it takes about 2.0 MB" in out, out[-3000:]
    assert "before training" not in out and not (disk / "run" / "checkpoints").exists()
    # `opd check` says the same before anything runs, for a directory not made yet too (the student built above)
    cache = tmp_path.parent / "cache"
    check = subprocess.run([sys.executable, "-m", "opd.cli", "check", str(TINY), f"run.output_dir={disk / 'new' / 'run'}",
                            f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
    out = " ".join((check.stdout + check.stderr).split())
    assert check.returncode == 2, out[-3000:]
    assert f"error: too little space in {disk / 'new' / 'run'} for one checkpoint: it takes about 2.0 MB" in out
    assert not (disk / "new").exists()
