"""Real Ray actors and a real DeepSpeed (CPU, gloo) trainer for two OPD steps.

Nothing is faked: the TeacherWorker, RolloutWorker and StudentTrainer are Ray actors on a local
Ray bound to loopback; the models are tiny Qwen3s bootstrapped here; the environment is
gymnasium's FrozenLake engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from opd.config import load_config

pytestmark = pytest.mark.integration
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    ray.shutdown()


def _cfg(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", f"student.bootstrap.cache_dir={tmp_path.parent / 'cache'}",
                              f"teacher.bootstrap.cache_dir={tmp_path.parent / 'cache'}", *overrides])


def _paths(cfg):
    from opd.bootstrap import resolve_model_path

    return (resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, print),
            resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print))


def test_two_steps_through_ray_and_deepspeed(tmp_path, ray_session):
    import ray

    from opd.algorithms import step, vanilla_opd
    from opd.algorithms.base import RunContext
    from opd.chat import ChatFormat
    from opd.envs import EnvFactory
    from opd.generation.hf import HFEngine
    from opd.losses import combined_loss
    from opd.models import load_model, load_tokenizer
    from opd.rollout.vanilla import EpisodeSettings, run_episodes
    from opd.runtime.actors import spawn_workers
    from opd.runtime.cluster import init_ray
    from opd.supervision.teacher_view import score_trajectories
    from opd.training.trainer import token_logprobs

    cfg = _cfg(tmp_path)
    student_path, teacher_path = _paths(cfg)
    tokenizer = load_tokenizer(student_path)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    factory = EnvFactory(cfg.env.id, dict(cfg.env.kwargs))
    train_tasks = factory().unwrapped.task_ids("train")
    settings = EpisodeSettings(max_new_tokens=cfg.rollout.max_new_tokens)
    init_ray(cfg.resources)
    workers = spawn_workers(cfg, student_path, teacher_path)
    ctx = RunContext(cfg, workers, factory, train_tasks, [], settings, settings, fmt)

    first = vanilla_opd.train_step(ctx, 1)
    second = vanilla_opd.train_step(ctx, 2)

    # Reference for step 1, computed in this process with no Ray and no DeepSpeed.
    tasks = step.sample_tasks(train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, 1)
    trajs = run_episodes(HFEngine.from_pretrained(student_path), factory, tasks, tokenizer, fmt, settings, cfg.run.seed * 100003 + 1)
    scores = score_trajectories(HFEngine.from_pretrained(teacher_path), trajs, "state_grounded", fmt)
    batch = step.build_token_batch(trajs, scores, fmt.pad_id, fmt)
    model = load_model(student_path)
    # The trainer splits the batch into two micro-batches normalised by the whole batch's token
    # count, so its loss is the whole batch's token mean.
    with torch.no_grad():
        expected = combined_loss(batch.with_student(token_logprobs(model, batch)), [("reverse_kl", 1.0, {})])[0].item()
    for metrics in (first, second):
        assert math.isfinite(metrics["loss"]) and metrics["nonfinite_loss"] == 0.0
        assert metrics["time/weight_sync_s"] > 0
    assert first["loss"] == pytest.approx(expected, abs=1e-4)
    assert first["reverse_kl_per_token"] > 0  # a random-move student disagrees with the expert teacher
    assert second["loss"] != first["loss"]

    # Every listening socket of the run (Ray's processes, the three actors, DeepSpeed's gloo
    # group, the environment children) is on loopback.
    from opd.runtime.cluster import listening_sockets

    sockets = listening_sockets()
    names = {name for _, name, _ in sockets}
    assert {"gcs_server", "raylet"} <= names and any("StudentTrainer" in n for n in names), sockets
    assert all(address.startswith(("127.0.0.1:", "::ffff:127.0.0.1:", "::1:")) for _, _, address in sockets), sockets

    # After the sync the rollout engine holds exactly the trainer's weights, and they moved.
    trained = ray.get(workers.trainer.export_weights.remote())
    served = ray.get(workers.rollout.state_dict.remote())
    assert trained.keys() == served.keys()
    assert all(torch.equal(trained[k], served[k]) for k in trained)
    initial = load_model(student_path).state_dict()
    assert max((trained[k] - initial[k]).abs().max().item() for k in initial) > 1e-4


def test_cli_run_directory_resume_and_nan_stop(tmp_path, ray_session, capsys):
    from opd.cli import main

    from opd.evaluation.trajectories import read_episodes

    cfg_args = [f"run.output_dir={tmp_path / 'run'}", "run.trajectory_every_steps=1", "run.trajectory_episodes=2",
                f"student.bootstrap.cache_dir={tmp_path.parent / 'cache'}",
                f"teacher.bootstrap.cache_dir={tmp_path.parent / 'cache'}"]
    assert main(["train", str(TINY), *cfg_args]) == 0
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("loss", "reverse_kl_per_token", "success", "tokens_per_s", "time/generation_s",
                    "time/teacher_scoring_s", "time/training_s", "time/weight_sync_s"):
            assert math.isfinite(r[key]), key
    assert {"eval/teacher_success", "eval/student_success"} <= set(records[0])
    assert (run / "config.yaml").read_text().startswith("name: tiny")
    assert list((run / "tb").glob("events.out.tfevents.*"))
    hf = run / "checkpoints" / "step_2" / "hf"
    assert (hf / "model.safetensors").is_file() and not list(hf.glob("*.bin"))
    assert (run / "checkpoints" / "step_2" / "ds").is_dir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["student_success_after"] is not None
    assert (run / "report.png").stat().st_size > 1000
    episodes = read_episodes(run / "trajectories" / "eval_student_step_2.parquet")
    assert len(episodes) == 4 and all(e["turns"] and "observation" in e["turns"][0] for e in episodes)
    assert all(e["kind"] == "eval/student" and e["step"] == 2 for e in episodes)
    turn = episodes[0]["turns"][0]
    assert len(turn["response_ids"]) == len(turn["response_tokens"]) == len(turn["behaviour_logprobs"]) > 0
    assert turn["teacher_logprobs"] == [] and episodes[0]["task_prompt"]
    assert (run / "trajectories" / "eval_teacher_step_0.parquet").is_file()
    # A training sample every step (the recipe's trajectory_every_steps=1), with the teacher's
    # logprob of every response token: the rows a report's viewer colours.
    sample = read_episodes(run / "trajectories" / "train_step_2.parquet")
    assert len(sample) == 2 and all(e["kind"] == "train" for e in sample)
    for turn in (t for e in sample for t in e["turns"]):
        assert len(turn["teacher_logprobs"]) == len(turn["response_ids"]) == len(turn["behaviour_logprobs"])
        assert all(x <= 0.0 for x in turn["teacher_logprobs"] + turn["behaviour_logprobs"])
    assert all(0.0 <= r["time/trajectory_write_s"] < r["time/step_s"] for r in records if "time/step_s" in r)
    # opd eval of the run's newest checkpoint (verified, then loaded from its hf/ export) and of a missing step.
    capsys.readouterr()
    assert main(["eval", str(run), "--samples", "2", "--tasks", "2", "--budgets", "1"]) == 0
    result = json.loads((run / "eval" / "step_2.json").read_text())
    assert result["model"] == str(run / "checkpoints" / "step_2" / "hf") and len(result["pass_at_k"]) == 2
    assert main(["eval", f"{run}@7"]) == 2
    assert "has no complete checkpoint of step 7 (it has steps 1, 2; 0 is the starting student)" in capsys.readouterr().out

    # Refuses to clobber, then resumes from step 2 to step 3 with no duplicated lines.
    assert main(["train", str(TINY), *cfg_args, "run.total_steps=3"]) == 2
    assert "pass --resume" in capsys.readouterr().out
    assert main(["train", str(TINY), *cfg_args, "run.total_steps=3", "--resume"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "time/step_s" in r] == [1, 2, 3]

    # A loss that is always NaN stops the run after 2 steps with a clear message; weights intact.
    nan_args = [f"run.output_dir={tmp_path / 'nan'}", *cfg_args[1:], "losses.0.name=tests.integration.nan_loss.nan_loss",
                "trainer.max_nonfinite_steps=2", "run.save_every_steps=0"]
    assert main(["train", str(TINY), *nan_args]) == 2
    out = capsys.readouterr().out
    assert "NaN or infinite for 2 steps in a row" in out and "Lower trainer.learning_rate" in out


class _Exploit:
    """Unpickling this runs ``touch``: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_resume_verifies_checkpoints_and_refuses_what_it_cannot_trust(tmp_path, ray_session, capsys):
    """The corruption table: a changed recipe is refused, a truncated checkpoint is skipped for
    the older one, a crafted pickle (with a forged manifest) is refused without running."""
    from opd.cli import main
    from opd.training.checkpoint import MARKER, file_manifest

    args = [f"run.output_dir={tmp_path / 'run'}", f"student.bootstrap.cache_dir={tmp_path.parent / 'cache'}",
            f"teacher.bootstrap.cache_dir={tmp_path.parent / 'cache'}"]
    run = tmp_path / "run"
    assert main(["train", str(TINY), *args]) == 0
    capsys.readouterr()

    assert main(["train", str(TINY), *args, "trainer.learning_rate=2e-3", "--resume"]) == 2
    out = capsys.readouterr().out
    assert "differs from the one" in out and "trainer.learning_rate: 0.001 -> 0.002" in out
    assert "Traceback" not in out and "resume with" not in out  # the same command would fail again

    states = run / "checkpoints" / "step_2" / "ds" / "state" / "mp_rank_00_model_states.pt"
    with open(states, "r+b") as f:
        f.truncate(states.stat().st_size // 2)
    assert main(["train", str(TINY), *args, "run.total_steps=3", "--resume"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "skipped checkpoint step_2" in out and "were written (truncated or replaced)" in out
    assert "resumed from" in out and "(step 1)" in out
    assert (run / "checkpoints" / "rejected-step_2").is_dir()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "time/step_s" in line]
    assert steps == [1, 2, 3]

    newest = run / "checkpoints" / "step_3"
    exploited = tmp_path / "exploited"
    torch.save({"module": _Exploit(exploited)}, newest / "ds" / "state" / "mp_rank_00_model_states.pt")
    marker = json.loads((newest / MARKER).read_text())
    marker["files"] = file_manifest(newest)  # the attacker forges the manifest too
    (newest / MARKER).write_text(json.dumps(marker))
    assert main(["train", str(TINY), *args, "run.total_steps=4", "--resume"]) == 2
    out = capsys.readouterr().out
    assert "was refused" in out and "names posix.system" in out and "Traceback" not in out
    assert "resume with" not in out
    assert not exploited.exists()


def test_a_failure_inside_an_actor_is_one_message_with_the_way_back(tmp_path, ray_session, capsys):
    """A user's loss raising at step 3: the console gets the role, the cause (unwrapped from
    Ray's error), the last complete checkpoint and the resume command; the traceback goes to
    ``error.log``."""
    from opd.cli import main

    args = [f"run.output_dir={tmp_path / 'run'}", f"student.bootstrap.cache_dir={tmp_path.parent / 'cache'}",
            f"teacher.bootstrap.cache_dir={tmp_path.parent / 'cache'}",
            "losses.0.name=tests.integration.nan_loss.fails_on_fifth_call", "run.total_steps=3"]
    assert main(["train", str(TINY), *args]) == 1
    out = " ".join(capsys.readouterr().out.split())
    # The loss is named, with the line of the user's code that raised.
    assert ("error: the trainer failed in train_step: LossError: loss 'tests.integration.nan_loss.fails_on_fifth_call' "
            "raised RuntimeError: boom: this loss has a bug at ") in out
    assert 'nan_loss.py:17 (raise RuntimeError("boom: this loss has a bug"))' in out
    assert "during training step 3" in out
    assert f"last complete checkpoint: {tmp_path / 'run' / 'checkpoints' / 'step_2'}" in out
    assert f"resume with: opd train {TINY} {' '.join(args)} --resume" in out
    assert "Traceback" not in out
    log = (tmp_path / "run" / "error.log").read_text()
    assert "Traceback" in log and "fails_on_fifth_call" in log and "-- inside the trainer --" in log


def _sleep(host, seconds):
    import time

    time.sleep(seconds)


def _divide(host, x):
    return 1 / x


def _peer_lost(host):
    raise RuntimeError("[/gloo/pair.cc:537] Read error [127.0.0.1]:62599: Connection reset by peer")


def _die_after(host, seconds):
    import os
    import time

    time.sleep(seconds)
    os._exit(3)


def _die(host):
    import os

    os._exit(3)


def test_a_hung_raising_or_dead_actor_becomes_a_worker_error_naming_its_role(ray_session):
    import time
    from types import SimpleNamespace

    import ray

    from opd.runtime.actors import RayWorkers
    from opd.runtime.cluster import init_ray
    from opd.runtime.errors import WorkerError

    init_ray(SimpleNamespace(num_cpus=2))

    class Host:
        def run(self, fn, *args):
            return fn(self, *args)

    actor = ray.remote(Host).options(num_cpus=0).remote()
    workers = RayWorkers(teachers=[actor], rollouts=[actor], trainers=[actor], timeout_s=120.0)
    assert workers.run("student", _divide, 4) == 0.25  # the actor is up
    workers.timeout_s = 3.0

    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"the rollout did not finish _sleep within 3 s \(resources.actor_timeout_s\)"):
        workers.run("student", _sleep, 600)
    assert time.perf_counter() - start < 30

    actor = ray.remote(Host).options(num_cpus=0).remote()
    workers = RayWorkers(teachers=[actor], rollouts=[actor], trainers=[actor], timeout_s=30.0)
    with pytest.raises(WorkerError, match="the teacher failed in _divide: ZeroDivisionError: division by zero") as info:
        workers.run("teacher", _divide, 0)
    assert info.value.role == "teacher" and isinstance(info.value.cause, ZeroDivisionError)
    assert "in _divide" in info.value.detail and "\x1b[" not in info.value.detail
    with pytest.raises(WorkerError, match="the teacher actor died during _die") as info:
        workers.run("teacher", _die)
    assert info.value.cause is None

    # A group call in which one rank dies and the other's collective fails because of it (first
    # in the list, its error comes back first): the death is reported, so the run restarts.
    ranks = [ray.remote(Host).options(num_cpus=0).remote() for _ in range(2)]
    workers = RayWorkers(teachers=ranks, rollouts=ranks, trainers=ranks, timeout_s=30.0)
    refs = [ranks[0].run.remote(_peer_lost), ranks[1].run.remote(_die_after, 1.0)]
    with pytest.raises(WorkerError, match="the trainer actor died during save_checkpoint") as info:
        workers._await(refs, "trainer", "save_checkpoint")
    assert info.value.kind == "died"
    # Without a death beside it, the same error is the rank's own.
    ranks = [ray.remote(Host).options(num_cpus=0).remote() for _ in range(2)]
    refs = [ranks[0].run.remote(_peer_lost), ranks[1].run.remote(_divide, 2)]
    with pytest.raises(WorkerError, match=r"failed in save_checkpoint: RuntimeError: \[/gloo/pair.cc:537\]") as info:
        workers._await(refs, "trainer", "save_checkpoint")
    assert info.value.kind == "raised"
