"""The driver's peak memory per step, with the teacher's scores passed actor to actor (now) and
through the driver (before).

Before, the driver fetched the teacher's scores (``ray.get``), built the batch and sent it to
the trainer: with ``scoring: full`` on a real vocabulary that is ``[N, V]`` floats a step in the
driver, twice over (the scores and the batch). Now the teacher's answer stays in the object
store and the trainer fetches it and builds the batch; the driver keeps the trajectories and
each token's teacher logprob. Both runs are the same recipe on the Ray backend, one after the
other; ``memory/driver_peak_rss_mb`` is the driver's peak resident memory within each step (Linux
``VmHWM``, reset at the step's start).

Usage:
    .venv/bin/python bench/driver_memory.py --out runs/bench_driver_memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from vs_trl import REAL_VOCAB_OVERRIDES  # noqa: E402

RUNNER = ("import sys, opd.algorithms.vanilla_opd as v; v.BUILD_NEXT_TO_TRAINER = {now}; "
          "from opd.cli import main; sys.exit(main(sys.argv[1:]))")


def run(recipe: str, out: Path, now: bool, steps: int, overrides: list[str]) -> list[dict]:
    run_dir = out / ("now" if now else "before")
    command = [sys.executable, "-c", RUNNER.format(now=now), "train", recipe, f"run.output_dir={run_dir}",
               f"run.total_steps={steps}", "run.eval_every_steps=0", "run.eval_episodes=4", "run.save_every_steps=0",
               *REAL_VOCAB_OVERRIDES, *overrides]
    print(f"{'now' if now else 'before'}: {' '.join(command[3:])}", flush=True)
    done = subprocess.run(command, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    (out / f"{run_dir.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the {run_dir.name} run failed; see {out / (run_dir.name + '.log')}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "prompt_dataset.yaml"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="runs/bench_driver_memory")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe (both runs)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = {}
    for now in (False, True):
        steps = run(args.recipe, out, now, args.steps, args.overrides)[1:]  # step 1 warms up
        table["now" if now else "before"] = {
            "driver_peak_rss_mb_median": statistics.median(r["memory/driver_peak_rss_mb"] for r in steps),
            "driver_peak_rss_mb_max": max(r["memory/driver_peak_rss_mb"] for r in steps),
            "teacher_payload_mb": statistics.median(r["teacher_payload_mb"] for r in steps),
            "step_s_median": statistics.median(r["time/step_s"] for r in steps),
            "loss": [r["loss"] for r in steps],
        }
    before, now = table["before"], table["now"]
    lines = ["| driver | peak RSS in a step (median / max) | teacher payload | step |", "|---|---|---|---|"]
    for name, row in (("before: scores and batch through the driver", before),
                      ("now: teacher -> trainer, actor to actor", now)):
        lines.append(f"| {name} | {row['driver_peak_rss_mb_median']:.0f} / {row['driver_peak_rss_mb_max']:.0f} MiB | "
                     f"{row['teacher_payload_mb']:.1f} MiB | {row['step_s_median']:.2f} s |")
    saved = before["driver_peak_rss_mb_median"] - now["driver_peak_rss_mb_median"]
    lines.append(f"\nThe driver's peak a step is {saved:.0f} MiB lower "
                 f"({now['driver_peak_rss_mb_median'] / before['driver_peak_rss_mb_median']:.2f}x); the losses "
                 f"agree to {max(abs(a - b) for a, b in zip(before['loss'], now['loss'])):.1e}.")
    (out / "driver_memory.json").write_text(json.dumps(table, indent=2))
    (out / "driver_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
