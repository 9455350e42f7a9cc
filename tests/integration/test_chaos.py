"""A seeded chaos run (issue 51): the tiny recipe with two ZeRO-3 trainer ranks, two rollout and
two teacher replicas for 20 steps, while ``OPD_CHAOS`` kills eight processes at moments drawn
from its seed: an environment process during a rollout, a teacher while it scores, a trainer
rank while it trains, saves a checkpoint or loads one after a restart, a rollout replica or a
trainer rank during a weight sync (:mod:`opd.runtime.chaos`).

The runs are the real ``opd train`` (Ray, DeepSpeed over gloo, the environment pool) and the
kills real SIGKILLs. The run must end as one that met no fault: every step logged once, the
final checkpoint verifying, and every logged value equal to the unbroken run's (the fault
counters ``env_restarts``/``env_replays`` aside). ``bench/chaos.py`` runs longer schedules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd.runtime.chaos import markdown, parse, report, schedule

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
STEPS, SAVE_EVERY, SEED, FAULTS = 20, 4, 1, 8
CLUSTER = ("resources.trainer_ranks=2", "resources.trainer_cpus=0.5", "trainer.zero_stage=3",
           "resources.teacher_replicas=2", "resources.rollout_replicas=2", "resources.teacher_cpus=0.25",
           "resources.rollout_cpus=0.25")


def _train(run_dir: Path, cache: Path, chaos: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPD_CHAOS"} | ({"OPD_CHAOS": chaos} if chaos else {})
    return subprocess.run(
        [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run_dir}", f"run.total_steps={STEPS}",
         f"run.save_every_steps={SAVE_EVERY}", "run.keep_checkpoints=2", "run.max_restarts=20",
         f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}", *CLUSTER],
        cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=1500)


def test_the_schedule_is_drawn_from_the_seed_and_covers_every_call():
    faults = schedule(SEED, FAULTS, STEPS, SAVE_EVERY)
    assert faults == schedule(SEED, FAULTS, STEPS, SAVE_EVERY) and faults != schedule(SEED + 1, FAULTS, STEPS, SAVE_EVERY)
    assert {(f.call, f.target) for f in faults} == {
        ("collect", "rollout"), ("collect", "env"), ("score", "teacher"), ("train_step", "trainer"),
        ("update_weights", "rollout"), ("update_weights", "trainer"), ("save_checkpoint", "trainer"),
        ("load_checkpoint", "trainer")}
    assert len({(f.call, f.occurrence) for f in faults}) == FAULTS  # never two on one wait
    saves = [f.occurrence for f in faults if f.call == "save_checkpoint"]
    assert all(1 <= n <= STEPS // SAVE_EVERY for n in saves)


def test_a_bad_opd_chaos_or_a_run_without_ray_is_refused_naming_it(monkeypatch, tmp_path):
    from opd.config import ConfigError, load_config
    from opd.runtime.driver import _chaos

    assert parse("seed=3,faults=12") == (3, 12) and parse("") == (0, 6)
    cfg = load_config(str(TINY), [f"run.output_dir={tmp_path / 'run'}"])
    monkeypatch.setenv("OPD_CHAOS", "seed=three")
    with pytest.raises(ConfigError, match="OPD_CHAOS='seed=three': expected 'seed=S,faults=F'.*unset OPD_CHAOS"):
        _chaos(cfg, print)
    monkeypatch.setenv("OPD_CHAOS", "seed=1")
    with pytest.raises(ConfigError, match="needs run.backend: ray .*'local'"):
        _chaos(load_config(str(TINY), [f"run.output_dir={tmp_path / 'run'}", "run.backend=local"]), print)
    monkeypatch.delenv("OPD_CHAOS")
    assert _chaos(cfg, print) is None  # nothing injected unless asked


def test_a_run_whose_processes_are_killed_at_random_ends_as_if_nothing_happened(tmp_path):
    cache = tmp_path / "cache"
    whole = _train(tmp_path / "whole", cache)
    assert whole.returncode == 0, (whole.stdout + whole.stderr)[-3000:]
    chaotic = _train(tmp_path / "chaos", cache, f"seed={SEED},faults={FAULTS}")
    assert chaotic.returncode == 0, (chaotic.stdout + chaotic.stderr)[-3000:]

    result = report(tmp_path / "chaos", tmp_path / "whole")
    print(markdown(result))  # the table of faults, with -s
    faults = [json.loads(line) for line in (tmp_path / "chaos" / "chaos.jsonl").read_text().splitlines()]
    assert len(faults) == FAULTS  # each fired, or recorded as missed or unreached at the end
    fired = [f for f in faults if f["landed"] in ("during", "after")]
    # an environment process may not exist yet when its fault is due; a load may come fewer times than drawn
    assert len(fired) >= FAULTS - 2, faults
    assert {f["call"] for f in fired} >= {"score", "train_step", "update_weights", "save_checkpoint"}
    assert any(f["call"] == "save_checkpoint" and f["landed"] == "during" for f in fired), faults
    actors_killed = sum(f["target"] != "env" for f in fired)
    assert 1 <= result["restarts"] <= actors_killed  # two kills before one restart count once
    assert " ".join(chaotic.stdout.split()).count("restarting every role from") == result["restarts"]
    for f in fired:
        if f["target"] == "env" and f["landed"] == "during":
            assert f["outcome"] == "replayed", f  # the episode went on in a fresh process

    assert result["steps"] == STEPS and result["steps_logged"] == list(range(1, STEPS + 1))
    assert result["steps_logged_twice"] == []
    assert result["final_checkpoint"] == f"step_{STEPS}" and result["final_checkpoint_verifies"]
    assert result["differences"] == [], result["differences"][:10]
    assert not list((tmp_path / "chaos" / "checkpoints").glob(".partial-*"))  # no half-written checkpoint left
