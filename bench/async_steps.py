"""The pipelined loop against the serial one: ``run.async_steps`` 1 against 0, same recipe, seeds
and number of updates, on the Ray backend (where the next step's rollout overlaps this step's
scoring and training in another process).

    .venv/bin/python bench/async_steps.py                          # the quickstart, 2 rounds of 20 steps
    .venv/bin/python bench/async_steps.py --recipe recipes/prompt_dataset.yaml --steps 30

The runs alternate (serial, pipelined, serial, pipelined: ABAB), each a fresh run directory with
held-out evaluation off except before and after; the first ``--warmup`` steps of each run are not
counted. Reported, in ``<out>/async_steps.json`` and ``.md``: the median step time of each mode and
their ratio, each mode's median time split (in the pipelined loop ``time/generation_s`` is the wait
for a rollout that was started a step earlier), the staleness logged, and held-out success after
training. What the ratio can be: a step's critical path goes from rollout + scoring + training +
sync to about max(rollout, scoring + training + sync) when the roles have hardware of their own;
on a machine whose cores they share, the overlapped work competes for the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/step_s", "time/generation_s", "time/teacher_scoring_s", "time/training_s", "time/weight_sync_s")


def run(recipe: str, mode: int, run_dir: Path, steps: int, overrides: list[str], console) -> dict:
    """Train ``recipe`` with ``run.async_steps: mode`` for ``steps`` updates in ``run_dir``."""
    import ray

    from opd.config import load_config
    from opd.evaluation.run_dir import RunDir
    from opd.runtime.driver import train

    cfg = load_config(recipe, [f"run.async_steps={mode}", f"run.output_dir={run_dir}", f"run.total_steps={steps}",
                               "run.eval_every_steps=0", f"run.save_every_steps={steps}", *overrides])
    start = time.perf_counter()
    summary = train(cfg, console=console)
    wall = time.perf_counter() - start
    ray.shutdown()  # the next run starts its own actors on a fresh local Ray
    return {"mode": mode, "steps": RunDir(run_dir).steps(), "summary": summary, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=20, help="updates per run")
    parser.add_argument("--rounds", type=int, default=2, help="serial-pipelined pairs, in ABAB order")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not counted")
    parser.add_argument("--out", default="runs/bench_async_steps")
    parser.add_argument("overrides", nargs="*", help="key=value for every run, e.g. rollout.episodes_per_step=64")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    sys.path.insert(0, str(ROOT))
    from rich.console import Console

    from opd.cli import _quiet_libraries

    _quiet_libraries()
    console = Console(highlight=False)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass --out to a new directory")
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for k in range(args.rounds):
        for mode in (0, 1):
            console.print(f"[bold]round {k + 1}/{args.rounds}: run.async_steps={mode}[/]")
            runs[mode].append(run(args.recipe, mode, out / f"async{mode}_{k}", args.steps, args.overrides, console))
    result: dict = {"recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "rounds": args.rounds,
                    "warmup": args.warmup, "load_average": _load()}
    for mode, mode_runs in runs.items():
        counted = [r for run_ in mode_runs for r in run_["steps"][args.warmup:]]
        result[f"async{mode}"] = {
            "median_s": {k: statistics.median(r[k] for r in counted) for k in PHASES if k in counted[0]},
            "staleness": sorted({r.get("rollout/staleness", 0.0) for run_ in mode_runs for r in run_["steps"]}),
            "student_success_after": [run_["summary"]["student_success_after"] for run_ in mode_runs],
            "round_step_medians_s": [statistics.median(r["time/step_s"] for r in run_["steps"][args.warmup:])
                                     for run_ in mode_runs],
        }
    serial, piped = result["async0"]["median_s"], result["async1"]["median_s"]
    result["step_ratio"] = serial["time/step_s"] / piped["time/step_s"]
    result["round_ratios"] = [a / b for a, b in zip(result["async0"]["round_step_medians_s"],
                                                    result["async1"]["round_step_medians_s"])]
    # The serial step's critical path if the rollout overlapped perfectly: its other phases, or the rollout.
    rest = serial["time/step_s"] - serial["time/generation_s"]
    result["ideal_ratio"] = serial["time/step_s"] / max(serial["time/generation_s"], rest)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_steps.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "async_steps.md").write_text(table)
    console.print(table)
    return result


def markdown(result: dict) -> str:
    lines = [f"run.async_steps 0 vs 1: {Path(result['recipe']).name}, {result['rounds']} rounds of {result['steps']} "
             f"steps (ABAB; first {result['warmup']} of each not counted), medians in seconds", "",
             "| run.async_steps | step | waiting for the rollout | teacher scoring | training | weight sync | "
             "staleness | held-out success after |", "|---|---|---|---|---|---|---|---|"]
    for mode in (0, 1):
        m = result[f"async{mode}"]["median_s"]
        lines.append(f"| {mode} | {m['time/step_s']:.2f} | {m['time/generation_s']:.2f} | "
                     f"{m.get('time/teacher_scoring_s', 0):.2f} | {m['time/training_s']:.2f} | "
                     f"{m['time/weight_sync_s']:.3f} | {result[f'async{mode}']['staleness']} | "
                     f"{', '.join(f'{s:.0%}' for s in result[f'async{mode}']['student_success_after'])} |")
    lines += ["", f"Step-time ratio (serial / pipelined): **{result['step_ratio']:.2f}x** (rounds: "
              f"{', '.join(f'{r:.2f}' for r in result['round_ratios'])}); with the rollout fully hidden the serial "
              f"step would be {result['ideal_ratio']:.2f}x shorter. Load average {result['load_average']}."]
    return "\n".join(lines) + "\n"


def _load():
    path = Path("/proc/loadavg")
    return path.read_text().split()[:3] if path.exists() else None


if __name__ == "__main__":
    main()
