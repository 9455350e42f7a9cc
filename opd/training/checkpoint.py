"""Atomic checkpoints in the run directory and finding the last complete one.

A checkpoint is written into ``checkpoints/.partial-step_N/`` and renamed to
``checkpoints/step_N/`` only once every file is on disk (and a ``COMPLETE`` marker holds the
driver's state). A run killed at any moment therefore leaves either a complete checkpoint or a
partial directory that resume ignores and the next save clears.

Layout::

    checkpoints/step_N/ds/        DeepSpeed state for exact resume (weights, optimizer)
    checkpoints/step_N/hf/        HF export: config.json, model.safetensors, tokenizer
    checkpoints/step_N/COMPLETE   JSON driver state: step, metrics so far
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

_STEP_DIR = re.compile(r"^step_(\d+)$")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(run_dir: Path, step: int, write_state: Callable[[str], None], driver_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep`` complete ones.

    Args:
        run_dir: the run directory.
        step: the number of completed training steps.
        write_state: writes the trainer's files into the directory it is given.
        driver_state: JSON-safe state of the driver, stored in the ``COMPLETE`` marker.
        keep: complete checkpoints to keep (at least 1).
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f".partial-step_{step}"
    final = root / f"step_{step}"
    partial.mkdir()
    write_state(str(partial))
    atomic_write_text(partial / "COMPLETE", json.dumps(driver_state))
    _fsync_tree(partial)
    if final.exists():  # an older copy of the same step (a resumed run repeating it)
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in complete_checkpoints(run_dir)[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "COMPLETE").is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint and its driver state, or None."""
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            return path, json.loads((path / "COMPLETE").read_text())
        except json.JSONDecodeError:
            continue  # a marker cut short by a crash: fall back to an older checkpoint
    return None
