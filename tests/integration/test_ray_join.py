"""Joining a Ray cluster started by hand, as a new user does: ``ray start --head`` on loopback
(token authentication on, as ``ray start`` turns it on when a token exists), then
``RAY_ADDRESS=127.0.0.1:PORT opd train ...`` with no other setting. The run must train on that
cluster; a wrong token or no head must end in a message that says what to do.

The head is Ray's own ``ray start`` in its own process group, with its own temporary directory
and its own ``HOME`` (so the token is this test's, not the user's), removed at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    return {**env, "HOME": str(home), **extra}


@pytest.fixture(scope="module")
def head():
    """``ray start --head`` on 127.0.0.1 with token authentication; yields (address, home)."""
    if not RAY.exists():
        pytest.fail(f"{RAY} is missing: Ray's command line comes with the ray package")
    base = Path(tempfile.mkdtemp(prefix="opdj", dir="/tmp"))  # short: Ray's socket paths have a length limit
    home = base / "home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    port = _free_port()
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps the head's services on loopback (see opd.runtime.cluster).
    env = _env(home, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    log = open(base / "head.log", "w")
    proc = subprocess.Popen([str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--include-dashboard=false", "--num-cpus=2", f"--temp-dir={base / 'ray'}",
                             "--disable-usage-stats", "--block"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, (base / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("ray start --head did not listen within 120 s:\n" + (base / "head.log").read_text()[-3000:])
        assert "Token authentication is enabled" in (base / "head.log").read_text()
        yield address, home, base
    finally:
        with_group = [signal.SIGTERM, signal.SIGKILL]
        for sig in with_group:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=20)
                time.sleep(1)  # the group's other processes leave after `ray start`
            except subprocess.TimeoutExpired:
                continue
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def _train(address: str, home: Path, run_dir: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run_dir}", "run.total_steps=1",
           f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]
    return subprocess.run(cmd, cwd=ROOT, env=_env(home, RAY_ADDRESS=address, **env), capture_output=True, text=True,
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
    nobody = f"127.0.0.1:{_free_port()}"
    missing = _train(nobody, home, tmp_path / "run2", tmp_path / "cache")
    assert missing.returncode == 1
    assert f"could not join the Ray cluster at RAY_ADDRESS={nobody}: nothing accepts connections there" in \
        missing.stdout + missing.stderr
