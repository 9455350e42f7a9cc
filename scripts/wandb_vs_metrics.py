"""Compare a run's wandb offline history with its metrics.jsonl, scalar by scalar:

    .venv/bin/python scripts/wandb_vs_metrics.py RUN_DIR

for a run trained with logging.wandb_project set (offline mode). Reads wandb's log with its own reader
(`wandb leet inspect --json`)."""

import json
import math
import subprocess
import sys
from pathlib import Path

from opd.evaluation.run_dir import RunDir

run = Path(sys.argv[1])
metrics = {}
for r in RunDir(run).metrics():
    metrics.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
dirs = sorted((run / "wandb").glob("offline-run-*"))
print("wandb offline dirs:", *[str(d) for d in dirs])
history = {}
for d in dirs:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(d), "--json"], capture_output=True,
                         text=True, check=True).stdout
    for rec in (json.loads(l) for l in out.splitlines() if l.strip()):
        if rec["type"] == "history":
            step = int(rec["history"]["step"]["num"])
            history.setdefault(step, {}).update(rec["history"]["item"])
compared = mismatched = 0
for step, rec in metrics.items():
    for k, v in rec.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            got = history.get(step, {}).get(k)
            compared += 1
            if got is None or not (float(got) == float(v) or (math.isnan(v) and str(got) == "NaN")):
                mismatched += 1
                print("MISMATCH", step, k, v, got)
print(f"steps in metrics.jsonl: {sorted(metrics)}; steps in wandb: {sorted(history)}")
print(f"scalars compared: {compared}, mismatched: {mismatched}")
for step in sorted(history)[:2]:
    print(step, {k: history[step][k] for k in list(history[step])[:6]})
