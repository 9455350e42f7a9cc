"""Environments in child processes: a raise, a crash or a hang ends that episode only; the other
episodes are exactly what they would have been, and the pool keeps working."""

from __future__ import annotations

import time

import pytest

import tests.data.faulty_env  # noqa: F401  (registers opdtest/FaultyFrozenLake-v0)
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.rollout.env_pool import EnvFailure, EnvWorkerPool
from opd.rollout.vanilla import EpisodeSettings, run_episodes

KWARGS = {"max_turns": 4, "n_train_tasks": 16, "n_eval_tasks": 4}
TASKS = ["fl4-train-00000", "fl4-train-00001", "fl4-train-00002", "fl4-train-00005"]  # 00001 and 00005 fail


def _factory(fault: str) -> EnvFactory:
    return EnvFactory("opdtest/FaultyFrozenLake-v0", {**KWARGS, "fault": fault, "at_turn": 2}, "tests.data.faulty_env")


def _comparable(traj):
    return [(t.response_ids, t.action_text, t.observation, t.reward, t.terminated, t.truncated) for t in traj.turns], traj.end_reason


@pytest.mark.parametrize("fault, kind", [("raise", "error"), ("crash", "crash"), ("hang", "timeout")])
def test_a_failing_environment_ends_only_its_episode(tokenizer, fmt, tiny_model_dir, fault, kind):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    # Greedy: an episode's tokens do not depend on which other episodes share its batch.
    settings = EpisodeSettings(max_new_tokens=4, temperature=0.0)
    # Reference: the healthy env in this process, same tasks, same seed.
    healthy = EnvFactory("opd/FrozenLakeText-v0", KWARGS)
    reference = run_episodes(engine, healthy, TASKS, tokenizer, fmt, settings, seed=7)
    with EnvWorkerPool(_factory(fault), timeout_s=3.0, preload=("environments", "tests.data.faulty_env")) as pool:
        start = time.monotonic()
        trajs = run_episodes(engine, None, TASKS, tokenizer, fmt, settings, seed=7, envs=pool)
        elapsed = time.monotonic() - start
        for i in (0, 2):  # untouched episodes: identical to the healthy run
            assert _comparable(trajs[i]) == _comparable(reference[i])
        for i in (1, 3):
            traj = trajs[i]
            assert traj.end_reason == "env_error" and not traj.success
            assert traj.error.startswith(f"environment {kind}") if kind != "error" else "simulated engine failure" in traj.error
            assert len(traj.turns) == 2  # the failing step's response is kept, nothing after it
            assert traj.turns[0].observation == reference[i].turns[0].observation
        assert pool.restarts == (2 if kind != "error" else 0)
        if kind == "timeout":
            assert elapsed < 3.0 * 2 + 10, "both hangs share one deadline"
        # The pool goes on: the failed slots serve fresh episodes.
        again = run_episodes(engine, None, ["fl4-train-00000"] * 2, tokenizer, fmt, settings, seed=7, envs=pool)
        assert _comparable(again[0]) == _comparable(reference[0]) == _comparable(again[1])


def test_pool_results_and_failures_line_up_with_their_calls():
    with EnvWorkerPool(_factory("raise"), timeout_s=10.0, preload=("environments", "tests.data.faulty_env")) as pool:
        resets = pool.reset_many([(0, "fl4-train-00000", 0), (1, "no-such-task", 0)])
        assert isinstance(resets[0], tuple) and resets[0][0].startswith("Reach G")
        assert isinstance(resets[1], EnvFailure) and resets[1].kind == "error" and "no-such-task" in resets[1].message
        (step,) = pool.step_many([(0, "not a move")])
        assert step[4]["valid_action"] is False  # a bad action is an observation, in a child too


def test_children_do_not_import_the_parents_main_module(tmp_path):
    """Inside a Ray actor ``__main__`` is Ray's worker script; a child importing it would load
    all of Ray. Checked with a main script whose top level leaves a mark each time it runs."""
    import subprocess
    import sys
    from pathlib import Path

    marks = tmp_path / "marks"
    script = tmp_path / "main_script.py"
    script.write_text(
        "import os, sys\n"
        f"open({str(marks)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from opd.envs import EnvFactory\n"
        "from opd.rollout.env_pool import EnvWorkerPool\n"
        "if __name__ == '__main__':\n"
        "    with EnvWorkerPool(EnvFactory('opd/FrozenLakeText-v0', {}), timeout_s=30) as pool:\n"
        "        results = pool.reset_many([(i, 'fl4-train-00000', 0) for i in range(3)])\n"
        "        assert all(isinstance(r, tuple) for r in results)\n"
    )
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    assert len(marks.read_text().split()) == 1, "a child process re-ran the parent's main module"


def _slow_pool(delay_s: float, timeout_s: float = 10.0) -> EnvWorkerPool:
    factory = EnvFactory("opdtest/FaultyFrozenLake-v0", {**KWARGS, "fault": "slow", "step_delay_s": delay_s},
                         "tests.data.faulty_env")
    return EnvWorkerPool(factory, timeout_s=timeout_s, preload=("environments", "tests.data.faulty_env"))


def test_the_caller_works_while_the_children_step_and_gets_the_same_answers():
    """``while_waiting`` runs in the caller's thread while the children compute, until it says
    it has no work left; the answers are those of a plain ``step_many``."""
    calls = []

    def work() -> bool:
        calls.append(time.monotonic())
        time.sleep(0.01)
        return len(calls) < 5  # five units of work, then none

    with _slow_pool(0.3) as pool:
        pool.reset_many([(0, "fl4-train-00000", 0), (1, "fl4-train-00002", 0)])
        start = time.monotonic()
        overlapped = pool.step_many([(0, "right"), (1, "down")], while_waiting=work)
        assert time.monotonic() - start >= 0.3  # it still waited for the slow steps
        assert len(calls) == 5 and calls[-1] - start < 0.3  # all the work ran inside the wait
        pool.reset_many([(0, "fl4-train-00000", 0), (1, "fl4-train-00002", 0)])
        plain = pool.step_many([(0, "right"), (1, "down")])
    assert [r[:4] for r in overlapped] == [r[:4] for r in plain]


def test_work_that_never_ends_does_not_outlast_the_deadline():
    """A hung child times out on schedule even while the caller always has work."""
    with EnvWorkerPool(_factory("hang"), timeout_s=1.0, preload=("environments", "tests.data.faulty_env")) as pool:
        pool.reset_many([(0, "fl4-train-00001", 0)])
        pool.step_many([(0, "right")])  # turn 1 is fine; the step of turn 2 hangs
        start = time.monotonic()
        (result,) = pool.step_many([(0, "right")], while_waiting=lambda: time.sleep(0.01) is None)
        assert isinstance(result, EnvFailure) and result.kind == "timeout"
        assert time.monotonic() - start < 1.0 + 2.0


def test_answers_within_the_grace_are_not_held_up_by_work():
    """Children that answer within ``grace_s`` never see the caller's work run; slower ones do."""
    calls = []

    def work() -> bool:
        calls.append(1)
        time.sleep(0.01)
        return True

    with _slow_pool(0.0) as fast_pool:
        fast_pool.reset_many([(0, "fl4-train-00000", 0)])
        (result,) = fast_pool.step_many([(0, "right")], while_waiting=work, grace_s=2.0)
    assert not isinstance(result, EnvFailure) and calls == []
    with _slow_pool(0.5) as slow_pool:
        slow_pool.reset_many([(0, "fl4-train-00000", 0)])
        (result,) = slow_pool.step_many([(0, "right")], while_waiting=work, grace_s=0.1)
    assert not isinstance(result, EnvFailure) and 5 <= len(calls) <= 45  # about (0.5 - 0.1) / 0.01 units
