"""The Ray backend against the local one on a recipe's step: the fixed cost Ray adds, per phase.

    .venv/bin/python bench/backends.py                                   # the quickstart, 3 rounds of 30 steps
    .venv/bin/python bench/backends.py --recipe recipes/prompt_dataset.yaml --steps 20
    .venv/bin/python bench/backends.py --arms ray local ray:OPD_KEEP_FREED_MEMORY=0   # an arm with its own variables

Each arm is ``opd train RECIPE`` in its own process (``run.backend=ray`` or ``local``, with the
variables an arm names after a colon), the arms alternating A B A B ... for ``--rounds``; no
evaluation between steps, no checkpoint or trajectory file, 8 held-out episodes at the ends. A
step's time is ``time/step_s`` of ``metrics.jsonl`` (rollout, teacher scoring, training and
weight sync); the first ``--warmup`` steps of each run are dropped and the medians pool the rest.
Nothing else should run on the machine: the figures are ratios within one run.

Results: ``<out>/backends.json`` and ``backends.md``. Target (issue 52): the Ray step within
15% of the local one on the quickstart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ("run.eval_every_steps=0", "run.eval_episodes=8", "run.save_every_steps=0", "run.trajectory_every_steps=0")
PHASES = ("generation", "teacher_scoring", "training", "weight_sync")


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """``ray`` or ``local``, then optionally ``:NAME=VALUE,NAME=VALUE`` (the run's extra variables)."""
    backend, _, rest = text.partition(":")
    if backend not in ("ray", "local"):
        raise SystemExit(f"--arms: {text!r} must start with ray or local")
    pairs = [p for p in rest.split(",") if p]
    if any("=" not in p for p in pairs):
        raise SystemExit(f"--arms: {text!r}: variables are NAME=VALUE, comma-separated")
    return backend, dict(p.split("=", 1) for p in pairs)


def run_arm(recipe: str, arm: str, overrides: list[str], steps: int, run_dir: Path) -> list[dict]:
    """One ``opd train`` run of ``arm``; each step's phase times from its ``metrics.jsonl``."""
    backend, extra = parse_arm(arm)
    command = [sys.executable, "-m", "opd.cli", "train", recipe, *OVERRIDES, *overrides, f"run.total_steps={steps}",
               f"run.backend={backend}", f"run.output_dir={run_dir}"]
    env = {**os.environ, **extra, "TOKENIZERS_PARALLELISM": "false"}
    if subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit(f"the {arm} run failed: {' '.join(command)}")
    from opd.evaluation.run_dir import RunDir

    return [{"step_s": r["time/step_s"], **{p: r[f"time/{p}_s"] for p in PHASES}} for r in RunDir(run_dir).steps()]


def summarise(runs: list[list[dict]], warmup: int) -> dict:
    kept = [row for rows in runs for row in rows[warmup:]]
    return {"steps_kept": len(kept), "median_step_s": statistics.median(r["step_s"] for r in kept),
            "round_median_step_s": [statistics.median(r["step_s"] for r in rows[warmup:]) for rows in runs],
            "median_phase_s": {p: statistics.median(r[p] for r in kept) for p in PHASES}}


def markdown(result: dict) -> str:
    summary = result["summary"]

    def base(arm: str) -> dict:  # the local arm with the same variables, else the plain local one
        return summary.get("local" + arm[len(arm.split(":")[0]):]) or summary.get("local") or summary[result["arms"][-1]]

    lines = [f"{Path(result['recipe']).name}: {result['steps']} steps x {result['rounds']} rounds per arm, first "
             f"{result['warmup']} dropped; arms alternate {' '.join(result['arms'])}", "",
             "| arm | median step (s) | vs its local arm | " + " | ".join(PHASES) + " | per round |",
             "|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for arm, row in summary.items():
        lines.append(f"| {arm} | {row['median_step_s']:.3f} | {row['median_step_s'] / base(arm)['median_step_s']:.2f}x | "
                     + " | ".join(f"{row['median_phase_s'][p]:.3f}" for p in PHASES) + " | "
                     + ", ".join(f"{v:.3f}" for v in row["round_median_step_s"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--arms", nargs="+", default=["ray", "local"], help="ray or local[:NAME=VALUE,...]")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every run")
    parser.add_argument("--out", default="runs/bench_backends")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe, given to every arm")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.rounds < 1:
        parser.error("need --steps > --warmup and --rounds >= 1")
    for arm in args.arms:
        parse_arm(arm)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass --out to a new directory")
    out.mkdir(parents=True, exist_ok=True)
    recipe = str(Path(args.recipe).resolve())
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in args.arms}
    for k in range(args.rounds):
        for i, arm in enumerate(args.arms):
            rows = run_arm(recipe, arm, args.overrides, args.steps, out / f"{k}_{i}")
            runs[arm].append(rows)
            print(f"round {k + 1}/{args.rounds}: {arm} median step "
                  f"{statistics.median(r['step_s'] for r in rows[args.warmup:]):.3f}s", flush=True)
    result = {"recipe": recipe, "arms": args.arms, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
              "overrides": args.overrides, "summary": {arm: summarise(r, args.warmup) for arm, r in runs.items()},
              "runs": runs}
    (out / "backends.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "backends.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
