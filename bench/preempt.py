"""SIGTERM at random moments (issue 51): a run preempted as a spot instance, an eviction or a
SLURM time limit preempts it, then resumed, against the same run never interrupted.

    .venv/bin/python bench/preempt.py                       # the tiny recipe, 10 trials of 12 steps
    .venv/bin/python bench/preempt.py --trials 20 --steps 20 --seed 3

Each trial starts ``opd train`` with no checkpoint due before the end (``run.save_every_steps``
past the last step), waits for a step drawn from the seed to be logged, waits a further random
fraction of a step, and sends the driver SIGTERM. Recorded per trial: the exit status (143
expected), what the run saved (the step it had finished), how long it took to stop, and after
``opd train --resume``: whether every step is logged once and every logged value equals the
uninterrupted run's (``opd.runtime.chaos.value_differences``: the values that depend neither on timing
nor on faults, relative 1e-6). Written to ``<out>/preempt.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd.runtime.chaos import value_differences  # noqa: E402


def command(recipe: str, run_dir: Path, steps: int, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "opd.cli", "train", recipe, f"run.output_dir={run_dir}", f"run.total_steps={steps}",
            f"run.save_every_steps={steps + 1}", f"student.bootstrap.cache_dir={cache}",
            f"teacher.bootstrap.cache_dir={cache}", *extra]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"time/step_s"' in line]


def trial(k: int, rng: random.Random, args, cache: Path, whole: Path, step_s: float) -> dict:
    run_dir = args.out / f"trial_{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    after = rng.randint(1, args.steps - 2)
    wait = rng.uniform(0.0, 1.0) * step_s
    log = open(args.out / f"trial_{k}.log", "w")
    proc = subprocess.Popen(command(args.recipe, run_dir, args.steps, cache), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    while proc.poll() is None and not any(s >= after for s in logged_steps(run_dir)):
        time.sleep(0.02)
    time.sleep(wait)
    signalled = logged_steps(run_dir)
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    status = proc.wait(timeout=600)
    stop_s = time.monotonic() - start
    log.close()
    text = " ".join((args.out / f"trial_{k}.log").read_text().split())
    saved = re.search(r"saved checkpoint \S+?step_(\d+)", text)
    resumed = subprocess.run(command(args.recipe, run_dir, args.steps, cache, "--resume"), cwd=ROOT,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1200)
    steps = logged_steps(run_dir)
    return {"trial": k, "signalled_after_step": max(signalled, default=0), "exit_status": status,
            "saved_step": int(saved.group(1)) if saved else None, "stop_s": round(stop_s, 2),
            "resumed_ok": resumed.returncode == 0, "steps_once": steps == list(range(1, args.steps + 1)),
            "differences": len(value_differences(whole, run_dir)) if resumed.returncode == 0 else None}


def markdown(rows: list[dict], args) -> str:
    lines = [f"SIGTERM at random moments: {args.recipe}, {args.steps} steps, seed {args.seed}", "",
             "| trial | signalled after step | exit status | saved | time to stop | resumed | every step once | "
             "values unlike the uninterrupted run's |", "|---:|---:|---:|---|---:|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['trial']} | {r['signalled_after_step']} | {r['exit_status']} | "
                     f"{'step_' + str(r['saved_step']) if r['saved_step'] is not None else 'nothing'} | {r['stop_s']} s | "
                     f"{'yes' if r['resumed_ok'] else 'NO'} | {'yes' if r['steps_once'] else 'NO'} | {r['differences']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "tests" / "data" / "tiny.yaml"))
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "preempt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "cache"
    whole = args.out / "whole"
    if not (whole / "summary.json").is_file():
        done = subprocess.run(command(args.recipe, whole, args.steps, cache), cwd=ROOT, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=1800)
        if done.returncode != 0:
            print((done.stdout + done.stderr)[-3000:])
            return 1
    step_s = sorted(json.loads(line)["time/step_s"] for line in (whole / "metrics.jsonl").read_text().splitlines()
                    if '"time/step_s"' in line)[args.steps // 2]
    rng = random.Random(args.seed)
    rows = []
    for k in range(args.trials):
        rows.append(trial(k, rng, args, cache, whole, step_s))
        print(rows[-1], flush=True)
    text = markdown(rows, args)
    (args.out / "preempt.json").write_text(json.dumps(rows, indent=2))
    (args.out / "preempt.md").write_text(text + "\n")
    print(text)
    good = all(r["exit_status"] == 143 and r["resumed_ok"] and r["steps_once"] and r["differences"] == 0 for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
