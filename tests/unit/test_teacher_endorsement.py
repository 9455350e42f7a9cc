"""bench/teacher_endorsement.py: each sampled turn's kind, and the teacher's and student's
probability of it, read from a run's training-sample files in the format the loop writes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from opd.evaluation.trajectories import write_episodes

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("teacher_endorsement", ROOT / "bench" / "teacher_endorsement.py")
teacher_endorsement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(teacher_endorsement)


def _turn(action: str, valid: bool, expert: str, teacher: list[float], student: list[float]) -> dict:
    return {"prompt": "", "response": action, "action": action, "action_start": 0, "action_end": len(action),
            "observation": "", "reward": 0.0, "valid_action": valid, "expert_action": expert,
            "response_ids": list(range(len(student))), "response_tokens": [""] * len(student),
            "behaviour_logprobs": student, "teacher_logprobs": teacher, "marks": []}


def _episode(turns: list[dict]) -> dict:
    return {"step": 1, "kind": "train", "episode": 0, "task": "t", "sample": 0, "turn_budget": 0, "success": False,
            "end_reason": "truncated", "error": "", "total_reward": 0.0, "task_prompt": "", "turns": turns}


def test_turns_are_sorted_by_kind_and_each_kind_gets_both_probabilities(tmp_path):
    ln = math.log
    first = _episode([
        _turn("go to desk 1", True, "go to desk 1", [ln(0.5), 0.0], [ln(0.25), 0.0]),   # the expert's: 0.5 vs 0.25
        _turn("go to desk 1", False, "take pen 1 from desk 1", [ln(0.9)], [ln(0.6)]),  # a repeat, before validity
        _turn("use lamp 1", False, "take pen 1 from desk 1", [ln(0.1)], [ln(0.3)]),    # invalid
    ])
    second = _episode([
        _turn("open drawer 1", True, "", [ln(0.2)], [ln(0.4)]),                        # no expert: another valid
        _turn("look", True, "look", [], []),                                          # unscored: skipped, yet the
        _turn("look", True, "look", [ln(0.7)], [ln(0.5)]),                             # next one still repeats it
    ])
    (tmp_path / "trajectories").mkdir()
    write_episodes(tmp_path / "trajectories" / "train_step_10.parquet", [first])
    write_episodes(tmp_path / "trajectories" / "train_step_2.parquet", [second])
    write_episodes(tmp_path / "trajectories" / "eval_student_step_0.parquet", [first])  # not a training sample

    table = teacher_endorsement.main([str(tmp_path)])
    assert list(table) == list(teacher_endorsement.KINDS)
    repeats = table["repeats the last action"]
    assert repeats["turns"] == 2
    assert (repeats["teacher"], repeats["student"], repeats["teacher_higher"]) == pytest.approx((0.8, 0.55, 1.0))
    assert table["the expert's action"] == pytest.approx({"turns": 1, "teacher": 0.5, "student": 0.25, "teacher_higher": 1.0})
    assert table["another valid action"] == pytest.approx({"turns": 1, "teacher": 0.2, "student": 0.4, "teacher_higher": 0.0})
    assert table["invalid action"] == pytest.approx({"turns": 1, "teacher": 0.1, "student": 0.3, "teacher_higher": 0.0})


def test_a_run_without_training_samples_says_what_writes_them(tmp_path):
    with pytest.raises(SystemExit, match="trajectory_every_steps"):
        teacher_endorsement.main([str(tmp_path)])


def test_repeat_share_counts_each_turn_that_repeats_the_one_before():
    episodes = [_episode([_turn("go to desk 1", True, "", [], []), _turn("go to desk 1", False, "", [], []),
                          _turn("look", True, "", [], [])]),
                _episode([_turn("look", True, "", [], [])])]  # a new episode: not a repeat of the last one's
    assert teacher_endorsement.repeat_share(episodes) == pytest.approx((0.25, 0.75, 4))
