"""The step-0 check that the teacher beats the student (issue: a teacher at 22% distilled into a
student at 64% took it to 0% and nothing warned), and the environment's own held-out figures."""

from __future__ import annotations

import pytest

from opd.evaluation.heldout import check_teacher, env_figures
from opd.trajectory import Trajectory, Turn


@pytest.mark.parametrize("teacher,student,n,better", [
    (0.22, 0.64, 50, False),  # the reported case: clearly below
    (0.75, 0.70, 20, False),  # above, but within two standard errors (28 points at n = 20)
    (0.90, 0.40, 20, True),
    (0.0, 0.0, 8, False),     # nothing to tell apart
    (1.0, 0.0, 4, True),
    (1.0, 1.0, 4, False),
])
def test_the_teacher_must_beat_the_student_by_more_than_the_noise(teacher, student, n, better):
    check = check_teacher(teacher, student, n)
    assert check.teacher_better is better
    assert check.margin == pytest.approx(teacher - student)
    expected_noise = 2 * ((teacher * (1 - teacher) + student * (1 - student)) / n) ** 0.5
    assert check.noise == pytest.approx(expected_noise)
    if not better:
        message = check.message()
        assert f"teacher {100 * teacher:.1f}%, student {100 * student:.1f}%" in message
        assert "teacher.path" in message and "supervision.teacher_view" in message and "run.teacher_check" in message


def _traj(info: dict, reward: float) -> Trajectory:
    traj = Trajectory(task="t")
    traj.turns.append(Turn(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], action_start=0, action_end=1,
                           action_text="a", reward=reward, info=info))
    return traj


def test_env_figures_average_what_the_episodes_report():
    trajs = [_traj({"value": 2.0, "questions_asked": 3, "premature_commitment": True}, 1.0),
             _traj({"value": -1.0, "questions_asked": 1, "premature_commitment": False}, 0.0),
             _traj({}, 0.0)]
    assert env_figures(trajs) == {"value": 0.5, "questions_asked": 2.0, "premature_commitment": 0.5}
    assert env_figures([_traj({"score": 40}, 0.4), _traj({"score": 100}, 1.0)]) == {"score": 70.0}
