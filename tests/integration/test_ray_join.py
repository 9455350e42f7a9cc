"""Joining a Ray cluster started by hand, as a new user does: ``ray start --head`` on loopback
(token authentication on, as ``ray start`` turns it on when a token exists), then
``RAY_ADDRESS=127.0.0.1:PORT opd train ...`` with no other setting. The run must train on that
cluster; a wrong token or no head must end in a message that says what to do.

The head is Ray's own ``ray start`` (tests/integration/ray_head.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ray_head import free_port, started_head, user_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


@pytest.fixture(scope="module")
def head():
    with started_head() as started:
        yield started.address, started.home, started.base


def _train(address: str, home: Path, run_dir: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run_dir}", "run.total_steps=1",
           f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]
    return subprocess.run(cmd, cwd=ROOT, env=user_env(home, RAY_ADDRESS=address, **env), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900)


def test_a_run_joins_a_ray_start_head_with_no_auth_setting(head, tmp_path):
    address, home, base = head
    done = _train(address, home, tmp_path / "run", tmp_path / "cache")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "Authentication token is missing" not in output
    assert f"Connecting to existing Ray cluster at address: {address}" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1
    # The actors ran in the head's workers: their logs are in the head's session directory.
    logs = list((base / "ray" / "session_latest" / "logs").glob("worker-*"))
    assert any("StudentTrainer" in p.read_text(errors="replace") for p in logs), [p.name for p in logs]


def test_a_wrong_token_or_no_head_is_named_with_what_to_set(head, tmp_path):
    address, home, _ = head
    wrong = _train(address, home, tmp_path / "run", tmp_path / "cache", RAY_AUTH_TOKEN="0" * 64)
    assert wrong.returncode == 1
    message = wrong.stdout + wrong.stderr
    assert f"could not join the Ray cluster at RAY_ADDRESS={address}" in message
    assert "RAY_AUTH_TOKEN" in message and "head node's token" in message
    nobody = f"127.0.0.1:{free_port()}"
    missing = _train(nobody, home, tmp_path / "run2", tmp_path / "cache")
    assert missing.returncode == 1
    assert f"could not join the Ray cluster at RAY_ADDRESS={nobody}: nothing accepts connections there" in \
        missing.stdout + missing.stderr


@pytest.mark.parametrize("node_ip, dashboard", [(True, False), (False, True)],
                         ids=["node-ip-127.0.0.1", "plain-with-dashboard"])
def test_a_run_joins_a_head_started_the_usual_way(node_ip, dashboard, tmp_path):
    """Issue 51, item 6: ``ray start --head --port P`` as Ray's docs start it (no loopback-only
    switch; with ``--node-ip-address=127.0.0.1``, which Ray rewrites to the routable IP, or
    without, with the dashboard): ``RAY_ADDRESS=127.0.0.1:P opd train`` joins it, as a plain
    ``ray.init`` does. Before, opd joined as a loopback node the head did not know and failed
    after about a minute with "Failed to connect to Ray cluster"."""
    with started_head(dashboard=dashboard, loopback_only=False, node_ip=node_ip) as started:
        done = _train(started.address, started.home, tmp_path / "run", tmp_path / "cache")
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        assert "Connecting to existing Ray cluster at address: " in output
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1
        logs = list((started.base / "ray" / "session_latest" / "logs").glob("worker-*"))
        assert any("StudentTrainer" in p.read_text(errors="replace") for p in logs), [p.name for p in logs]
