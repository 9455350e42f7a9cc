"""``ray job submit -- opd train ...`` against a head started with ``ray start --head`` on
loopback (token authentication on, the dashboard and job server bound to 127.0.0.1): the job runs
the recipe to completion on the cluster, its logs and exit status come back to the submitting
shell, and the run directory is where the recipe put it. A job that fails comes back failed,
with opd's message. Needs the ``cluster`` extra (``ray[default]``: the dashboard and job server).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.ray_head import RAY, started_head, user_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
OPD = Path(RAY).with_name("opd")


@pytest.fixture(scope="module")
def head():
    pytest.importorskip("aiohttp_cors", reason="the cluster extra (ray[default]) brings Ray's job server")
    with started_head(dashboard=True) as started:
        yield started


def _submit(head, *entrypoint: str) -> subprocess.CompletedProcess:
    # The job CLI is a Ray client: it needs RAY_AUTH_MODE=token to send the token (~/.ray/auth_token).
    return subprocess.run([str(RAY), "job", "submit", "--address", head.dashboard, "--", *entrypoint],
                          env=user_env(head.home, RAY_AUTH_MODE="token"), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900)


def test_ray_job_submit_runs_a_recipe_to_completion(head, tmp_path):
    run_dir = tmp_path / "run"
    done = _submit(head, str(OPD), "train", str(TINY), f"run.output_dir={run_dir}", "run.total_steps=1",
                   f"student.bootstrap.cache_dir={tmp_path / 'cache'}", f"teacher.bootstrap.cache_dir={tmp_path / 'cache'}")
    transcript = done.stdout + done.stderr
    print(transcript[-4000:])
    assert done.returncode == 0, transcript[-4000:]
    assert "succeeded" in transcript and f"Connecting to existing Ray cluster at address: {head.address}" in transcript
    assert "opd summary" in transcript  # opd's own console, streamed back
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and (run_dir / "metrics.jsonl").is_file()


def test_a_failing_job_comes_back_failed_with_opds_message(head, tmp_path):
    missing = tmp_path / "no_such_recipe.yaml"
    done = _submit(head, str(OPD), "train", str(missing))
    transcript = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"error: recipe file not found: {missing}" in transcript
    assert "failed with exit code 2" in transcript


def _job(head, command: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), "job", command, "--address", head.dashboard, *args],
                          env=user_env(head.home, RAY_AUTH_MODE="token"), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)


def test_ray_job_stop_saves_the_step_under_way_and_the_run_resumes(head, tmp_path):
    """``ray job stop`` sends the job's processes SIGTERM and SIGKILL ``RAY_JOB_STOP_WAIT_TIME_S``
    later: with that set above the time a save takes (the runtime environment carries it to the
    job's supervisor), the run saves the step it was in, exits 143 and the job is STOPPED; a
    second job with ``--resume`` trains the remaining steps, each logged once (issue 51)."""
    import time

    run_dir = tmp_path / "run"
    train = [str(OPD), "train", str(TINY), f"run.output_dir={run_dir}", "run.total_steps=40",
             "run.save_every_steps=100", f"student.bootstrap.cache_dir={tmp_path / 'cache'}",
             f"teacher.bootstrap.cache_dir={tmp_path / 'cache'}"]
    wait_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    started = _job(head, "submit", "--no-wait", "--submission-id", "opd-stopped", "--runtime-env-json", wait_env,
                   "--", *train)
    assert started.returncode == 0, started.stdout + started.stderr
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
    while time.monotonic() < deadline and not (metrics.is_file() and '"step": 2,' in metrics.read_text()):
        time.sleep(0.2)
    assert _job(head, "stop", "opd-stopped").returncode == 0
    for _ in range(120):  # `ray job status` says "Job 'opd-stopped' was stopped"
        if "was stopped" in (status := _job(head, "status", "opd-stopped")).stdout + status.stderr:
            break
        time.sleep(1)
    logs = _job(head, "logs", "opd-stopped")
    text = " ".join((logs.stdout + logs.stderr).split())
    assert "was stopped" in status.stdout + status.stderr, text[-3000:]
    assert "preempted: stopped on SIGTERM after" in text and "saved checkpoint" in text, text[-3000:]
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 2 <= saved[0] < 40, saved  # the step it was in when stopped, not a later one

    resumed = _submit(head, *train, "--resume")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    # the job's console colours paths and wraps them anywhere
    squeezed = "".join(re.sub(r"\x1b\[[0-9;]*m", "", resumed.stdout).split())
    assert "resumedfrom" in squeezed and f"checkpoints/step_{saved[0]}(step{saved[0]})" in squeezed
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if "time/step_s" in line]
    assert steps == list(range(1, 41))  # every step once: none lost, none repeated
