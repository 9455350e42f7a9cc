"""A teacher no better than its student is flagged at step 0: a warning on the console and
``teacher_check`` in ``summary.json`` (with the environment's held-out figures beside success),
or, with ``run.teacher_check: error``, a stopped run naming the figures and what to do. Samples
far less valid than greedy play are flagged at step 1 the same way (``run.sampling_check``), under
OPD and GRPO alike.

The tiny recipe's teacher and student both score 0% on its held-out tasks, so its teacher is not
better; its 5-step student makes valid moves in 75% of its greedy turns but in none of its
sampled ones. The real run, on the local backend.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
pytestmark = pytest.mark.integration


def _args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    cache = tmp_path / "cache"
    return ["train", str(TINY), f"run.output_dir={tmp_path / name}", "run.backend=local", "run.total_steps=1",
            f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}", *extra]


def _said(capsys) -> str:
    """What the run printed, as one line: the console's wrapping and its log-call column removed."""
    captured = capsys.readouterr()
    return " ".join(re.sub(r"\S+\.py:\d+", " ", captured.out + captured.err).split())


def test_a_teacher_no_better_than_the_student_is_flagged_or_stops_the_run(tmp_path, capsys):
    from opd.cli import main

    assert main(_args(tmp_path, "warn")) == 0
    out = _said(capsys)
    assert "warning: the teacher is not clearly above the student on the 4 held-out tasks before training" in out
    assert "teacher 0.0%, student 0.0%" in out and "run.teacher_check: error stops a run here" in out
    summary = json.loads((tmp_path / "warn" / "summary.json").read_text())
    assert summary["teacher_check"]["teacher_better"] is False and summary["teacher_check"]["episodes"] == 4
    assert set(summary["heldout"]) == {"teacher", "student_before", "student_after"}
    assert {"return", "turns"} <= set(summary["heldout"]["teacher"])

    assert main(_args(tmp_path, "error", "run.teacher_check=error")) == 2  # refused, as a bad recipe is
    out = _said(capsys)
    assert "the teacher is not clearly above the student" in out and "(run.teacher_check: error)" in out
    assert not (tmp_path / "error" / "summary.json").exists()

    assert main(_args(tmp_path, "off", "run.teacher_check=ignore")) == 0
    assert "teacher is not clearly above" not in _said(capsys)
    assert "teacher_check" not in json.loads((tmp_path / "off" / "summary.json").read_text())


def test_samples_far_less_valid_than_greedy_play_are_flagged_or_stop_the_run(tmp_path, capsys):
    from opd.cli import main

    assert main(_args(tmp_path, "warn", "run.teacher_check=ignore")) == 0
    out = _said(capsys)
    assert "warning: the student's sampled responses (rollout.temperature 1) made a valid action in 0.0% of the " \
           "first step's turns, against 75.0% greedily before training" in out
    summary = json.loads((tmp_path / "warn" / "summary.json").read_text())
    check = summary["sampling_check"]
    assert (check["sampling_ok"], check["greedy_valid"], check["sampled_valid"]) == (False, 0.75, 0.0)
    assert summary["heldout"]["student_before"]["valid_action_rate"] == 0.75

    assert main(_args(tmp_path, "error", "run.teacher_check=ignore", "run.sampling_check=error")) == 2
    out = _said(capsys)
    assert "made a valid action in 0.0%" in out and "(run.sampling_check: error)" in out
    assert not (tmp_path / "error" / "summary.json").exists()

    assert main(_args(tmp_path, "off", "run.teacher_check=ignore", "run.sampling_check=ignore")) == 0
    assert "sampled responses" not in _said(capsys)
    assert "sampling_check" not in json.loads((tmp_path / "off" / "summary.json").read_text())


def test_grpo_samples_far_less_valid_than_greedy_play_are_flagged_with_what_rl_does_with_them(tmp_path, capsys):
    """GRPO has no teacher to grade the samples, but their rewards are then mostly the price of
    invalid turns (the clinical reward study's students all learnt to commit at once)."""
    from opd.cli import main

    assert main(_args(tmp_path, "grpo", "run.teacher_check=ignore", "algorithm=grpo", "losses=[{name: ppo_clip}]",
                "rollout.group_size=4")) == 0
    out = _said(capsys)
    assert "made a valid action in 0.0% of the first step's turns, against 75.0% greedily" in out
    assert "RL trains on the samples" in out and "the teacher grades" not in out
    assert json.loads((tmp_path / "grpo" / "summary.json").read_text())["sampling_check"]["sampling_ok"] is False
