"""The documented custom-loss example trains end to end through its recipe (Ray + DeepSpeed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from opd.trajectory import TokenBatch

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_example_loss_against_a_hand_computed_value():
    from examples.custom_loss.my_losses import teacher_weighted_nll

    student = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_()
    teacher = torch.log(torch.tensor([[0.8, 0.3, 0.6]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = TokenBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), mask,
                       torch.zeros(1, 3), teacher, torch.zeros(1, 3, dtype=torch.long), student)
    loss, metrics = teacher_weighted_nll(batch, {"min_teacher_prob": 0.5})
    assert loss.item() == pytest.approx(-(0.8 * math.log(0.5)) / 2, rel=1e-6)  # token 2 under the floor, token 3 masked
    assert metrics == {"kept_fraction": 0.5}


def test_custom_loss_recipe_trains(tmp_path, monkeypatch):
    import ray

    from opd.cli import main

    monkeypatch.chdir(ROOT)
    cache = tmp_path.parent / "cache"
    try:
        code = main(["train", "examples/custom_loss/recipe.yaml", f"run.output_dir={tmp_path / 'run'}",
                     f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"])
    finally:
        ray.shutdown()
    assert code == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "time/step_s" in line]
    assert len(steps) == 2
    assert max(r["teacher_weighted_nll/kept_fraction"] for r in steps) > 0, "the user's loss saw teacher-approved tokens"
    for record in steps:
        assert math.isfinite(record["loss/teacher_weighted_nll"]) and math.isfinite(record["loss/reverse_kl"])
        assert 0.0 <= record["teacher_weighted_nll/kept_fraction"] <= 1.0
        # The trainer's loss is the weighted sum of the two terms.
        assert record["loss"] == pytest.approx(record["loss/reverse_kl"] + 0.1 * record["loss/teacher_weighted_nll"], abs=1e-5)


def test_the_opd_command_imports_a_loss_from_the_current_directory():
    """The installed ``opd`` script (not ``python -m``, which adds the cwd itself) resolves the
    example's dotted path from the repository root, as the docs promise."""
    import subprocess
    import sys

    opd = Path(sys.executable).parent / "opd"
    result = subprocess.run([str(opd), "check", "examples/custom_loss/recipe.yaml"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "examples.custom_loss.my_losses.teacher_weighted_nll" in result.stdout
