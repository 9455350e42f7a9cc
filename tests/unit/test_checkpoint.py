"""Atomic checkpoints: a crash mid-write never hides or corrupts the last complete one."""

from __future__ import annotations

import json

import pytest

from opd.training.checkpoint import complete_checkpoints, latest_checkpoint, save_checkpoint


def _writer(payload: str):
    def write(directory: str) -> None:
        with open(f"{directory}/weights.txt", "w") as f:
            f.write(payload)

    return write


def test_save_then_find_latest_and_prune(tmp_path):
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, _writer(f"w{step}"), {"step": step}, keep=2)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step_10", "step_15"]
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_15" and state == {"step": 15}
    assert (path / "weights.txt").read_text() == "w15"


def test_crash_while_writing_leaves_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 10, _writer("good"), {"step": 10})

    def crash(directory: str) -> None:
        _writer("half")(directory)
        raise KeyboardInterrupt("killed mid-checkpoint")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 20, crash, {"step": 20})
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_10" and state["step"] == 10
    assert (tmp_path / "checkpoints" / ".partial-step_20").exists()
    # The next save clears the debris.
    save_checkpoint(tmp_path, 30, _writer("w30"), {"step": 30})
    assert not (tmp_path / "checkpoints" / ".partial-step_20").exists()


def test_a_directory_without_marker_or_with_a_torn_marker_is_skipped(tmp_path):
    save_checkpoint(tmp_path, 10, _writer("good"), {"step": 10})
    (tmp_path / "checkpoints" / "step_20").mkdir()  # no COMPLETE marker
    torn = tmp_path / "checkpoints" / "step_30"
    torn.mkdir()
    (torn / "COMPLETE").write_text('{"step": 3')  # cut short
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_10"
    assert json.loads((path / "COMPLETE").read_text()) == state
