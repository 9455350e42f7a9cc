"""A whole training run goes on when its environment raises or hangs: the episode is marked, the
environment's process is replaced, and training, evaluation and checkpoints carry on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_run_survives_an_environment_that_raises_or_hangs(tmp_path, fault):
    import ray

    from opd.cli import main

    from opd.config import load_config
    from opd.bootstrap import resolve_model_path

    cache = tmp_path.parent / "cache"
    run = tmp_path / "run"
    # The models are bootstrapped on the healthy env (as in the other integration tests); the run
    # then plays the faulty one with them.
    healthy = load_config(TINY, [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"])
    student = resolve_model_path(healthy.student, healthy.env, healthy.run.seed + 1, print)
    teacher = resolve_model_path(healthy.teacher, healthy.env, healthy.run.seed, print)
    overrides = [
        f"run.output_dir={run}", "student.bootstrap=null", "teacher.bootstrap=null",
        f"student.path={student}", f"teacher.path={teacher}",
        "env.id=opdtest/FaultyFrozenLake-v0", "env.module=tests.data.faulty_env", "env.timeout_s=3",
        f"env.kwargs={{map_size: 4, max_turns: 6, n_train_tasks: 64, n_eval_tasks: 8, fault: {fault}, every: 3, at_turn: 2}}",
    ]
    try:
        code = main(["train", str(TINY), *overrides])
    finally:
        ray.shutdown()
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["env_errors"] for r in steps) >= 1, "some sampled task hit the fault"
    restarts = sum(r["env_restarts"] for r in steps)
    assert restarts == (sum(r["env_errors"] for r in steps) if fault == "hang" else 0)
    for r in steps:
        assert math.isfinite(r["loss"]) and r["nonfinite_loss"] == 0.0
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file()
    # The marked episodes are in the evaluation record with their reason.
    from opd.evaluation.trajectories import read_episodes, run_episode_files

    episodes = [e for f in run_episode_files(run) for e in read_episodes(f)]
    marked = [e for e in episodes if e["end_reason"] == "env_error"]
    assert marked and all(("timeout" if fault == "hang" else "simulated engine failure") in e["error"] for e in marked)
