"""What a run does with its user's small mistakes and short runs (issue 54, items 5 and 9): a
``--resume`` of a finished run says so without starting anything, a run into a directory that
already holds checkpoints is a message (no traceback in that run's error.log), and a short run
keeps the training samples of its first and last step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from opd.config import load_config, to_yaml
from opd.training.checkpoint import MARKER

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipe(tmp_path, tiny_model_dir) -> Path:
    raw = yaml.safe_load((ROOT / "tests" / "data" / "tiny.yaml").read_text())
    raw["teacher"] = raw["student"] = {"path": str(tiny_model_dir)}
    raw["run"]["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _finished(recipe: Path, steps: int = 2) -> Path:
    """A run directory as a finished run leaves it: its recipe, the last step's checkpoint, the summary."""
    cfg = load_config(recipe)
    run = Path(cfg.run.output_dir)
    (run / "checkpoints" / f"step_{steps}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{steps}" / MARKER).write_text("{}")
    (run / "config.yaml").write_text(to_yaml(cfg))
    split = {k: 0.5 for k in ("generation_s_per_step", "teacher_scoring_s_per_step", "training_s_per_step",
                              "weight_sync_s_per_step")}
    (run / "summary.json").write_text(json.dumps({
        "teacher_success": 1.0, "student_success_before": 0.25, "student_success_after": 0.75, "steps": steps,
        "train_time_s": 4.0, "eval_episodes": 4, "heldout": {}, "run_dir": str(run), "time_split": split}))
    return run


def test_resuming_a_finished_run_prints_its_summary_without_starting_anything(recipe, capsys, monkeypatch):
    import ray

    from opd.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # rich would wrap the line checked below

    run = _finished(recipe)
    assert main(["train", str(recipe), "--resume"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{run} is complete: it trained all 2 steps (run.total_steps)" in out and "Raise run.total_steps" in out
    assert "student after 2 OPD steps" in out and "75.0%" in out
    assert not ray.is_initialized() and not (run / "error.log").exists()
    # A changed recipe is still refused, finished or not.
    assert main(["train", str(recipe), "trainer.learning_rate=0.5", "--resume"]) == 2
    assert "the recipe differs from the one" in capsys.readouterr().out


def test_a_run_into_a_directory_with_checkpoints_is_a_message_not_a_traceback(recipe, capsys):
    from opd.cli import main

    run = _finished(recipe)
    assert main(["train", str(recipe)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert f"error: {run} already holds checkpoint step_2; pass --resume" in out
    assert not (run / "error.log").exists() and "Traceback" not in out


def test_a_short_run_keeps_the_training_samples_of_its_first_and_last_step(tmp_path, tokenizer):
    from opd.evaluation.trajectories import RunEpisodes
    from opd.trajectory import Trajectory, Turn

    episodes = RunEpisodes(tmp_path, {"student": tokenizer}, every=10, episodes=1, last_step=3)
    traj = Trajectory(task="t", turns=[Turn([1], [2], [-0.5], 0, 1, "a", "o", 1.0)])
    for step in (1, 2, 3):
        episodes.train_sample(step, [traj])
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == ["train_step_1.parquet",
                                                                           "train_step_3.parquet"]
    never = RunEpisodes(tmp_path / "never", {"student": tokenizer}, every=0, episodes=1, last_step=3)
    for step in (1, 3):
        never.train_sample(step, [traj])
    assert not (tmp_path / "never" / "trajectories").exists()


def test_a_second_driver_on_a_live_run_directory_is_refused_at_once(recipe, capsys, monkeypatch):
    """Issue 51, item 5: the trial's second ``opd train --resume`` beside a live run loaded a
    checkpoint the first was rotating (``AssertionError`` in load_checkpoint); now it is refused
    before it starts anything, naming the live driver."""
    import subprocess
    import sys

    from opd.cli import main
    from tests.unit.test_run_lock import HOLD

    monkeypatch.setenv("COLUMNS", "400")
    run = Path(load_config(recipe).run.output_dir)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", str(recipe), "--resume"]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert f"error: {run} is being written by another opd process (pid {holder.pid} on " in out
        assert "resume with" not in out and not (run / "checkpoints").exists()
        assert not (run / "error.log").exists()  # the other driver's directory: nothing written there
    finally:
        holder.kill()
        holder.wait(timeout=10)
