"""Two ``opd train`` runs started at once on one machine, each with its own local Ray (issue 51,
item 5): both finish, and neither Ray session logs a port clash. Before, the second session's
dashboard agent (fixed port 52365) and its metrics servers (44227, 44217) failed to bind
(``Errno 98``) and ran without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
SESSIONS = Path("/tmp/ray")


def test_two_runs_at_once_both_finish_without_a_port_clash(tmp_path):
    before = set(SESSIONS.glob("session_2*")) if SESSIONS.is_dir() else set()
    cache = tmp_path.parent / "cache"
    runs = [subprocess.Popen([sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={tmp_path / name}",
                              "run.total_steps=1", f"student.bootstrap.cache_dir={cache}",
                              f"teacher.bootstrap.cache_dir={cache}"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True) for name in ("a", "b")]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    for run, out in zip(runs, outputs):
        assert run.returncode == 0, out[-3000:]
    sessions = sorted(set(SESSIONS.glob("session_2*")) - before)
    assert len(sessions) >= 2, sessions
    for session in sessions:
        clashes = [log.name for log in (session / "logs").glob("*")
                   if log.is_file() and "Errno 98" in log.read_text(errors="replace")]
        assert clashes == [], f"{session.name}: a port already in use in {clashes}"
