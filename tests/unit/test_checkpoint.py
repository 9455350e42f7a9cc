"""Checkpoints: a crash mid-write never hides or corrupts the last complete one, and a file
damaged after the save is caught by its recorded size and hash."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from opd.training.checkpoint import (CheckpointError, complete_checkpoints, latest_checkpoint, save_checkpoint,
                                     verified_checkpoints, verify_checkpoint)


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
    assert json.loads((path / "COMPLETE").read_text())["state"] == state == {"step": 10}


def _two_checkpoints(tmp_path):
    def write(directory: str) -> None:
        (Path(directory) / "ds").mkdir()
        (Path(directory) / "ds" / "model_states.pt").write_bytes(b"m" * 1000)
        (Path(directory) / "ds" / "optim_states.pt").write_bytes(b"o" * 500)
        (Path(directory) / "hf").mkdir()
        (Path(directory) / "hf" / "model.safetensors").write_bytes(b"w" * 800)

    for step in (1, 2):
        save_checkpoint(tmp_path, step, write, {"step": step})
    return tmp_path / "checkpoints" / "step_2"


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage, fragment", [
    (lambda c: _truncate(c / "ds" / "model_states.pt"), "model_states.pt has 500 bytes, 1000 were written"),
    (lambda c: (c / "ds" / "optim_states.pt").unlink(), "optim_states.pt is missing"),
    (lambda c: _truncate(c / "hf" / "model.safetensors"), "model.safetensors has 400 bytes, 800 were written"),
    (lambda c: (c / "hf" / "model.safetensors").write_bytes(b"x" * 800), "does not match its SHA-256"),
    (lambda c: (c / "COMPLETE").write_text("{}"), "holds {}, not a checkpoint record"),
    (lambda c: (c / "COMPLETE").write_text("[]"), "holds [], not a checkpoint record"),
    (lambda c: (c / "COMPLETE").write_text('{"step": 2}'), "not a checkpoint record"),
    (lambda c: (c / "COMPLETE").write_bytes(b"\xff\xfe"), "is unreadable"),
    (lambda c: (c / "COMPLETE").write_text(json.dumps({"state": {"step": 2}, "files": {"../../x": {}}})),
     "is not a file record inside the checkpoint"),
])
def test_damage_after_the_save_is_caught_and_the_older_checkpoint_is_used(tmp_path, damage, fragment):
    newest = _two_checkpoints(tmp_path)
    assert verify_checkpoint(newest) == {"step": 2}
    damage(newest)
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        verify_checkpoint(newest)
    seen = [(path.name, state, reason) for path, state, reason in verified_checkpoints(tmp_path)]
    assert [(name, state) for name, state, _ in seen] == [("step_2", None), ("step_1", {"step": 1})]
    assert fragment in seen[0][2]
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_1" and state == {"step": 1}


def test_opd_verify_lists_each_checkpoint_and_fails_on_a_damaged_one(tmp_path, capsys):
    from opd.cli import main

    newest = _two_checkpoints(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ok step_1 (step 1)" in out and "ok step_2 (step 2)" in out
    _truncate(newest / "hf" / "model.safetensors")
    assert main(["verify", str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "ok step_1 (step 1)" in out and "bad step_2:" in out and "model.safetensors has 400 bytes" in out
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().out


def test_a_save_that_runs_out_of_space_leaves_no_partial_and_names_the_sizes(tmp_path):
    """Issue 51, item 4 (the figures; the real full disk is tests/integration/test_full_disk.py)."""
    import errno

    from opd.training.checkpoint import OutOfSpaceError, estimated_checkpoint_bytes, out_of_space

    def write(directory: str) -> None:
        (Path(directory) / "weights.bin").write_bytes(b"\0" * 4096)

    save_checkpoint(tmp_path, 1, write, {"step": 1})

    def fill(directory: str) -> None:
        (Path(directory) / "weights.bin").write_bytes(b"\0" * 1000)
        raise RuntimeError("the trainer failed in save_checkpoint") from OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutOfSpaceError) as caught:
        save_checkpoint(tmp_path, 2, fill, {"step": 2})
    message = str(caught.value)
    assert message.startswith(f"no space left on the device of {tmp_path / 'checkpoints'} while saving checkpoint "
                              "step_2: a checkpoint takes about 4.")  # step_1's bytes, its marker included
    assert f"the last complete checkpoint, {tmp_path / 'checkpoints' / 'step_1'}, is intact" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    # Any other failure is itself, still without a partial left behind.
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 3, lambda d: (_ for _ in ()).throw(ValueError("a bug")), {"step": 3})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]

    class RoleError(RuntimeError):  # what a Ray role's failure carries: the actor's exception as .cause
        cause = OSError(errno.ENOSPC, "No space left on device")

    assert out_of_space(RoleError("the trainer failed")) and not out_of_space(RuntimeError("other"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    (model / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert estimated_checkpoint_bytes(model) == 2 * 1000 + 3 * 2000  # twice the weights, AdamW's 3 fp32 copies
    assert estimated_checkpoint_bytes(tmp_path / "nowhere") is None


class _ByName:
    """Pickles as ``getattr(owner, name)``: how Python 3.11.0 to 3.11.4 pickle an enum member (the
    Docker image's Debian Python 3.11.2 writes DeepSpeed's ZeroStageEnum so)."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_an_enum_member_pickled_by_name_loads_and_nothing_else_does(tmp_path):
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from opd.training.checkpoint import check_pickles, safe_torch_load

    good = tmp_path / "good"
    good.mkdir()
    torch.save({"zero_stage": _ByName(ZeroStageEnum, "optimizer_states"), "w": torch.ones(2)}, good / "optim.pt")
    with safe_torch_load():
        state = torch.load(good / "optim.pt")
    assert state["zero_stage"] is ZeroStageEnum.optimizer_states and torch.equal(state["w"], torch.ones(2))
    check_pickles(good)
    for owner, name in ((LossScaler, "__init__"), (ZeroStageEnum, "__class__"), (ZeroStageEnum, "_missing_")):
        bad = tmp_path / f"bad-{name}"
        bad.mkdir()
        torch.save({"x": _ByName(owner, name)}, bad / "optim.pt")
        with pytest.raises(CheckpointError, match="outside the weights-only allow-list"):
            check_pickles(bad)
