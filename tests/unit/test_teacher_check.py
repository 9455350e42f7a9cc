"""The step-0 check that the teacher beats the student (issue: a teacher at 22% distilled into a
student at 64% took it to 0% and nothing warned), the step-1 check that the student's samples are
about as valid as its greedy play (a reasoning student whose samples were 41% valid against 100%
greedily collapsed to 0% while its KL fell), and the environment's own held-out figures."""

from __future__ import annotations

import pytest

from opd.evaluation.heldout import check_sampling, check_teacher, env_figures, valid_action_rate
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


def test_env_figures_average_what_the_episodes_report_of_the_envs_report_keys():
    from environments.clinical import ClinicalWorkupEnv
    from environments.scienceworld_env import ScienceWorldTextEnv
    from opd.envs import EnvFactory, report_keys

    clinical = report_keys(EnvFactory("opd/ClinicalWorkup-v0"))
    assert clinical == ClinicalWorkupEnv.report_keys and "value" in clinical
    trajs = [_traj({"value": 2.0, "questions_asked": 3, "premature_commitment": True, "score": 9}, 1.0),
             _traj({"value": -1.0, "questions_asked": 1, "premature_commitment": False}, 0.0),
             _traj({}, 0.0)]
    # score is not the clinical simulator's figure: not averaged, whatever an info holds
    assert env_figures(trajs, clinical) == {"value": 0.5, "questions_asked": 2.0, "premature_commitment": 0.5}
    assert env_figures([_traj({"score": 40}, 0.4), _traj({"score": 100}, 1.0)],
                       ScienceWorldTextEnv.report_keys) == {"score": 70.0}
    assert report_keys(EnvFactory("opd/FrozenLakeText-v0")) == () and report_keys(lambda: None) == ()


@pytest.mark.parametrize("greedy,sampled,ok", [
    (1.0, 0.415, False),   # the view study's reasoning student (60 SFT steps): it collapsed
    (1.0, 0.86, True),     # the same student after 150 SFT steps: it held
    (0.30, 0.10, True),    # weak everywhere: no gap to flag (the teacher check is the guard there)
    (1.0, 0.75, True),     # exactly the allowed gap
])
def test_samples_far_less_valid_than_greedy_play_are_flagged(greedy, sampled, ok):
    check = check_sampling(greedy, sampled, 1.0)
    assert check.sampling_ok is ok
    assert check.gap == pytest.approx(greedy - sampled)
    if not ok:
        message = check.message()
        assert f"in {100 * sampled:.1f}% of the first step's turns, against {100 * greedy:.1f}%" in message
        assert "student.bootstrap.sft_steps" in message and "rollout.temperature" in message
        assert "run.sampling_check" in message
        assert "the teacher grades" in message and "the teacher grades" not in check.message(graded_by_teacher=False)
        assert "RL trains on the samples" in check.message(graded_by_teacher=False)


def test_valid_action_rate_counts_only_turns_whose_environment_says():
    trajs = [_traj({"valid_action": True}, 0.0), _traj({"valid_action": False}, 0.0), _traj({}, 0.0)]
    trajs[0].turns.append(trajs[1].turns[0])  # the first episode also plays an invalid turn: 1 valid of 3 said
    assert valid_action_rate(trajs) == pytest.approx(1 / 3)
    assert valid_action_rate([_traj({}, 0.0)]) is None
