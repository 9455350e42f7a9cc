"""opd.runtime.tracking: what tensorboard, wandb (offline) and MLflow (file store) hold after a run
equals what was logged, step by step; a resumed run continues the same runs; a backend that is
asked for but not installed is a ConfigError before anything is written. Real wandb and MLflow,
no network."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from opd.config import load_config
from opd.runtime.tracking import IDS_FILE, Trackers
from opd.schema import ConfigError

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
RECORDS = {
    1: {"loss": 0.5, "loss/reverse_kl": 0.5, "reverse_kl_per_token": 0.1, "eval/student_success": 0.25,
        "time/step_s": 1.0},
    2: {"loss": 0.25, "reverse_kl_per_token": 0.05, "time/step_s": 1.5, "pass@1": 0.5, "nonfinite_loss": False},
    3: {"loss": float("nan"), "reverse_kl_per_token": float("inf"), "time/step_s": 2, "algorithm": "vanilla_opd"},
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """No network, no login, nothing written outside tmp_path; restored after each test (the
    module sets WANDB_SILENT, WANDB_ERROR_REPORTING and MLFLOW_ALLOW_FILE_STORE itself)."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                       "WANDB_DISABLE_CODE": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
                       "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _cfg(run_dir: Path, *overrides: str):
    return load_config(TINY, [f"run.output_dir={run_dir}", *overrides])


def _wandb_history(sync_dir: Path) -> dict[int, dict]:
    """The history records of an offline run, read from its .wandb log by wandb's own reader."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(sync_dir), "--json"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}


def _same(logged: float, stored) -> bool:
    """wandb's JSON writes NaN and infinity as the strings "NaN" and "Infinity"."""
    stored = float(stored)
    return math.isnan(stored) if math.isnan(logged) else stored == logged


def test_every_backend_holds_what_was_logged_step_by_step(tmp_path, capfd):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "logging.wandb_project=opd-test", "logging.mlflow=true")
    trackers = Trackers(run_dir, cfg, resumed_step=None)
    for step, record in RECORDS.items():
        trackers.log(step, record)
    trackers.close({"steps": 3, "student_success_after": 0.25, "time_split": {"train": 0.5}, "run_dir": str(run_dir)})
    trackers.close()  # twice is harmless

    # The console holds one line per backend, naming where its files are; wandb prints nothing.
    console = capfd.readouterr()
    assert console.err == ""
    lines = console.out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("wandb: offline run") and "wandb sync" in lines[0], lines
    assert lines[1].startswith("mlflow: run") and str(run_dir / "mlruns") in lines[1], lines

    expected = {step: {k: v for k, v in record.items() if type(v) in (int, float)} for step, record in RECORDS.items()}
    ids = json.loads((run_dir / IDS_FILE).read_text())

    (sync_dir,) = (run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}*")
    history = _wandb_history(sync_dir)
    assert sorted(history) == [1, 2, 3]
    for step, values in expected.items():
        assert {k: v for k, v in history[step].items() if not k.startswith("_")}.keys() == values.keys()
        assert all(_same(v, history[step][k]) for k, v in values.items()), (step, history[step])

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    assert run.data.params["algorithm"] == "vanilla_opd" and run.data.params["losses.0.name"] == "reverse_kl"
    assert run.data.params["rollout.episodes_per_step"] == "8"
    # "/" becomes "." (the file store would make "loss" both a file and the folder of
    # "loss/reverse_kl"); characters MLflow refuses become "_".
    names = {"pass@1": "pass_1"}
    for key in {k for values in expected.values() for k in values}:
        name = names.get(key, key.replace("/", "."))
        points = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], name)}
        want = {step: values[key] for step, values in expected.items() if key in values}
        assert points.keys() == want.keys() and all(_same(v, points[s]) for s, v in want.items()), key
    summary = json.loads(Path(client.download_artifacts(ids["mlflow"], "summary.json", str(tmp_path))).read_text())
    assert summary["steps"] == 3

    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert {e.step: e.value for e in events.Scalars("loss")}.keys() == {1, 2, 3}
    assert [e.value for e in events.Scalars("time/step_s")] == [1.0, 1.5, 2.0]


def test_resume_continues_the_same_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "logging.wandb_project=opd-test", "logging.mlflow=true")
    first = Trackers(run_dir, cfg, resumed_step=None, log=lambda line: None)
    first.log(1, {"loss": 1.0})
    first.close(failed=True)
    ids = json.loads((run_dir / IDS_FILE).read_text())

    resumed = Trackers(run_dir, _cfg(run_dir, "logging.wandb_project=opd-test", "logging.mlflow=true",
                                     "run.total_steps=4"), resumed_step=1, log=lambda line: None)
    resumed.log(2, {"loss": 0.5})
    resumed.close()
    assert json.loads((run_dir / IDS_FILE).read_text()) == ids

    # wandb offline writes one directory per start, same run id (a suffix -1 when both started
    # within the same second): `wandb sync` uploads them into one run.
    sync_dirs = sorted((run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}*"))
    assert len(sync_dirs) == 2
    assert {s for d in sync_dirs for s in _wandb_history(d)} == {1, 2}
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "loss")] == [(1, 1.0), (2, 0.5)]
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"

    fresh = Trackers(run_dir, cfg, resumed_step=None, log=lambda line: None)
    fresh.close()
    assert json.loads((run_dir / IDS_FILE).read_text())["mlflow"] != ids["mlflow"]


def test_a_failing_backend_is_switched_off_and_the_others_go_on(tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    lines: list[str] = []
    trackers = Trackers(run_dir, _cfg(run_dir, "logging.wandb_project=opd-test", "logging.mlflow=true"),
                        resumed_step=None, log=lines.append)
    trackers.log(1, {"loss": 1.0})
    shutil.rmtree(run_dir / "mlruns")  # the store vanishes under a running run
    trackers.log(2, {"loss": 0.5})
    trackers.log(3, {"loss": 0.25})
    trackers.close()
    assert len(lines) == 3 and lines[2].startswith("[yellow]mlflow failed at step 2 and is off"), lines
    (sync_dir,) = (run_dir / "wandb").glob("offline-run-*")
    assert {step: item["loss"] for step, item in _wandb_history(sync_dir).items()} == {1: 1.0, 2: 0.5, 3: 0.25}


@pytest.mark.parametrize("key, modules, package", [
    ("logging.wandb_project=opd-test", ["wandb"], "pip install wandb"),
    ("logging.mlflow=true", ["mlflow", "mlflow.tracking"], "pip install mlflow-skinny"),
])
def test_a_backend_not_installed_fails_before_anything_is_written(tmp_path, monkeypatch, key, modules, package):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # what an absent package looks like to import
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as raised:
        Trackers(run_dir, _cfg(run_dir, key), resumed_step=None)
    message = str(raised.value)
    assert key.split("=")[0] in message and package in message and "pip install -e .[tracking]" in message
    assert not run_dir.exists()


def test_tensorboard_alone_needs_neither_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    run_dir = tmp_path / "run"
    trackers = Trackers(run_dir, _cfg(run_dir), resumed_step=None)
    trackers.log(1, {"loss": 0.5, "note": "text is skipped"})
    trackers.close()
    assert (run_dir / "tb").is_dir() and not (run_dir / IDS_FILE).exists() and not (run_dir / "wandb").exists()
