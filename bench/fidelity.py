"""The source papers' effects at CPU scale, each beside its baseline: one command per table.

    .venv/bin/python bench/fidelity.py --study teachers            # OPD lifts a weaker student, 4 environments
    .venv/bin/python bench/fidelity.py --study view                # state-grounded vs full-context teacher
    .venv/bin/python bench/fidelity.py --study clinical_reward     # GRPO, outcome vs outcome + info gain
    .venv/bin/python bench/fidelity.py --list                      # the studies and their arms

A study is a set of arms (a recipe and its overrides) run over seeds. Each arm and seed is one
``opd train`` in its own process (its own Ray); the recipes pin the bootstrap seeds, so every
seed of an environment trains the same teacher and starting student and a seed changes the
tasks and the sampling only. Writes under ``--out`` (default ``runs/fidelity/<study>``):
``results.json`` (one record per run), ``results.md`` (the table, with the CPU time the study
took) and ``results.png`` (held-out figure per arm, one dot per seed). A finished run is reused
(delete its directory to rerun it), so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDIES_DIR = ROOT / "recipes" / "studies"


@dataclass(frozen=True)
class Arm:
    """One row of a study's table: a recipe with overrides, run once per seed."""

    label: str
    recipe: str  # under recipes/studies/
    overrides: tuple[str, ...] = ()
    group: str = ""  # rows of the same group are compared (an environment, a setting)


@dataclass(frozen=True)
class Study:
    name: str
    claim: str  # what the paper says, in a line
    arms: tuple[Arm, ...]
    figures: tuple[str, ...] = ()  # held-out figures besides success (summary.json's heldout keys)


# The view study needs a student that reasons before it acts (its reasoning is what the full view
# shows the teacher), and one teacher trained in both history layouts, so that each view is in
# its training distribution.
TWX_REASONING = ("teacher.bootstrap.think=plan", "teacher.bootstrap.history=both", "student.bootstrap.think=plan",
                 "rollout.max_new_tokens=64")

STUDIES: dict[str, Study] = {s.name: s for s in (
    Study(
        name="teachers",
        claim="a teacher that can do the task lifts a weaker student by on-policy distillation",
        arms=(
            Arm("OPD", "twx_simonsays_opd.yaml", group="TextWorldExpress simonsays"),
            Arm("OPD", "sql_opd.yaml", group="SQL"),
            Arm("OPD", "clinical_opd.yaml", group="clinical diagnostic"),
            Arm("OPD", "alfworld_opd.yaml", group="ALFWorld (generated, admissible commands shown)"),
        ),
        figures=("return",),
    ),
    Study(
        name="view",
        claim="a state-grounded teacher (actions and observations only) distils better than one reading the full context",
        arms=(
            Arm("state_grounded", "frozenlake_view.yaml", ("supervision.teacher_view=state_grounded",), "FrozenLake"),
            Arm("full", "frozenlake_view.yaml", ("supervision.teacher_view=full",), "FrozenLake"),
            *(Arm(view, "twx_simonsays_opd.yaml", (f"supervision.teacher_view={view}", *TWX_REASONING),
                  "TextWorldExpress simonsays") for view in ("state_grounded", "full")),
        ),
        figures=("return",),
    ),
    Study(
        name="clinical_reward",
        claim="an information-gain bonus on top of the outcome reward makes GRPO ask before committing",
        arms=tuple(
            Arm(reward, "clinical_grpo.yaml", (f"env.kwargs.setting={setting}", f"env.kwargs.reward={reward}"), setting)
            for setting in ("diagnostic", "refill", "titration") for reward in ("outcome", "outcome_info_gain")
        ),
        figures=("value", "questions_asked", "premature_commitment", "high_risk_value"),
    ),
)}


def run_dir_of(out: Path, arm: Arm, seed: int) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in f"{arm.group}-{arm.label}").strip("_")
    return out / f"{slug}-seed{seed}"


def machine_cpu_s() -> float:
    """CPU seconds this machine has been busy since boot (/proc/stat: user, nice, system, irq,
    softirq, steal). A run's cost is the difference over it: Ray's workers are not children the
    runner can account for, so this counts everything, and the study must run on a quiet machine."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_arm(arm: Arm, seed: int, out: Path, steps: int | None, extra: list[str]) -> dict:
    """Train one arm at one seed (or reuse a finished run) and read its figures."""
    run_dir = run_dir_of(out, arm, seed)
    cost = run_dir.with_name(run_dir.name + ".cost.json")
    if not (run_dir / "summary.json").is_file():
        cmd = [str(ROOT / ".venv" / "bin" / "opd"), "train", str(STUDIES_DIR / arm.recipe), f"run.output_dir={run_dir}",
               f"run.seed={seed}", *arm.overrides, *([f"run.total_steps={steps}"] if steps else []), *extra]
        print(f"[{time.strftime('%H:%M:%S')}] {arm.group} / {arm.label}, seed {seed}", flush=True)
        start, cpu = time.perf_counter(), machine_cpu_s()
        log = out / f"{run_dir.name}.log"
        with log.open("w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.exit(f"{arm.group} / {arm.label}, seed {seed} failed (exit {done.returncode}); see {log}")
        wall, cpu = time.perf_counter() - start, machine_cpu_s() - cpu
        cost.write_text(json.dumps({"wall_s": wall, "cpu_s": cpu}))
        print(f"    done in {wall:.0f}s ({cpu / 60:.1f} CPU min)", flush=True)
    return read_run(arm, seed, run_dir)


def read_run(arm: Arm, seed: int, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    heldout = summary.get("heldout", {})
    cost_file = run_dir.with_name(run_dir.name + ".cost.json")
    cost = json.loads(cost_file.read_text()) if cost_file.is_file() else {}
    return {"group": arm.group, "arm": arm.label, "seed": seed, "run_dir": str(run_dir),
            "teacher": summary["teacher_success"], "before": summary["student_success_before"],
            "after": summary["student_success_after"], "train_time_s": summary["train_time_s"],
            "steps": summary["steps"], "heldout": heldout,
            "wall_s": cost.get("wall_s", math.nan), "cpu_s": cost.get("cpu_s", math.nan)}


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _pct(x: float) -> str:
    return "" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def teacher_table(results: list[dict]) -> list[str]:
    """Per environment: teacher, student before and after per seed, and the bar of issue 23:
    teacher >= 50% and a student gain of >= 15 points or half its gap to the teacher."""
    seeds = sorted({r["seed"] for r in results})
    lines = ["| environment | teacher | student before | " + " | ".join(f"after, seed {s}" for s in seeds)
             + " | after, mean | gain | bar |", "|---|---|---|" + "---|" * (len(seeds) + 3)]
    for group in dict.fromkeys(r["group"] for r in results):
        rows = {r["seed"]: r for r in results if r["group"] == group}
        teacher, before = mean([r["teacher"] for r in rows.values()]), mean([r["before"] for r in rows.values()])
        after = mean([r["after"] for r in rows.values()])
        gain = after - before
        bar = teacher >= 0.5 and (gain >= 0.15 or gain >= (teacher - before) / 2)
        lines.append(f"| {group} | {_pct(teacher)} | {_pct(before)} | "
                     + " | ".join(_pct(rows[s]["after"]) if s in rows else "" for s in seeds)
                     + f" | **{_pct(after)}** | {100 * gain:+.0f} pts | {'met' if bar else 'not met'} |")
    lines += ["", "| environment | held-out figure | teacher | student before | student after (mean) |", "|---|---|---|---|---|"]
    for group in dict.fromkeys(r["group"] for r in results):
        rows = [r["heldout"] for r in results if r["group"] == group]
        names = dict.fromkeys(k for h in rows for part in h.values() for k in part if k != "turns")
        for name in names:
            values = [mean([h.get(who, {})[name] for h in rows if name in h.get(who, {})])
                      for who in ("teacher", "student_before", "student_after")]
            lines.append(f"| {group} | {name} | " + " | ".join(_fig(v) for v in values) + " |")
    return lines


def arm_table(study: Study, results: list[dict]) -> list[str]:
    """Per group and arm: held-out success after training per seed and its mean, then the mean of
    each of the study's figures, with the student before training as the first row."""
    seeds = sorted({r["seed"] for r in results})
    head = ["group", "arm", *(f"seed {s}" for s in seeds), "success, mean", *study.figures]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in dict.fromkeys(r["group"] for r in results):
        rows = [r for r in results if r["group"] == group]
        before = [r["heldout"].get("student_before", {}) for r in rows]
        lines.append(f"| {group} | student before | " + " | ".join("" for _ in seeds)
                     + f" | {_pct(mean([r['before'] for r in rows]))} | "
                     + " | ".join(_fig(mean([b[f] for b in before if f in b])) for f in study.figures) + " |")
        for label in dict.fromkeys(r["arm"] for r in rows):
            mine = {r["seed"]: r for r in rows if r["arm"] == label}
            after = [r["heldout"].get("student_after", {}) for r in mine.values()]
            lines.append(f"| {group} | {label} | " + " | ".join(_pct(mine[s]["after"]) if s in mine else "" for s in seeds)
                         + f" | **{_pct(mean([r['after'] for r in mine.values()]))}** | "
                         + " | ".join(_fig(mean([a[f] for a in after if f in a])) for f in study.figures) + " |")
    return lines


def _fig(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.3g}"


def write_plot(study: Study, results: list[dict], path: Path) -> None:
    """Held-out success after training per arm (bar: mean over seeds; dots: seeds), grouped."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in results))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups) + 1, 3.4), squeeze=False, sharey=True)
    for ax, group in zip(axes[0], groups):
        rows = [r for r in results if r["group"] == group]
        labels = ["before", *dict.fromkeys(r["arm"] for r in rows)]
        values = [[r["before"] for r in rows], *([r["after"] for r in rows if r["arm"] == a] for a in labels[1:])]
        ax.bar(range(len(labels)), [mean(v) for v in values], color=["#bbbbbb"] + ["#4477aa"] * (len(labels) - 1))
        for i, v in enumerate(values):
            ax.scatter([i] * len(v), v, color="black", s=12, zorder=3)
        teacher = mean([r["teacher"] for r in rows])
        ax.axhline(teacher, color="#cc6677", linestyle="--", linewidth=1, label=f"teacher {_pct(teacher)}")
        ax.set_xticks(range(len(labels)), labels, rotation=20)
        ax.set_title(group, fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("held-out success (greedy)")
    fig.suptitle(f"{study.name}: {study.claim}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(study: Study, results: list[dict], command: str) -> str:
    lines = [f"# {study.name}", "", f"Claim: {study.claim}.", "", f"Command: `{command}`", ""]
    lines += teacher_table(results) if study.name == "teachers" else arm_table(study, results)
    wall = sum(r["wall_s"] for r in results if not math.isnan(r["wall_s"]))
    cpu = sum(r["cpu_s"] for r in results if not math.isnan(r["cpu_s"]))
    lines += ["", f"{len(results)} runs: {wall / 60:.0f} min of wall time and {cpu / 60:.0f} min of CPU time in all "
                  "(the machine's busy CPU time while the runs ran, 2 cores; a run that did not find its "
                  "teacher and student in the bootstrap cache built them, and that is counted in it)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=sorted(STUDIES))
    parser.add_argument("--list", action="store_true", help="print the studies and their arms")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="run.total_steps of every run (default: the recipe's)")
    parser.add_argument("--groups", nargs="+", default=None, help="only these groups (substring match)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_args()
    if args.list or not args.study:
        for study in STUDIES.values():
            print(f"{study.name}: {study.claim}")
            for arm in study.arms:
                print(f"    {arm.group} / {arm.label}: recipes/studies/{arm.recipe} {' '.join(arm.overrides)}")
        return
    study = STUDIES[args.study]
    arms = [a for a in study.arms if not args.groups or any(g in a.group for g in args.groups)]
    if not arms:
        sys.exit(f"no arm of {study.name} matches --groups {args.groups}; see --list")
    out = args.out or ROOT / "runs" / "fidelity" / study.name
    out.mkdir(parents=True, exist_ok=True)
    results = [run_arm(arm, seed, out, args.steps, args.overrides) for arm in arms for seed in args.seeds]
    command = "bench/fidelity.py " + " ".join(sys.argv[1:])
    text = render(study, results, command)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(text)
    write_plot(study, results, out / "results.png")
    print(text)
    print(f"wrote {out / 'results.md'}, results.json and results.png")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
