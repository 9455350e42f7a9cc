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
        # A crash is tried once more in a fresh process after replaying the episode: it crashes again.
        assert pool.restarts == {"error": 0, "crash": 4, "timeout": 2}[kind] and pool.replays == 0
        if kind == "crash":
            assert "after replaying the episode's 2 call(s), it failed again" in trajs[1].error
        if kind == "timeout":
            assert elapsed < 3.0 * 2 + 10, "both hangs share one deadline"
        # The pool goes on: the failed slots serve fresh episodes.
        again = run_episodes(engine, None, ["fl4-train-00000"] * 2, tokenizer, fmt, settings, seed=7, envs=pool)
        assert _comparable(again[0]) == _comparable(reference[0]) == _comparable(again[1])


def _play(pool: EnvWorkerPool, actions: list[str], kill_after: int | None = None, delay_s: float = 0.0) -> list:
    """Two episodes side by side (slots 0 and 1); slot 0's process is SIGKILLed from outside
    ``delay_s`` after the step ``kill_after`` was sent (0: right after its reset)."""
    import os
    import signal
    import threading

    answers = [pool.reset_many([(0, "fl4-train-00000", 3), (1, "fl4-train-00000", 4)])]
    for n, action in enumerate(actions, 1):
        killer = None
        if n == kill_after:
            pid = pool._slots[0].process.pid
            killer = threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL))
            killer.start()
        answers.append(pool.step_many([(0, action), (1, action)]))
        if killer is not None:
            killer.join()
    return answers


def test_a_child_killed_mid_episode_is_replayed_in_a_fresh_one_and_the_episode_goes_on_unchanged():
    """An environment's process killed from outside (the OOM killer, a chaos run) while idle
    between steps or in the middle of one: a fresh child replays the episode's calls, each answer
    checked, and the episode goes on with exactly the answers an unbroken pool gives."""
    actions = ["right", "right", "down", "right"]  # each to a new square, none into a hole
    with _slow_pool(0.0) as pool:
        unbroken = _play(pool, actions)
        assert (pool.restarts, pool.replays) == (0, 0)
    with _slow_pool(0.0) as pool:
        assert _play(pool, actions, kill_after=3) == unbroken  # killed idle, found dead when step 3 is sent
        assert (pool.restarts, pool.replays) == (1, 1)
    with _slow_pool(0.5) as pool:
        assert _play(pool, actions, kill_after=4, delay_s=0.2) == unbroken  # killed while it computes step 4
        assert (pool.restarts, pool.replays) == (1, 1)


def test_a_replay_that_answers_differently_ends_the_episode_saying_why():
    """An environment that is not a function of its seed and actions cannot be carried on: the
    crash is the episode's failure, and the message says the replay diverged."""
    factory = EnvFactory("opdtest/FaultyFrozenLake-v0", {**KWARGS, "fault": "unseeded"}, "tests.data.faulty_env")
    with EnvWorkerPool(factory, timeout_s=10.0, preload=("environments", "tests.data.faulty_env")) as pool:
        answers = _play(pool, ["right", "down"], kill_after=2)
        failure = answers[2][0]
        assert isinstance(failure, EnvFailure) and failure.kind == "crash"
        # killed before step 2 was sent ("had died before the call") or while it ran ("died (exit code -9, SIGKILL)")
        assert failure.message.startswith("environment crash: its process ")
        assert "gave a different answer at its call 1 of 2" in failure.message
        assert isinstance(answers[2][1], tuple) and pool.replays == 0  # the other slot went on
    with EnvWorkerPool(factory, timeout_s=10.0, preload=("environments", "tests.data.faulty_env"),
                       replay_crashes=False) as pool:
        failure = _play(pool, ["right", "down"], kill_after=2)[2][0]
        assert failure.kind == "crash" and "replay" not in failure.message and pool.restarts == 1


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


# ----- answers come back as checked JSON, never as a pickle -----
PRELOAD = ("environments", "tests.data.faulty_env")


def _fault_pool(fault: str, timeout_s: float = 30.0, **kwargs) -> EnvWorkerPool:
    limits = {k: kwargs.pop(k) for k in ("memory_limit_mb", "cpu_time_limit_s", "max_result_bytes") if k in kwargs}
    factory = EnvFactory("opdtest/FaultyFrozenLake-v0", {**KWARGS, "fault": fault, "at_turn": 2, **kwargs},
                         "tests.data.faulty_env")
    return EnvWorkerPool(factory, timeout_s, PRELOAD, **limits)


def _play_to_the_fault(pool: EnvWorkerPool) -> list:
    """Slot 0 plays a faulty task and slot 1 a healthy one; returns the step results of turn 2."""
    assert all(isinstance(r, tuple) for r in pool.reset_many([(0, "fl4-train-00001", 0), (1, "fl4-train-00002", 0)]))
    assert all(isinstance(r, tuple) for r in pool.step_many([(0, "down"), (1, "down")]))
    return pool.step_many([(0, "down"), (1, "right")])


def _slot_plays_on(pool: EnvWorkerPool, slot: int = 0) -> None:
    (reset,) = pool.reset_many([(slot, "fl4-train-00000", 0)])
    (step,) = pool.step_many([(slot, "down")])
    assert reset[0].startswith("Reach G") and isinstance(step, tuple) and step[4]["turn"] == 1


def _episodes(envs, tasks_actions: list[tuple[str, list[str]]]) -> list:
    """Each task's reset and step results, one slot per task, stepped together."""
    results = [[r] for r in envs.reset_many([(i, task, 0) for i, (task, _) in enumerate(tasks_actions)])]
    for turn in range(max(len(actions) for _, actions in tasks_actions)):
        live = [(i, actions[turn]) for i, (_, actions) in enumerate(tasks_actions) if turn < len(actions)]
        for (i, _), result in zip(live, envs.step_many(live)):
            results[i].append(result)
    return results


@pytest.mark.parametrize("env_id, kwargs", [("opd/FrozenLakeText-v0", KWARGS), ("opd/SQLText-v0", {"max_turns": 4})])
def test_a_child_answers_exactly_what_the_env_returns_in_process(env_id, kwargs, tmp_path):
    """Observations, rewards, flags and whole infos (types included) are those of
    :class:`InProcessEnvs`: JSON carries every value these envs put in an answer."""
    from opd.rollout.env_pool import InProcessEnvs

    if env_id == "opd/SQLText-v0":
        kwargs = {**kwargs, "cache_dir": str(tmp_path / "sql")}
    factory = EnvFactory(env_id, kwargs)
    tasks = factory().unwrapped.task_ids("eval")[:2]
    with InProcessEnvs(factory) as local:  # the expert's moves, with a bad action on turn 2
        plans = []
        for task in tasks:
            _, info = local.reset_many([(0, task, 0)])[0]
            actions = []
            while info.get("expert_action") and len(actions) < 6:
                actions.append(info["expert_action"] if len(actions) != 1 else "not an action")
                result = local.step_many([(0, actions[-1])])[0]
                info = result[4]
                if result[2] or result[3]:
                    break
            plans.append((task, actions))
        expected = _episodes(local, plans)
    with EnvWorkerPool(factory, timeout_s=60) as pool:
        got = _episodes(pool, plans)
    assert sum(len(actions) for _, actions in plans) >= 4
    assert got == expected

    def types(value):
        if isinstance(value, (tuple, list)):
            return type(value).__name__, [types(v) for v in value]
        if isinstance(value, dict):
            return {k: types(v) for k, v in value.items()}
        return type(value).__name__

    assert types(got) == types(expected)


def test_an_answer_json_cannot_carry_is_an_error_that_says_where(tmp_path):
    with _fault_pool("unserialisable") as pool:
        failed, healthy = _play_to_the_fault(pool)
        assert isinstance(healthy, tuple)
        assert isinstance(failed, EnvFailure) and failed.kind == "error"
        assert "step()[4]['engine_state'] is a builtins.object" in failed.message and "JSON" in failed.message
        assert pool.restarts == 0  # the env is sound; it only answered something it should not
        _slot_plays_on(pool)


def test_an_answer_over_max_result_bytes_is_refused():
    with _fault_pool("huge", huge_chars=2**20, max_result_bytes=2**16) as pool:
        failed, healthy = _play_to_the_fault(pool)
        assert isinstance(healthy, tuple)
        assert isinstance(failed, EnvFailure) and failed.kind == "error"
        assert f"over max_result_bytes={2**16}" in failed.message
        _slot_plays_on(pool)


@pytest.mark.parametrize("forged, says", [
    ("pickle", "not JSON"),
    ("garbage", "not JSON"),
    ("oversized", "max_result_bytes"),
    ("bad_shape", "step() returned 3 values; expected (observation, reward, terminated, truncated, info)"),
])
def test_a_forged_reply_is_never_unpickled_and_restarts_the_slot(tmp_path, forged, says):
    """A compromised environment process writes its own bytes onto the pipe: the pool decodes
    them as JSON only, checks them, and replaces the process, whose replies it can no longer trust."""
    import pickle

    from tests.data.faulty_env import LeavesAMark

    control = tmp_path / "control"
    pickle.loads(pickle.dumps(LeavesAMark(str(control))))
    assert control.exists(), "the forged pickle is live: loading it runs code"
    marker = tmp_path / "marker"
    with _fault_pool("forge", timeout_s=10.0, forged=forged, marker_path=str(marker), huge_chars=2**20,
                     max_result_bytes=2**16) as pool:
        failed, healthy = _play_to_the_fault(pool)
        assert isinstance(healthy, tuple)
        assert isinstance(failed, EnvFailure) and failed.kind == "error" and says in failed.message, failed
        assert pool.restarts == 1
        _slot_plays_on(pool)
    assert not marker.exists(), "the pool unpickled what the environment's process sent"


# ----- memory and CPU-time limits -----
def test_an_env_past_its_memory_limit_fails_alone_and_its_slot_restarts():
    with _fault_pool("allocate", allocate_mb=2048, memory_limit_mb=512) as pool:
        start = time.monotonic()
        failed, healthy = _play_to_the_fault(pool)
        assert isinstance(healthy, tuple) and healthy[4]["turn"] == 2
        assert isinstance(failed, EnvFailure) and failed.kind == "limit", failed
        assert "ran out of memory" in failed.message and "512 MiB (env.memory_limit_mb)" in failed.message
        assert "MemoryError" in failed.message
        assert pool.restarts == 1 and time.monotonic() - start < 20
        _slot_plays_on(pool)
        _slot_plays_on(pool, slot=1)


def test_an_env_past_its_cpu_time_limit_is_ended_before_the_timeout():
    with _fault_pool("spin", timeout_s=60.0, spin_s=60.0, cpu_time_limit_s=1.0) as pool:
        start = time.monotonic()
        failed, healthy = _play_to_the_fault(pool)
        elapsed = time.monotonic() - start
        assert isinstance(healthy, tuple)
        assert isinstance(failed, EnvFailure) and failed.kind == "limit", failed
        assert "more than 1 s of CPU time in one call (env.cpu_time_limit_s)" in failed.message
        assert elapsed < 20, "the CPU-time limit, not the 60 s timeout, ended the call"
        assert pool.restarts == 1
        _slot_plays_on(pool)


def test_the_cpu_time_limit_is_per_call_not_per_process():
    """Calls that each stay under the limit never add up to it: a child lives across episodes."""
    factory = EnvFactory("opdtest/FaultyFrozenLake-v0", {**KWARGS, "fault": "spin", "spin_s": 0.4, "every": 1,
                                                         "at_turn": 1}, "tests.data.faulty_env")
    with EnvWorkerPool(factory, 30.0, PRELOAD, cpu_time_limit_s=1.0) as pool:
        for _ in range(4):  # 4 x 0.4 s of CPU in one process, 0.4 s a call
            (reset,) = pool.reset_many([(0, "fl4-train-00000", 0)])
            (step,) = pool.step_many([(0, "down")])
            assert isinstance(step, tuple), step
        assert pool.restarts == 0


def test_limits_off_and_bad_limits():
    with _fault_pool("raise", memory_limit_mb=0, cpu_time_limit_s=0) as pool:
        _slot_plays_on(pool)
    for bad in ({"memory_limit_mb": -1}, {"cpu_time_limit_s": float("inf")}, {"max_result_bytes": 10},
                {"memory_limit_mb": "4096"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EnvWorkerPool(_factory("raise"), 10.0, **bad)


def test_pool_signature():
    """Callers pass ``(factory, timeout_s, preload)`` positionally; the limits are keywords."""
    import inspect

    params = inspect.signature(EnvWorkerPool).parameters
    assert list(params)[:3] == ["factory", "timeout_s", "preload"]
    assert all(params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for name in list(params)[:3])
    assert {name: (p.kind, p.default) for name, p in list(params.items())[3:]} == {
        "memory_limit_mb": (inspect.Parameter.KEYWORD_ONLY, 4096),
        "cpu_time_limit_s": (inspect.Parameter.KEYWORD_ONLY, 60.0),
        "max_result_bytes": (inspect.Parameter.KEYWORD_ONLY, 8 * 2**20),
        "replay_crashes": (inspect.Parameter.KEYWORD_ONLY, True),
    }


def test_a_jvm_environment_plays_under_the_default_limits(tmp_path):
    """ScienceWorld's engine is a JVM the env child starts: it inherits the memory limit, sizes
    its heap from it (not from the machine, where a large node's first heap alone would pass
    it) and plays; the per-call CPU timer does not follow it into the JVM."""
    import shutil

    pytest.importorskip("scienceworld")
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs java")
    factory = EnvFactory("opd/ScienceWorldText-v0", {"task_names": ["find-animal"], "max_turns": 4,
                                                      "cache_dir": str(tmp_path)})
    with EnvWorkerPool(factory, timeout_s=120) as pool:
        (reset,) = pool.reset_many([(0, "sw-find-animal-150", 0)])
        assert isinstance(reset, tuple), reset
        (step,) = pool.step_many([(0, reset[1]["expert_action"])])
        assert isinstance(step, tuple) and step[4]["valid_action"], step
        child = pool._slots[0].process.pid
        (jvm,) = [int(p) for p in open(f"/proc/{child}/task/{child}/children").read().split()]
        limits = open(f"/proc/{jvm}/limits").read()
        environ = open(f"/proc/{jvm}/environ", "rb").read().split(b"\0")
    data_limit = next(line for line in limits.splitlines() if line.startswith("Max data size")).split()[3:5]
    assert data_limit == [str(4096 * 2**20)] * 2
    assert f"JAVA_TOOL_OPTIONS=-XX:MaxRAM={4096 * 2**20}".encode() in environ
    assert next(line for line in limits.splitlines() if line.startswith("Max cpu time")).split()[3] == "unlimited"
