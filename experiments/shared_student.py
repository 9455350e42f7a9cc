"""A shared student, measured (issue 48 item 5; docs/teachers.md, docs/results.md): one student
trained on a mix of environments, each graded by its own teacher, against one student per
environment trained by that environment's teacher alone on the episodes of it the mix gives.

    .venv/bin/python experiments/shared_student.py                       # recipes/studies/shared_student.yaml, seeds 0 1 2
    .venv/bin/python experiments/shared_student.py --seeds 0 --steps 100 # a pilot

The mixed recipe names the environments (``env.mix``), their teachers (``teachers``) and the
student. Its models are built first (or found in the bootstrap cache), then every run gets them
as paths, so the mixed run and the baselines start from one student and grade with the same
teachers. A baseline of environment ``E`` is the recipe with ``E`` alone in its mix, its teacher
alone, ``rollout.episodes_per_step`` (and the micro-batch) the episodes of ``E`` in a mixed step,
the same steps and learning rate, and ``run.eval_episodes`` the held-out tasks of ``E`` among the
mixed run's, the same tasks. Per environment:

- the single lift: the baseline's held-out success after training minus before;
- the mixed lift: the mixed run's success on that environment's tasks after minus before;
- kept: the mixed lift over the single lift (the goal: at least 80% on every environment).

Writes under ``--out`` (default ``runs/shared_student``): a directory per run, ``results.json`` (one
record per run), ``results.md`` (the table, each seed and the mean, and what the runs cost) and
``results.png``. A finished run is reused (delete its directory to rerun it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "studies" / "shared_student.yaml"
OPD = [sys.executable, "-m", "opd.cli"]
GOAL = 0.8  # the share of each single-teacher lift the shared student should keep


def build_models(recipe: Path, overrides: list[str]) -> dict[str, str]:
    """The student's and every teacher's model directory, built here first where they are not
    in the bootstrap cache (the recipe's ``bootstrap`` sections)."""
    from opd.bootstrap import resolve_student_path, resolve_teacher_path
    from opd.config import load_config

    cfg = load_config(recipe, overrides)
    paths = {"student": resolve_student_path(cfg, print)}
    for name in cfg.teachers:
        paths[name] = resolve_teacher_path(cfg, print, name)
    return paths


def mixed_counts(cfg) -> tuple[dict[str, int], dict[str, int]]:
    """Per environment of the mix: its episodes in a step, and its held-out tasks among the
    mixed run's ``run.eval_episodes``."""
    from opd.envs import EnvFactory
    from opd.mixture import env_of, share_counts

    names = [str(e.name) for e in cfg.env.mix]
    per_step = dict(zip(names, share_counts([float(e.share) for e in cfg.env.mix], cfg.rollout.episodes_per_step)))
    env = EnvFactory.of(cfg.env)()
    try:
        held_out = env.unwrapped.task_ids(cfg.env.eval_split)[: cfg.run.eval_episodes]
    finally:
        env.close()
    return per_step, {name: sum(env_of(t) == name for t in held_out) for name in names}


def recipes(recipe: Path, overrides: list[str], models: dict[str, str], out: Path) -> dict[str, Path]:
    """The mixed recipe (resolved, with ``overrides``) and one baseline per environment, written
    under ``out/recipes`` with the built models as paths."""
    from omegaconf import OmegaConf

    from opd.config import load_config

    cfg = load_config(recipe, overrides)
    per_step, held_out = mixed_counts(cfg)
    full = OmegaConf.to_container(cfg, resolve=True)
    full["student"].update(path=models["student"], bootstrap=None)
    for name, section in full["teachers"].items():
        section.update(path=models[name], bootstrap=None)
    (out / "recipes").mkdir(parents=True, exist_ok=True)
    written = {"mixed": out / "recipes" / "mixed.yaml"}
    written["mixed"].write_text(yaml.safe_dump(full, sort_keys=False))
    for entry in full["env"]["mix"]:
        name = entry["name"]
        single = json.loads(json.dumps(full))
        single["name"] = f"{full['name']}-{name}"
        single["env"]["mix"] = [entry]
        single["teachers"] = {entry["teacher"]: full["teachers"][entry["teacher"]]}
        single["rollout"]["episodes_per_step"] = per_step[name]
        single["trainer"]["micro_batch_size"] = per_step[name]
        single["run"]["eval_episodes"] = held_out[name]
        written[name] = out / "recipes" / f"{name}.yaml"
        written[name].write_text(yaml.safe_dump(single, sort_keys=False))
    return written


def run(label: str, recipe: Path, seed: int, out: Path) -> dict:
    """``opd train`` of ``recipe`` at ``seed`` in ``out/<label>/seed_<seed>``; its summary and the
    wall time it took. A finished run is reused, and one that finished with fewer steps than the
    recipe now asks goes on from its last checkpoint (``--resume``)."""
    run_dir = out / label / f"seed_{seed}"
    cost = run_dir.with_name(f"seed_{seed}.cost.json")
    summary_file = run_dir / "summary.json"
    wanted = yaml.safe_load(recipe.read_text())["run"]["total_steps"]
    done_steps = json.loads(summary_file.read_text())["steps"] if summary_file.is_file() else None
    if done_steps is None or done_steps < wanted:
        resume = done_steps is not None
        print(f"[{time.strftime('%H:%M:%S')}] {label}, seed {seed}"
              + (f" (from step {done_steps} to {wanted})" if resume else ""), flush=True)
        start = time.perf_counter()
        cmd = [*OPD, "train", str(recipe), f"run.seed={seed}", f"run.output_dir={run_dir}", *(["--resume"] if resume else [])]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = run_dir.with_name(f"seed_{seed}.log")
        with log.open("a" if resume else "w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.exit(f"{label}, seed {seed} failed (exit {done.returncode}); see {log}")
        before = json.loads(cost.read_text())["wall_s"] if resume and cost.is_file() else 0.0
        cost.write_text(json.dumps({"wall_s": before + time.perf_counter() - start}))
        print(f"    done in {time.perf_counter() - start:.0f}s", flush=True)
    summary = json.loads(summary_file.read_text())
    return {"label": label, "seed": seed, "summary": summary,
            "wall_s": json.loads(cost.read_text())["wall_s"] if cost.is_file() else None}


def table(records: list[dict], envs: list[str], seeds: list[int]) -> tuple[list[dict], str]:
    """Per environment: the teacher, the student before, each seed's single and mixed success
    after, the lifts and the share kept; and the markdown table of them."""
    by = {(r["label"], r["seed"]): r["summary"] for r in records}
    rows = []
    for env in envs:
        single = [by[(env, s)] for s in seeds]
        mixed = [by[("mixed", s)]["by_environment"][env] for s in seeds]
        before = statistics.mean(s["student_success_before"] for s in single)
        single_after = [s["student_success_after"] for s in single]
        mixed_after = [m["student_after"] for m in mixed]
        mixed_before = statistics.mean(m["student_before"] for m in mixed)
        single_lift = statistics.mean(single_after) - before
        mixed_lift = statistics.mean(mixed_after) - mixed_before
        kept_per_seed = [(m - mixed_before) / (a - before) if a - before > 0 else None
                         for a, m in zip(single_after, mixed_after)]
        rows.append({"env": env, "teacher": statistics.mean(s["teacher_success"] for s in single),
                     "mixed_teacher": statistics.mean(m["teacher"] for m in mixed),
                     "before": before, "mixed_before": mixed_before, "single_after": single_after,
                     "mixed_after": mixed_after, "single_lift": single_lift, "mixed_lift": mixed_lift,
                     "kept": mixed_lift / single_lift if single_lift > 0 else None, "kept_per_seed": kept_per_seed})
    pct = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    pts = lambda v: f"{100 * v:+.0f} pts"  # noqa: E731
    lines = ["| environment | teacher | student before | single teacher, after (per seed) | mixed, after (per seed) "
             "| single lift | mixed lift | kept (per seed) | goal (80%) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = r["kept"] is not None and r["kept"] >= GOAL
        lines.append(f"| {r['env']} | {pct(r['teacher'])} | {pct(r['before'])} | "
                     f"{', '.join(pct(v) for v in r['single_after'])} | {', '.join(pct(v) for v in r['mixed_after'])} | "
                     f"{pts(r['single_lift'])} | {pts(r['mixed_lift'])} | **{pct(r['kept'])}** "
                     f"({', '.join(pct(v) for v in r['kept_per_seed'])}) | {'met' if met else 'not met'} |")
    return rows, "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Held-out success per environment: before, after with its teacher alone, after in the mix
    (one dot per seed, the bar the mean), the teacher's as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    for i, r in enumerate(rows):
        for j, (label, values, color) in enumerate((("before", [r["before"]], "#bbbbbb"),
                                                    ("single teacher", r["single_after"], "#4c72b0"),
                                                    ("mixed", r["mixed_after"], "#dd8452"))):
            x = i + (j - 1) * width
            ax.bar(x, statistics.mean(values), width * 0.9, color=color, label=label if i == 0 else None)
            ax.scatter([x] * len(values), values, color="black", s=8, zorder=3)
        ax.hlines(r["teacher"], i - 1.5 * width, i + 1.5 * width, colors="black", linestyles="dashed",
                  label="teacher" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [r["env"] for r in rows])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out success")
    ax.set_title("one student for three environments vs one per environment")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="run.total_steps of every run (a pilot)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "shared_student")
    parser.add_argument("overrides", nargs="*", help="key=value for the mixed recipe (and so every baseline; the "
                        "models' keys shape the models built)")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, *([f"run.total_steps={args.steps}"] if args.steps else [])]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    models = build_models(args.recipe, overrides)
    build_s = time.perf_counter() - start
    written = recipes(args.recipe, overrides, models, args.out)
    envs = [name for name in written if name != "mixed"]
    records = []
    for seed in args.seeds:
        for label in ["mixed", *envs]:
            records.append(run(label, written[label], seed, args.out))
    rows, md = table(records, envs, args.seeds)
    runs_s = sum(r["wall_s"] or 0.0 for r in records)
    by_label = {label: sum(r["wall_s"] or 0.0 for r in records if r["label"] == label) for label in ["mixed", *envs]}
    cost = (f"{len(records)} runs, {runs_s / 60:.0f} min of wall time on this machine "
            f"({', '.join(f'{k} {v / 60:.0f}' for k, v in by_label.items())} min); the models' build or lookup "
            f"{build_s / 60:.1f} min")
    (args.out / "results.json").write_text(json.dumps({"models": models, "rows": rows, "records": records,
                                                       "build_s": build_s}, indent=2))
    (args.out / "results.md").write_text(f"{md}\n\n{cost}\n")
    plot(rows, args.out / "results.png")
    print(md)
    print(cost)
    return 0 if all(r["kept"] is not None and r["kept"] >= GOAL for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
