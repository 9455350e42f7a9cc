"""Each loss of a recipe is tried once, in the driver, before the run spends time on anything that
can wait (issue 54, item 3): a loss that raises is named, with the line of the user's code, on the
console, within seconds and before Ray or the pre-training evaluation starts."""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import pytest
import yaml

from opd.config import load_config
from opd.losses import LossError, combined_loss
from opd.runtime.workers import recipe_loss_terms
from opd.training.loss_check import check_losses, probe_batch
from opd.trajectory import HeadRows
from tests.unit import user_losses

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in [*(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "tests" / "data").glob("*.yaml"),
                             ROOT / "examples" / "custom_loss" / "recipe.yaml"] if not p.name.endswith(".study.yaml"))


def _line_of(fn, text: str) -> str:
    """``file:line (text)`` of the line of ``fn``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    number = first + next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{number} ({text})"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_recipes_losses_pass_the_probe(recipe, monkeypatch):
    """No false alarm: the losses of every recipe opd ships (the GPU ones read as YAML, their
    resources being more than this machine has) run on the probe of their scoring and algorithm."""
    monkeypatch.chdir(ROOT)  # the custom-loss example's dotted path imports from the repository root
    raw = yaml.safe_load(recipe.read_text())
    supervision = raw.get("supervision") or {}
    terms = [(loss["name"], float(loss.get("weight", 1.0)), loss.get("args") or {}) for loss in raw["losses"]]
    check_losses(151_936 if "qwen3" in recipe.name else 1000, terms, supervision.get("scoring", "sampled"),
                 supervision.get("top_k", 20), raw.get("algorithm", "vanilla_opd"))


def test_a_loss_that_raises_is_named_with_the_line_of_the_users_code():
    terms = [("reverse_kl", 1.0, {}), ("tests.unit.user_losses.needs_scale", 0.5, {})]
    with pytest.raises(LossError) as caught:
        check_losses(300, terms)
    message = str(caught.value)
    line = _line_of(user_losses.needs_scale, 'scale = cfg["scale"]')
    assert message.startswith(f"loss 'tests.unit.user_losses.needs_scale' raised KeyError: 'scale' at {line} on the "
                              "probe batch opd tries each loss on before the run"), message
    # In training, the same naming (combined_loss is what the trainer calls).
    with pytest.raises(LossError, match=r"loss 'tests.unit.user_losses.needs_scale' raised KeyError: 'scale' at .*"
                                        r"user_losses.py:\d+ \(scale = cfg\["):
        combined_loss(probe_batch(300, terms), terms)
    # One of opd's own losses, misconfigured: the line in opd.losses that raised.
    with pytest.raises(LossError, match=r"loss 'reverse_kl' raised ValueError: .*at .*opd/losses.py:\d+ \(raise "):
        check_losses(300, [("reverse_kl", 1.0, {"estimator": "topk"})])


@pytest.mark.parametrize("name, expected", [
    ("returns_a_float", "returned (float, dict); a loss returns (a scalar tensor, a dict of floats)"),
    ("detached", "returned a tensor without a gradient"),
])
def test_a_loss_that_returns_the_wrong_thing_is_caught(name, expected):
    with pytest.raises(LossError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_losses(300, [(f"tests.unit.user_losses.{name}", 1.0, {})])


@pytest.mark.parametrize("scoring", ["sampled", "topk", "full", "hidden"])
def test_the_probe_carries_what_the_recipes_batches_carry(scoring):
    terms = [("tests.unit.user_losses.reads_every_field", 1.0, {"topk": scoring == "topk"})]
    batch = probe_batch(300, terms, scoring, top_k=5)
    assert (batch.teacher_topk_ids_BTK is not None) == (scoring == "topk")
    assert (batch.teacher_full_logprobs_NV is not None) == (scoring in ("full", "hidden"))
    # Under hidden scoring the teacher's rows are computed from its hidden states, and read alike.
    assert isinstance(batch.teacher_full_logprobs_NV, HeadRows) == (scoring == "hidden")
    assert batch.totals["tokens"] == 11.0 and batch.totals["turns"] == 4.0 and batch.student_logprobs_BT.requires_grad
    check_losses(300, terms, scoring, top_k=5)
    pivot = probe_batch(300, [("pivot_recovery", 1.0, {})], algorithm="pivot_opd")
    assert set(pivot.masks_BT) == {"pivot", "recovery"} and pivot.teacher_topk_ids_BTK is not None


def test_opd_train_stops_on_a_broken_loss_before_ray_and_the_evaluation(tiny_model_dir, tmp_path):
    """The trial's loss (``KeyError: 'scale'``): the console names it and its line, and nothing
    that takes time ran (no Ray, no pre-training evaluation)."""
    import ray
    from rich.console import Console

    from opd.cli import _report_failure
    from opd.runtime.driver import train

    raw = yaml.safe_load((ROOT / "tests" / "data" / "tiny.yaml").read_text())
    raw["teacher"] = raw["student"] = {"path": str(tiny_model_dir)}
    raw["losses"] = [{"name": "tests.unit.user_losses.needs_scale"}]
    raw["run"]["output_dir"] = str(tmp_path / "run")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    cfg = load_config(recipe)
    assert [name for name, _, _ in recipe_loss_terms(cfg)] == ["tests.unit.user_losses.needs_scale"]
    console = Console(file=io.StringIO(), width=300, color_system=None)
    with pytest.raises(Exception) as caught:
        train(cfg, console=console)
    assert not ray.is_initialized()
    args = type("Args", (), {"command": "train", "run_dir": str(tmp_path / "run"), "recipe": str(recipe),
                             "overrides": []})()
    _report_failure(console, args, caught.value)
    shown = " ".join(console.file.getvalue().split())
    assert "error: loss 'tests.unit.user_losses.needs_scale' raised KeyError: 'scale'" in shown
    assert "user_losses.py:" in shown and "(scale = cfg[\"scale\"])" in shown
    assert "before training" not in shown and "resume with" not in shown
