"""The driver's state as a checkpoint keeps it: the JSON checkpoints have always held reads back
as a RunState, and a state this version does not know is refused, naming the key."""

from __future__ import annotations

import json

import pytest

from opd.runtime.run_state import RunState, StateError

# The COMPLETE marker's "state" of a checkpoint written before RunState existed (the quickstart's
# step-50 checkpoint, shortened): the driver's plain dict.
OLD_STATE = {"step": 50, "train_time_s": 103.25,
             "evals": [{"step": 0, "eval/teacher_success": 0.95, "eval/teacher_return": 0.95, "eval/teacher_turns": 6.1,
                        "eval/teacher_time_s": 4.2, "eval/student_success": 0.39, "eval/student_return": 0.3,
                        "eval/student_turns": 7.4, "eval/student_time_s": 3.9, "eval/student_valid_action_rate": 0.97}],
             "teacher_success": 0.95, "student_success_before": 0.39,
             "teacher_check": {"teacher_success": 0.95, "student_success": 0.39, "episodes": 100, "margin": 0.56,
                               "noise": 0.15, "teacher_better": True},
             "sampling_check": {"greedy_valid": 0.97, "sampled_valid": 0.9, "temperature": 1.0, "gap": 0.07,
                                "sampling_ok": True}}


def test_a_state_written_before_the_class_resumes_and_writes_back_the_same_json():
    state = RunState.from_dict(json.loads(json.dumps(OLD_STATE)), "checkpoints/step_50")
    assert state.step == 50 and state.train_time_s == 103.25 and state.student_success_after is None
    assert state.teacher_check["teacher_better"] is True and state.evals[0]["eval/student_success"] == 0.39
    assert state.to_dict() == OLD_STATE  # unset keys stay out, as the dict left them out


def test_a_fresh_state_keeps_only_what_is_set():
    assert RunState().to_dict() == {"step": 0, "train_time_s": 0.0, "evals": []}
    done = RunState(step=3, train_time_s=1.5, student_success_after=0.5)
    assert RunState.from_dict(done.to_dict(), "x") == done


@pytest.mark.parametrize("state,message", [
    ({**OLD_STATE, "curriculum_depth": 3}, r"step_50 holds driver state this version of opd does not know \(curriculum_depth\)"),
    ({"train_time_s": 1.0, "evals": []}, "no integer 'step'"),
    ({"step": 2, "evals": {}}, "no list of 'evals'"),
])
def test_a_state_this_version_cannot_read_is_refused_naming_why(state, message):
    with pytest.raises(StateError, match=message):
        RunState.from_dict(state, "checkpoints/step_50")


def test_the_summary_figures_come_from_the_first_and_last_evaluations():
    state = RunState.from_dict(OLD_STATE, "x")
    state.evals.append({"step": 50, "eval/student_success": 0.6, "eval/student_return": 0.55, "eval/student_turns": 6.5,
                        "eval/student_time_s": 4.0})
    assert state.heldout_figures() == {
        "teacher": {"return": 0.95, "turns": 6.1},
        "student_before": {"return": 0.3, "turns": 7.4, "valid_action_rate": 0.97},
        "student_after": {"return": 0.55, "turns": 6.5}}
