"""``ray job submit -- opd train ...`` against a head started with ``ray start --head`` on
loopback (token authentication on, the dashboard and job server bound to 127.0.0.1): the job runs
the recipe to completion on the cluster, its logs and exit status come back to the submitting
shell, and the run directory is where the recipe put it. A job that fails comes back failed,
with opd's message. Needs the ``cluster`` extra (``ray[default]``: the dashboard and job server).
"""

from __future__ import annotations

import json
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
