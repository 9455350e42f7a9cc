"""A Ray head started as a user starts one, for the tests that join it: Ray's own
``ray start --head`` on 127.0.0.1 in its own process group, with token authentication on (as
``ray start`` turns it on when a token exists) and its own temporary directory and ``HOME`` (so
the token is the test's, not the user's), optionally with the dashboard and job server bound to
loopback. Everything is removed at the end."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

RAY = Path(sys.executable).with_name("ray")


@dataclass
class Head:
    address: str  # the GCS, 127.0.0.1:PORT (RAY_ADDRESS)
    home: Path  # HOME holding .ray/auth_token
    base: Path  # its temporary directory (Ray's session under base/ray)
    dashboard: str = ""  # http://127.0.0.1:PORT (`ray job submit --address`), when started with it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment as a user's shell with ``HOME=home`` and no Ray setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    return {**env, "HOME": str(home), **extra}


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None:
            raise RuntimeError("ray start --head exited:\n" + log.read_text()[-3000:])
        time.sleep(0.5)
    raise RuntimeError(f"ray start --head did not listen on {port} within {timeout_s:g} s:\n" + log.read_text()[-3000:])


@contextlib.contextmanager
def started_head(dashboard: bool = False, loopback_only: bool = True, node_ip: bool = True) -> Iterator[Head]:
    """``loopback_only``: the head's services kept on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``);
    False is Ray's usual start, on every interface, its node registered under the routable IP.
    ``node_ip``: with ``--node-ip-address=127.0.0.1`` (Ray rewrites it to the routable IP unless
    loopback only)."""
    if not RAY.exists():
        raise RuntimeError(f"{RAY} is missing: Ray's command line comes with the ray package")
    base = Path(tempfile.mkdtemp(prefix="opdh", dir="/tmp"))  # short: Ray's socket paths have a length limit
    home = base / "home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    port, dash_port = free_port(), free_port()
    args = [str(RAY), "start", "--head", *(["--node-ip-address=127.0.0.1"] if node_ip else []), f"--port={port}",
            "--num-cpus=2", f"--temp-dir={base / 'ray'}", "--disable-usage-stats", "--block"]
    args += (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}"]
             if dashboard else ["--include-dashboard=false"])
    log_path = base / "head.log"
    log = open(log_path, "w")
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps the head's services on loopback (see opd.runtime.cluster).
    env = user_env(home, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0") if loopback_only else user_env(home)
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_listening(port, proc, log_path)
        if dashboard:
            _wait_listening(dash_port, proc, log_path)
        if "Token authentication is enabled" not in log_path.read_text():
            raise RuntimeError("ray start --head did not turn token authentication on:\n" + log_path.read_text()[-3000:])
        yield Head(f"127.0.0.1:{port}", home, base, f"http://127.0.0.1:{dash_port}" if dashboard else "")
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
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
