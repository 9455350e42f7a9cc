"""Several teachers over mixed environments (``teachers:`` and ``env.mix``, docs/teachers.md), run
for real: tiny Qwen3 models (the student and two teachers of different seeds, one tokenizer) on
two FrozenLake families, with DeepSpeed on both backends.

- Each episode is scored by its own environment's teacher, exactly as that teacher alone scores
  it (and not as the other one would).
- The local and the Ray backend (the first teacher on two replicas) train the same steps, the Ray
  run through the restart that follows a teacher actor's death, and it resumes; the figures come
  apart per environment and per teacher.
- Two names of one model load it once; a teacher whose tokenizer differs is refused by
  ``opd check`` and ``opd train``, naming its key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration
ARCH = dict(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """The student (seed 0) and two teachers (seeds 1 and 2), one tokenizer."""
    from opd.models import save_model, tiny_qwen3
    from opd.schema import TinyArchConfig

    root = tmp_path_factory.mktemp("several-teachers")
    out = {}
    for name, seed in (("student", 0), ("one", 1), ("two", 2)):
        save_model(tiny_qwen3(tokenizer, TinyArchConfig(**ARCH), seed=seed), tokenizer, root / name)
        out[name] = str(root / name)
    return out


def _recipe(models: dict, run_dir: Path, **teachers) -> dict:
    return {
        "name": "two-teachers",
        "env": {"mix": [{"name": "lake", "id": "opd/FrozenLakeText-v0", "share": 2, "teacher": "one",
                         "kwargs": {"max_turns": 4, "n_train_tasks": 32, "n_eval_tasks": 6}},
                        {"name": "rough", "id": "opd/FrozenLakeText-v0", "teacher": "two",
                         "kwargs": {"max_turns": 4, "n_train_tasks": 32, "n_eval_tasks": 6, "frozen_prob": 0.7}}]},
        "teachers": {"one": {"path": models["one"], "cpus": 0.25, **teachers.get("one", {})},
                     "two": {"path": models["two"], "cpus": 0.25, **teachers.get("two", {})}},
        "student": {"path": models["student"]},
        "rollout": {"episodes_per_step": 6, "max_new_tokens": 4},
        "trainer": {"learning_rate": 1e-3, "zero_stage": 1, "micro_batch_size": 6},
        "run": {"total_steps": 2, "seed": 0, "eval_episodes": 4, "save_every_steps": 1, "output_dir": str(run_dir),
                "teacher_check": "ignore", "sampling_check": "ignore"},
        "resources": {"num_cpus": 2, "torch_threads": 1, "rollout_cpus": 0.25},
    }


def _load(recipe: dict, path: Path, *overrides: str):
    from opd.config import load_config

    path.write_text(yaml.safe_dump(recipe))
    return load_config(path, list(overrides))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_episode_is_scored_by_its_environments_teacher(models, tmp_path):
    from opd.algorithms.step import step_seed
    from opd.envs import EnvFactory
    from opd.mixture import env_of
    from opd.rollout.vanilla import episode_settings
    from opd.runtime.local import spawn_local_workers
    from opd.runtime.workers import EngineSpec, TeacherSpec, TeacherWorker

    cfg = _load(_recipe(models, tmp_path / "run"), tmp_path / "r.yaml", "run.backend=local")
    workers = spawn_local_workers(cfg, models["student"], {"one": models["one"], "two": models["two"]})
    assert set(workers.teachers) == {"one", "two"}
    factory = EnvFactory.of(cfg.env)
    tasks = factory().unwrapped.task_ids("train")[:6]  # interleaved: lake, rough, lake, ...
    assert [env_of(t) for t in tasks] == ["lake", "rough"] * 3
    trajs, _ = workers.collect("student", factory, tasks, episode_settings(cfg, 1.0), step_seed(cfg, 1))
    scored = workers.score_for_training(trajs, cfg.supervision)
    assert len(scored.whole) == 6  # a run of one teacher per trajectory, the environments alternating
    alone = {name: TeacherWorker(TeacherSpec(EngineSpec(path=models[name], engine="hf", torch_threads=1)))
             for name in ("one", "two")}
    for traj, light in zip(trajs, scored.light):
        own, other = ("one", "two") if env_of(traj.task) == "lake" else ("two", "one")
        assert light.logprobs == alone[own].score([traj], cfg.supervision)[0].logprobs
        assert light.logprobs != alone[other].score([traj], cfg.supervision)[0].logprobs
    played, _ = workers.collect("teacher", factory, tasks[:2], episode_settings(cfg, 0.0), 0)
    lake_alone, _ = alone["one"].collect(factory, tasks[:1], episode_settings(cfg, 0.0), 0)
    rough_alone, _ = alone["two"].collect(factory, tasks[1:2], episode_settings(cfg, 0.0), 0, first_index=1)
    assert [t.turns[0].response_ids for t in played] == [lake_alone[0].turns[0].response_ids,
                                                          rough_alone[0].turns[0].response_ids]

    same = _load(_recipe(models, tmp_path / "run2", two={"path": models["one"]}), tmp_path / "same.yaml",
                 "run.backend=local")
    assert list(spawn_local_workers(same, models["student"], {"one": models["one"]}).teachers) == ["one"]


def test_local_and_ray_train_the_same_mixed_steps_through_a_restart_and_a_resume(models, tmp_path):
    """The local run against a Ray run whose teachers (the first on two replicas) lose an actor
    to SIGKILL once the first checkpoint is complete: the Ray run restarts every group and ends
    with the local run's steps; then it resumes for one more."""
    from opd.cli import main

    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(_recipe(models, local_dir)))
    assert main(["train", str(tmp_path / "local.yaml"), "run.backend=local", "run.total_steps=3"]) == 0
    (tmp_path / "ray.yaml").write_text(yaml.safe_dump(_recipe(models, ray_dir, one={"replicas": 2})))
    killed = _run_killing_a_teacher([sys.executable, "-m", "opd.cli", "train", str(tmp_path / "ray.yaml"),
                                     "run.total_steps=3"], ray_dir)
    assert killed, "no TeacherWorker process was found to kill"

    local, ray = _records(local_dir), _records(ray_dir)
    assert [r["step"] for r in ray] == [r["step"] for r in local]
    for a, b in zip(local, ray):
        keys = {k for k in a if not k.startswith(("time/", "memory/")) and not k.endswith(("_time_s", "_per_s"))}
        assert keys == {k for k in b if not k.startswith(("time/", "memory/")) and not k.endswith(("_time_s", "_per_s"))}
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)
    step0, step1 = ray[0], ray[1]
    for env in ("lake", "rough"):
        for who in ("teacher", "student"):
            assert 0.0 <= step0[f"eval/{env}/{who}_success"] <= 1.0 and f"eval/{env}/{who}_turns" in step0
        assert f"success/{env}" in step1 and f"return/{env}" in step1
    assert step0["eval/teacher_success"] == pytest.approx(
        (step0["eval/lake/teacher_success"] + step0["eval/rough/teacher_success"]) / 2)  # 2 + 2 held-out tasks
    assert set(k for k in step1 if k.startswith("kl/")) == {"kl/one", "kl/two"}
    summary = json.loads((ray_dir / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["by_environment"]["rough"]["teacher_name"] == "two"
    assert {role: len(nodes) for role, nodes in summary["placement"].items()} == \
        {"teacher-one": 2, "teacher-two": 1, "rollout": 1, "trainer": 1}

    assert main(["train", str(tmp_path / "ray.yaml"), "run.total_steps=4", "--resume"]) == 0
    trained = [r for r in _records(ray_dir) if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4] and "kl/two" in trained[-1]


def _run_killing_a_teacher(cmd: list[str], run_dir: Path) -> int:
    """Run ``cmd``; SIGKILL a ``ray::TeacherWorker`` process once checkpoint step_1 is complete.
    Returns the pid killed (0: none)."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    killed = 0
    try:
        deadline = time.monotonic() + 600
        while not killed and time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "step_1" / "COMPLETE").exists():
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if "ray::TeacherWorker" in " ".join(child.cmdline()):
                            os.kill(child.pid, signal.SIGKILL)
                            killed = child.pid
                            break
                    except psutil.Error:
                        continue
            time.sleep(0.1)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return killed


def test_a_teacher_whose_tokenizer_differs_is_refused_by_name(models, tmp_path, capsys):
    from opd.cli import main
    from opd.models import save_model, tiny_qwen3, train_chat_tokenizer
    from opd.schema import TinyArchConfig

    other = train_chat_tokenizer(["left down right up", "an unrelated corpus of words", "Invalid action"],
                                 vocab_size=280)
    save_model(tiny_qwen3(other, TinyArchConfig(**ARCH), seed=3), other, tmp_path / "foreign")
    recipe = _recipe(models, tmp_path / "run", two={"path": str(tmp_path / "foreign")})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["check", str(tmp_path / "r.yaml")]) == 2
    said = " ".join(capsys.readouterr()).split()
    assert "'teachers.two'" in said and "'student'" in said
    assert main(["train", str(tmp_path / "r.yaml"), "run.backend=local"]) == 2
    said = " ".join(" ".join(capsys.readouterr()).split())
    assert "'teachers.two.path'" in said and "supervision.cross_tokenizer" in said
