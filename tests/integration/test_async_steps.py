"""``run.async_steps`` (:class:`opd.algorithms.base.StepRollouts`): the pipelined loop.

Which weights play each step's episodes is the whole contract, so it is checked token by token:
the episodes a run recorded for step k (``trajectories/train_step_k.parquet``) are played again
outside the run, from step k's tasks and seed, by the weights that should have played them. With
``async_steps: 0`` that is the previous step's checkpoint (on-policy, as before the pipelined
loop existed); with ``async_steps: 1`` it is the checkpoint before that (one update stale), and
the staleness logged says so. Step 1 is the same in both modes (nothing was trained yet). The
Ray backend overlaps the next rollout with scoring and training in another process and must
give exactly the local backend's results, which plays it first in this one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


def _args(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [str(TINY), f"run.output_dir={run_dir}", f"student.bootstrap.cache_dir={cache}",
            f"teacher.bootstrap.cache_dir={cache}", "run.total_steps=3", "run.trajectory_every_steps=1",
            "run.trajectory_episodes=8", *extra]


def _train(run_dir: Path, cache: Path, *extra: str) -> Path:
    from opd.cli import main

    assert main(["train", *_args(run_dir, cache, *extra)]) == 0
    return run_dir


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "time/step_s" in r]


def _recorded(run_dir: Path, step: int) -> list[list[list[int]]]:
    """Each recorded episode of step ``step``: its turns' response token ids."""
    import pyarrow.parquet as pq

    rows = pq.read_table(run_dir / "trajectories" / f"train_step_{step}.parquet").to_pylist()
    return [[list(turn["response_ids"]) for turn in row["turns"]] for row in sorted(rows, key=lambda r: r["episode"])]


def _behaviour(run_dir: Path, step: int) -> list[float]:
    """Step ``step``'s recorded behaviour logprobs, flat, in episode order."""
    import pyarrow.parquet as pq

    rows = pq.read_table(run_dir / "trajectories" / f"train_step_{step}.parquet").to_pylist()
    return [lp for row in sorted(rows, key=lambda r: r["episode"]) for turn in row["turns"]
            for lp in turn["behaviour_logprobs"]]


def _replayed(run_dir: Path, weights: str, step: int) -> list[list[list[int]]]:
    """Step ``step``'s tasks played again, with its seed, by the student weights in ``weights``
    (a model directory; "" for the run's initial student)."""
    from opd.algorithms.step import sample_tasks, step_seed
    from opd.config import load_config
    from opd.bootstrap import resolve_model_path
    from opd.envs import EnvFactory
    from opd.rollout.vanilla import episode_settings
    from opd.runtime.workers import RolloutWorker, role_specs

    cfg = load_config(run_dir / "config.yaml")
    student_path = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, lambda _: None)
    worker = RolloutWorker(replace(role_specs(cfg, student_path, student_path).rollout, path=weights or student_path))
    factory = EnvFactory.of(cfg.env)
    probe = factory()
    train_tasks = probe.unwrapped.task_ids(cfg.env.train_split)
    probe.close()
    tasks = sample_tasks(train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, step, cfg.rollout.group_size)
    trajs, _ = worker.collect(factory, tasks, episode_settings(cfg, cfg.rollout.temperature), step_seed(cfg, step))
    return [[list(turn.response_ids) for turn in traj.turns] for traj in trajs]


def _checkpoint(run_dir: Path, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{step}" / "hf")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "cache"  # the bootstrap cache the integration tests share


@pytest.fixture(scope="module")
def serial(tmp_path_factory, cache) -> Path:
    return _train(tmp_path_factory.mktemp("serial") / "run", cache, "run.backend=local")


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, cache) -> Path:
    return _train(tmp_path_factory.mktemp("pipelined") / "run", cache, "run.backend=local", "run.async_steps=1")


def test_async_steps_0_plays_every_step_with_the_weights_of_the_step_before(serial):
    steps = _steps(serial)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert not any("rollout/staleness" in r for r in steps)  # the serial loop logs what it did before
    assert _recorded(serial, 1) == _replayed(serial, "", 1)
    assert _recorded(serial, 2) == _replayed(serial, _checkpoint(serial, 1), 2)
    assert _recorded(serial, 3) == _replayed(serial, _checkpoint(serial, 2), 3)


def test_async_steps_1_plays_each_step_one_update_behind(serial, pipelined):
    steps = _steps(pipelined)
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0]
    assert _recorded(pipelined, 1) == _recorded(serial, 1)
    assert _recorded(pipelined, 2) == _replayed(pipelined, "", 2)  # the initial weights, not step 1's
    assert _recorded(pipelined, 3) == _replayed(pipelined, _checkpoint(pipelined, 1), 3)
    # ... so it is not the serial loop's episode: with per-episode seeds the two may sample the
    # same tokens (the weights moved little), but the behaviour logprobs are the other weights'.
    assert _behaviour(pipelined, 2) != pytest.approx(_behaviour(serial, 2), abs=1e-7)
    # Step 1 trains on the same episodes with the same weights in both modes.
    first, serial_first = steps[0], _steps(serial)[0]
    for key in ("loss", "grad_norm", "success", "train_tokens"):
        assert first[key] == serial_first[key], key
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in steps)


def test_the_ray_backend_overlaps_the_rollout_and_gives_the_same_run(pipelined, tmp_path, cache):
    import ray

    try:
        ray_dir = _train(tmp_path / "run", cache, "run.backend=ray", "run.async_steps=1")
    finally:
        ray.shutdown()
    for a, b in zip(_steps(ray_dir), _steps(pipelined), strict=True):
        for key in sorted(k for k in b if not k.startswith(("time/", "memory/")) and not k.endswith("_per_s")):
            assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (a["step"], key)
    for step in (1, 2, 3):
        assert _recorded(ray_dir, step) == _recorded(pipelined, step)


def test_async_steps_is_refused_for_an_algorithm_that_plays_its_own_way(tmp_path):
    from opd.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'run.async_steps' is 1, but algorithm 'actfirst_opd'.*set it to 0"):
        load_config(ROOT / "recipes" / "actfirst_frozenlake.yaml", ["run.async_steps=1"])


def test_the_driver_says_what_pipelining_does_with_the_recipes_placement():
    from opd.config import load_config
    from opd.runtime.driver import _pipelining_note

    def note(*overrides: str, gpus: float = 0) -> str:
        cfg = load_config(TINY, ["run.async_steps=1", *overrides])
        cfg.resources.rollout_gpus = cfg.resources.trainer_gpus = gpus  # as on a GPU cluster (this machine has none)
        return _pipelining_note(cfg)

    assert "played one after another" in note("run.backend=local")
    assert "sharing the CPU cores" in note() and "resources.torch_threads" in note()
    assert "overlaps" in note(gpus=1)
