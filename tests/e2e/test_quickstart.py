"""The quickstart recipe end to end, as a user runs it (the real ``opd`` command), with a
smaller step budget: it must learn.

Like the quickstart, it runs on the teacher and student shipped with opd
(``opd/bootstrap/shipped_models``); with ``OPD_E2E_BUILD=1`` it builds them into the user cache
instead (``~/.cache/opd/bootstrap``, content-addressed: about 4 minutes on 2 cores the first time,
then reused; ``OPD_E2E_CACHE`` points it elsewhere). It is marked ``e2e``; ``scripts/test.sh``
runs it like every other test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = int(os.environ.get("OPD_E2E_STEPS", "60"))


def test_quickstart_learns(tmp_path):
    cache = os.environ.get("OPD_E2E_CACHE", "~/.cache/opd/bootstrap")
    run_dir = tmp_path / "quickstart"
    cmd = [sys.executable, "-m", "opd.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"),
           f"run.total_steps={STEPS}", f"run.output_dir={run_dir}", "run.eval_every_steps=0",
           f"run.save_every_steps={STEPS}", f"teacher.bootstrap.cache_dir={cache}", f"student.bootstrap.cache_dir={cache}"]
    if os.environ.get("OPD_E2E_BUILD") == "1":
        cmd += ["teacher.bootstrap.shipped=false", "student.bootstrap.shipped=false"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(json.dumps(summary, indent=2))
    assert summary["steps"] == STEPS
    # The shipped teacher wins 95% of the 100 held-out maps, the student starts at 39% (built here
    # from an empty cache instead, 75-95% on other machines); what the test needs is room above
    # the student's start to learn into.
    assert summary["teacher_success"] >= summary["student_success_before"] + 0.25, \
        f"the bootstrapped teacher must be far better than the starting student: {summary}"
    gain = summary["student_success_after"] - summary["student_success_before"]
    assert gain >= 0.15, f"the student should learn from the teacher: {summary}"
    assert "opd summary" in done.stdout and "student after" in done.stdout
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "time/step_s" in line]
    first, last = steps[:10], steps[-10:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "reverse_kl_per_token") < mean(first, "reverse_kl_per_token")
