"""PivotOPD ablation: GRPO, GRPO + preventive, and full PivotOPD, same updates, same models.

Each variant and seed is one ``opd train`` of ``recipes/pivot_frozenlake.yaml`` in its own
process (its own Ray), differing only in the overrides below; the teacher and the student are
the same bootstrapped models in every run (their seeds are pinned in the recipe), and a seed
changes the tasks and the sampling only. Writes ``results.json`` and ``results.md`` (held-out
success per variant and seed, and the pivot statistics) under ``--out``.

    .venv/bin/python bench/pivot_ablation.py --steps 60 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pivot_frozenlake.yaml"
VARIANTS = {
    "GRPO": ["algorithm=grpo", "losses=[{name: ppo_clip}]"],
    "GRPO + preventive": ["losses=[{name: ppo_clip}, {name: pivot_preventive, weight: 1.0}]"],
    "PivotOPD": [],  # the recipe: ppo_clip + pivot_preventive + pivot_recovery
}
PIVOT_KEYS = ("pivot/failures", "pivot/judged", "pivot/found_rate", "pivot/mean_turn", "pivot/expert_agreement",
              "pivot/judge_parse_failure_rate", "pivot/recovery_rows", "pivot/hint_followed")


def run(variant: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{variant.replace(' ', '').replace('+', '_')}-seed{seed}"
    if (run_dir / "summary.json").is_file():  # finished earlier: reuse (delete the directory to rerun)
        return _read(variant, seed, run_dir)
    cmd = [str(ROOT / ".venv" / "bin" / "opd"), "train", str(RECIPE), f"run.output_dir={run_dir}", f"run.seed={seed}",
           f"run.total_steps={steps}", *VARIANTS[variant], *extra]
    print(f"[{time.strftime('%H:%M:%S')}] {variant}, seed {seed}: {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / f"{run_dir.name}.log").write_text(done.stdout)
    if done.returncode != 0:
        sys.exit(f"{variant}, seed {seed} failed (exit {done.returncode}); see {out / (run_dir.name + '.log')}")
    print(f"    done in {time.perf_counter() - start:.0f}s", flush=True)
    return _read(variant, seed, run_dir)


def _read(variant: str, seed: int, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in r]
    pivot = {k: statistics.fmean(r[k] for r in steps) for k in PIVOT_KEYS if steps and k in steps[0]}
    if "pivot/failures" in pivot:
        pivot.setdefault("pivot/judged", 0.0)  # runs logged before that metric existed asked no judge
    return {"variant": variant, "seed": seed, "before": summary["student_success_before"],
            "after": summary["student_success_after"], "teacher": summary["teacher_success"],
            "train_time_s": summary["train_time_s"], "train_success_last10": statistics.fmean(r["success"] for r in steps[-10:]),
            **pivot}


def table(results: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in results})
    lines = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | train success (last 10 steps) | time/run |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for variant in VARIANTS:
        rows = [r for r in results if r["variant"] == variant]
        if not rows:
            continue
        by_seed = {r["seed"]: r["after"] for r in rows}
        lines.append(f"| {variant} | " + " | ".join(f"{by_seed[s]:.2f}" if s in by_seed else "" for s in seeds)
                     + f" | **{statistics.fmean(by_seed.values()):.3f}** | {statistics.fmean(r['train_success_last10'] for r in rows):.3f}"
                     + f" | {statistics.fmean(r['train_time_s'] for r in rows):.0f}s |")
    first = results[0]
    lines += ["", f"Held-out greedy success before training: {first['before']:.2f}; teacher: {first['teacher']:.2f}.", "",
              "| variant | failures/step | pivot found | mean pivot turn | agreement with expert | judge parse failures | recovery rows/step | self-teacher followed hint |",
              "|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        rows = [r for r in results if r["variant"] == variant and "pivot/failures" in r]
        if rows:
            mean = {k: statistics.fmean(r[k] for r in rows) for k in PIVOT_KEYS}
            judged = any(r.get("pivot/judged", 0) > 0 for r in rows)
            parse = f"{mean['pivot/judge_parse_failure_rate']:.2f}" if judged else "n/a (no judge)"
            lines.append(f"| {variant} | {mean['pivot/failures']:.1f} | {mean['pivot/found_rate']:.2f} | {mean['pivot/mean_turn']:.2f} | "
                         f"{mean['pivot/expert_agreement']:.2f} | {parse} | "
                         f"{mean['pivot/recovery_rows']:.1f} | {mean['pivot/hint_followed']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pivot_ablation")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run(v, s, args.steps, args.out, args.overrides) for s in args.seeds for v in args.variants]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
