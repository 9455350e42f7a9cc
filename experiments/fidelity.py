"""The source papers' effects at CPU scale, each beside its baseline: one command per study.

    .venv/bin/python experiments/fidelity.py --list                      # the studies and their arms
    .venv/bin/python experiments/fidelity.py --study teachers            # OPD lifts a weaker student, 4 environments
    .venv/bin/python experiments/fidelity.py --study loss                # forward KL (top k) vs sampled reverse KL
    .venv/bin/python experiments/fidelity.py --study view                # state-grounded vs full-context teacher
    .venv/bin/python experiments/fidelity.py --study clinical_reward     # GRPO, outcome vs outcome + info gain
    .venv/bin/python experiments/fidelity.py --study multiturn_rl        # GRPO vs its base: pass@k x budget, matched states
    .venv/bin/python experiments/fidelity.py --study smollm2             # a real pretrained student (SmolLM2-135M) on SQL
    .venv/bin/python experiments/fidelity.py --study pivot_ablation      # GRPO, + preventive, PivotOPD
    .venv/bin/python experiments/fidelity.py --study curricula           # vanilla OPD vs curricula, 8x8 FrozenLake (not run yet)

A study is data: ``recipes/studies/<name>.study.yaml`` names its claim and its arms (a recipe
under ``recipes/`` and its overrides, in groups compared with each other), run over seeds
(:class:`Study`). Each arm and seed is one ``opd train`` in its own process (its own Ray); the
recipes pin the bootstrap seeds, so every seed of an environment trains the same teacher and
starting student and a seed changes the tasks and the sampling only. Writes under ``--out``
(default ``runs/fidelity/<study>``): ``results.json`` (one record per run), ``results.md`` (the
tables and the wall time the runs took) and ``results.png`` (held-out success per arm, one dot
per seed). A finished run is reused (delete its directory to rerun it), so an interrupted study
resumes where it stopped; one that finished with fewer steps than its recipe now asks goes on
from its last checkpoint.
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
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from opd.config import load_config
from opd.evaluation.run_dir import RunDir, read_json

ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = ROOT / "recipes"
STUDIES_DIR = RECIPES_DIR / "studies"
STUDY_SUFFIX = ".study.yaml"
OPD = [sys.executable, "-m", "opd.cli"]  # the opd command of this interpreter's environment


class StudyError(ValueError):
    """A study file that does not describe a study; the message names the file and the key."""


@dataclass(frozen=True)
class Arm:
    """One row of a study's table: a recipe (under ``recipes/``) with overrides, run once per seed."""

    label: str
    recipe: str
    group: str = ""  # rows of the same group are compared (an environment, a setting)
    overrides: tuple[str, ...] = ()
    # The teacher built in stages, each a list of overrides of the recipe's teacher.bootstrap whose SFT
    # goes on from the previous stage's model (bootstrap.init) in the first stage's tokenizer; the run
    # gets the last stage as its teacher and stage ``student_stage`` (when set) as its student.
    teacher_stages: tuple[tuple[str, ...], ...] = ()
    student_stage: int | None = None


@dataclass(frozen=True)
class Grid:
    """``opd eval``'s grid after each run, and ``opd compare`` of the starting and trained students."""

    samples: int = 4
    budgets: tuple[float, ...] = (0.75, 1.0)  # fractions of the environment's turn budget
    temperature: float = 1.0


@dataclass(frozen=True)
class Study:
    """A study file: its claim, arms and seeds, and what its tables show besides held-out success."""

    name: str
    claim: str  # what the paper says, in a line
    arms: tuple[Arm, ...]
    figures: tuple[str, ...] = ()  # held-out figures besides success (summary.json's heldout keys)
    seeds: tuple[int, ...] = (0, 1, 2)  # --seeds' default
    overrides: tuple[str, ...] = ()  # for every arm
    grid: Grid | None = None
    step_costs: bool = False  # a table of what a training step cost (time, payload, peak memory)
    step_metrics: tuple[str, ...] = ()  # training metrics, each averaged over the steps, in a table per arm

    @classmethod
    def load(cls, path: Path) -> "Study":
        """The study ``path`` describes; :class:`StudyError` naming the key that does not fit."""
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise StudyError(f"{path}: a study is a mapping (name, claim, arms, ...)")
        _known(data, cls, path)
        arms = []
        for i, arm in enumerate(data.get("arms") or []):
            if not isinstance(arm, dict):
                raise StudyError(f"{path}: arms[{i}] is not a mapping")
            _known(arm, Arm, f"{path} arms[{i}]")
            arms.append(Arm(**{**arm, "overrides": tuple(arm.get("overrides") or ()),
                               "teacher_stages": tuple(tuple(s) for s in arm.get("teacher_stages") or ())}))
        if not arms or "claim" not in data or data.get("name") != path.name.removesuffix(STUDY_SUFFIX):
            raise StudyError(f"{path}: a study needs a claim, at least one arm and the name its file has")
        grid = data.get("grid")
        return cls(**{**data, "arms": tuple(arms), "figures": tuple(data.get("figures") or ()),
                      "seeds": tuple(data.get("seeds") or cls.seeds), "overrides": tuple(data.get("overrides") or ()),
                      "step_metrics": tuple(data.get("step_metrics") or ()),
                      "grid": Grid(**{**grid, "budgets": tuple(grid.get("budgets", Grid.budgets))}) if grid else None})


def _known(data: dict, cls: type, where: str | Path) -> None:
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise StudyError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(f.name for f in fields(cls))}")


def studies(directory: Path = STUDIES_DIR) -> dict[str, Study]:
    """Every study under ``directory``, by name."""
    found = [Study.load(path) for path in sorted(directory.glob(f"*{STUDY_SUFFIX}"))]
    return {study.name: study for study in found}


def arm_overrides(study: Study, arm: Arm) -> list[str]:
    """The overrides an arm's runs get: the study's, then the arm's."""
    return [*study.overrides, *arm.overrides]


def run_dir_of(out: Path, arm: Arm, seed: int) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in f"{arm.group}-{arm.label}").strip("_")
    return out / f"{slug}-seed{seed}"


def run_arm(study: Study, arm: Arm, seed: int, out: Path, steps: int | None, extra: list[str]) -> dict:
    """Train one arm at one seed (or reuse a finished run) and read its figures."""
    run_dir = run_dir_of(out, arm, seed)
    cost = run_dir.with_name(run_dir.name + ".cost.json")
    overrides = [f"run.output_dir={run_dir}", f"run.seed={seed}", *arm_overrides(study, arm),
                 *([f"run.total_steps={steps}"] if steps else []), *extra]
    summary = RunDir(run_dir).summary()
    done_steps = summary["steps"] if summary else None
    wanted = load_config(RECIPES_DIR / arm.recipe, overrides).run.total_steps
    if done_steps is None or done_steps < wanted:
        # A run that finished with fewer steps than asked now (a recipe's total_steps raised) goes on
        # from its last checkpoint (opd train --resume: the run an uninterrupted one would have been).
        resume = done_steps is not None
        print(f"[{time.strftime('%H:%M:%S')}] {arm.group} / {arm.label}, seed {seed}"
              + (f" (from step {done_steps} to {wanted})" if resume else ""), flush=True)
        start = time.perf_counter()
        models = staged_models(study, arm, extra) if arm.teacher_stages else []
        cmd = [*OPD, "train", str(RECIPES_DIR / arm.recipe), *overrides, *models, *(["--resume"] if resume else [])]
        log = out / f"{run_dir.name}.log"
        with log.open("a" if resume else "w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.exit(f"{arm.group} / {arm.label}, seed {seed} failed (exit {done.returncode}); see {log}")
        wall = time.perf_counter() - start
        before = read_json(cost) if resume else None
        cost.write_text(json.dumps({"wall_s": (before or {}).get("wall_s", 0.0) + wall}))
        print(f"    done in {wall:.0f}s", flush=True)
    if study.grid:
        grid_of(study.grid, run_dir, out)
    return read_run(study, arm, seed, run_dir)


def staged_models(study: Study, arm: Arm, extra: list[str] | None = None) -> list[str]:
    """Build (or find in the bootstrap cache) the models of ``arm.teacher_stages`` in turn (with the
    arm's and the command line's overrides, so they see the run's environment), and return the
    overrides that make the last one the run's teacher and ``arm.student_stage`` its student. Each
    stage's cache key names the previous stage's directory, so a stage is rebuilt whenever one
    before it is."""
    from opd.bootstrap import resolve_model_path

    dirs: list[str] = []
    for i, stage in enumerate(arm.teacher_stages):
        chain = (f"teacher.bootstrap.init={dirs[-1]}", f"teacher.bootstrap.tokenizer={dirs[0]}") if dirs else ()
        cfg = load_config(RECIPES_DIR / arm.recipe, [*arm_overrides(study, arm), *(extra or ()), *stage, *chain])
        print(f"    teacher stage {i + 1} of {len(arm.teacher_stages)}", flush=True)
        dirs.append(resolve_model_path(cfg.teacher, cfg.env, 0, lambda msg: print(f"      {msg}", flush=True)))
    models = [f"teacher.path={dirs[-1]}", "teacher.bootstrap=null"]
    if arm.student_stage is not None:
        models += [f"student.path={dirs[arm.student_stage]}", "student.bootstrap=null"]
    print(f"    {' '.join(models)}", flush=True)
    return models


def grid_of(grid: Grid, run_dir: Path, out: Path) -> None:
    """``opd eval`` of the starting (``@0``) and the trained student over the pass@k x budget grid,
    then ``opd compare`` of the two in matched states (A: the start; B: trained), each skipped when
    its result is already there. Written to the run's ``eval/``."""
    args = ["--samples", str(grid.samples), "--budgets", ",".join(f"{b:g}" for b in grid.budgets),
            "--temperature", str(grid.temperature)]
    steps = [("base.json", [*OPD, "eval", f"{run_dir}@0", "--name", "base", *args]),
             ("trained.json", [*OPD, "eval", str(run_dir), "--name", "trained", *args]),
             ("compare_base_vs_trained.json", [*OPD, "compare", f"{run_dir}@0", str(run_dir), "--name", "base_vs_trained"])]
    cost_file = run_dir.with_name(run_dir.name + ".grid_cost.json")
    cost = read_json(cost_file) or {}
    for name, cmd in steps:
        if (run_dir / "eval" / name).is_file():
            continue
        print(f"    opd {cmd[len(OPD)]}", flush=True)
        log = out / f"{run_dir.name}.{name.removesuffix('.json')}.log"
        start = time.perf_counter()
        with log.open("w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.exit(f"opd {cmd[len(OPD)]} failed (exit {done.returncode}); see {log}")
        cost[name] = {"wall_s": time.perf_counter() - start}
        cost_file.write_text(json.dumps(cost))


def read_grid(run_dir: Path) -> dict:
    """pass@k per (who, budget fraction, k), and compare's shares (better / equal / worse, n) per row."""
    results = dict(RunDir(run_dir).eval_results())
    passk = {}
    for who in ("base", "trained"):
        for e in results[run_dir / "eval" / f"{who}.json"]["pass_at_k"]:
            passk[f"{who}|{e['fraction']:g}|{e['k']}"] = e["value"]
    cmp = results[run_dir / "eval" / "compare_base_vs_trained.json"]
    rows = {"all": cmp["overall"], **{f"stage: {k}": v for k, v in cmp["by_stage"].items()},
            **{k.replace("_", " "): v for k, v in cmp["by_recovery"].items()}}
    return {"pass_at_k": passk, "compare": rows}


def read_run(study: Study, arm: Arm, seed: int, run_dir: Path) -> dict:
    """One run's record: held-out success of the teacher and the student before and after, the
    figures, the wall time it took (with its grid's), and its steps' costs and metrics."""
    run = RunDir(run_dir)
    summary = run.summary() or {}
    wall = (read_json(run_dir.with_name(run_dir.name + ".cost.json")) or {}).get("wall_s", math.nan)
    for part in (read_json(run_dir.with_name(run_dir.name + ".grid_cost.json")) or {}).values():  # opd eval / compare
        wall += part["wall_s"]
    steps = run.steps()
    return {"group": arm.group, "arm": arm.label, "seed": seed, "run_dir": str(run_dir),
            "teacher": summary["teacher_success"], "before": summary["student_success_before"],
            "after": summary["student_success_after"], "train_time_s": summary["train_time_s"],
            "steps": summary["steps"], "heldout": summary.get("heldout", {}), "wall_s": wall,
            "per_step": per_step(steps),
            "step_metrics": {k: statistics.fmean(r[k] for r in steps if k in r) for k in study.step_metrics
                             if any(k in r for r in steps)},
            **({"grid": read_grid(run_dir)} if (run_dir / "eval" / "compare_base_vs_trained.json").is_file() else {})}


def per_step(steps: list[dict]) -> dict:
    """From the training steps' records: the median step time and teacher payload, the peak memory
    of the trainer and driver processes, and the first and last steps' valid-action rate."""
    if not steps:
        return {}
    out = {"step_s": statistics.median(r["time/step_s"] for r in steps)}
    for key, name, pick in (("teacher_payload_mb", "teacher_payload_mb", statistics.median),
                            ("memory/trainer_peak_rss_mb", "trainer_peak_rss_mb", max),
                            ("memory/driver_peak_rss_mb", "driver_peak_rss_mb", max)):
        values = [r[key] for r in steps if key in r]
        if values:
            out[name] = pick(values)
    if "valid_action_rate" in steps[0]:
        out["valid_action_first"], out["valid_action_last"] = steps[0]["valid_action_rate"], steps[-1]["valid_action_rate"]
    return out


# -- the tables --------------------------------------------------------------------------------------
def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _pct(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _fig(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.3g}"


def arm_table(study: Study, results: list[dict]) -> list[str]:
    """Per group: the teacher and the student before training (means over the runs), then each arm
    with its held-out success after training per seed, its mean, and its gain over the student
    before; every row with the mean of each of the study's figures."""
    seeds = sorted({r["seed"] for r in results})
    head = ["group", "policy", *(f"seed {s}" for s in seeds), "success, mean", "gain", *study.figures]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def figures(parts: list[dict]) -> list[str]:
        return [_fig(mean([p[f] for p in parts if f in p])) for f in study.figures]

    for group in dict.fromkeys(r["group"] for r in results):
        rows = [r for r in results if r["group"] == group]
        before = mean([r["before"] for r in rows])
        blank = ["" for _ in seeds]
        lines.append("| " + " | ".join([group, "teacher", *blank, _pct(mean([r["teacher"] for r in rows])), "",
                                        *figures([r["heldout"].get("teacher", {}) for r in rows])]) + " |")
        lines.append("| " + " | ".join([group, "student before", *blank, _pct(before), "",
                                        *figures([r["heldout"].get("student_before", {}) for r in rows])]) + " |")
        for label in dict.fromkeys(r["arm"] for r in rows):
            mine = {r["seed"]: r for r in rows if r["arm"] == label}
            after = mean([r["after"] for r in mine.values()])
            lines.append("| " + " | ".join([group, label, *(_pct(mine[s]["after"]) if s in mine else "" for s in seeds),
                                            f"**{_pct(after)}**", f"{100 * (after - before):+.0f} pts",
                                            *figures([r["heldout"].get("student_after", {}) for r in mine.values()])]) + " |")
    return lines


def step_metrics_table(study: Study, results: list[dict]) -> list[str]:
    """Per group and arm: each of the study's ``step_metrics``, averaged over the steps and the seeds."""
    if not study.step_metrics:
        return []
    lines = ["", "Training metrics, mean over the steps and the seeds (n/a: the arm does not log it):", "",
             "| group | arm | " + " | ".join(study.step_metrics) + " |", "|---|---|" + "---|" * len(study.step_metrics)]
    for group in dict.fromkeys(r["group"] for r in results):
        for label in dict.fromkeys(r["arm"] for r in results if r["group"] == group):
            mine = [r["step_metrics"] for r in results if r["group"] == group and r["arm"] == label]
            cells = [_fig(mean([m[k] for m in mine if k in m])) or "n/a" for k in study.step_metrics]
            lines.append(f"| {group} | {label} | " + " | ".join(cells) + " |")
    return lines


def step_table(results: list[dict]) -> list[str]:
    """What a training step cost, per run: time, teacher payload, peak memory, and the training
    episodes' valid-action rate at the first and last step."""
    lines = ["", "| group | seed | step time (median) | teacher payload a step | trainer peak RSS | driver peak RSS "
                 "| valid actions, first step → last |", "|---|---|---|---|---|---|---|"]
    for r in results:
        s = r.get("per_step") or {}
        cell = {k: (f"{s[k]:.1f}" if k in s else "n/a") for k in ("step_s", "teacher_payload_mb")}
        mem = {k: (f"{s[k]:,.0f} MiB" if k in s else "n/a") for k in ("trainer_peak_rss_mb", "driver_peak_rss_mb")}
        valid = (f"{_pct(s['valid_action_first'])} → {_pct(s['valid_action_last'])}" if "valid_action_first" in s else "n/a")
        lines.append(f"| {r['group']} | {r['seed']} | {cell['step_s']} s | {cell['teacher_payload_mb']} MiB | "
                     f"{mem['trainer_peak_rss_mb']} | {mem['driver_peak_rss_mb']} | {valid} |")
    return lines


def grid_tables(grid: Grid, results: list[dict]) -> list[str]:
    """The multi-turn RL paper's two measures, base (the run's starting student) beside trained:
    pass@k per turn budget, and the share of matched states where the trained student's next
    action is better / worse, overall, by stage and in error recovery (per seed and mean), and
    better's share of the states where the two act differently (pooled over seeds: the paper's
    figure)."""
    results = [r for r in results if "grid" in r]
    if not results:
        return []
    seeds = [r["seed"] for r in results]
    keys = sorted({k.split("|", 1)[1] for r in results for k in r["grid"]["pass_at_k"]},
                  key=lambda k: (float(k.split("|")[0]), int(k.split("|")[1])))
    keys = [k for k in keys if k.split("|")[1] in ("1", str(grid.samples))]
    lines = ["", f"pass@k on the held-out tasks ({grid.samples} samples per task at T={grid.temperature:g}; "
                 "budget: the fraction of the environment's turn budget; mean over seeds, the seeds in brackets):", "",
             "| group | budget | k | base | trained | difference |", "|---|---|---|---|---|---|"]
    for group in dict.fromkeys(r["group"] for r in results):
        rows = [r for r in results if r["group"] == group]
        for key in keys:
            frac, k = key.split("|")
            base = [r["grid"]["pass_at_k"][f"base|{key}"] for r in rows]
            trained = [r["grid"]["pass_at_k"][f"trained|{key}"] for r in rows]
            lines.append(f"| {group} | {frac} | {k} | {_pct(mean(base))} ({', '.join(_pct(x) for x in base)}) | "
                         f"{_pct(mean(trained))} ({', '.join(_pct(x) for x in trained)}) | "
                         f"{100 * (mean(trained) - mean(base)):+.0f} pts |")
    lines += ["", "Matched states (opd compare, A: base, B: trained, judged by the expert playing on; the states "
                  "come from the base's greedy held-out episodes): share where the trained student's next action "
                  "is better / worse, mean over seeds (" + ", ".join(f"seed {s}" for s in seeds) + " in brackets):", "",
              "| group | states | n (all seeds) | trained better | equal | trained worse | better, of the states where they differ |",
              "|---|---|---|---|---|---|---|"]
    for group in dict.fromkeys(r["group"] for r in results):
        rows = [r for r in results if r["group"] == group]
        for name in rows[0]["grid"]["compare"]:
            parts = [r["grid"]["compare"][name] for r in rows]
            cells = []
            for v in ("better", "equal", "worse"):
                vals = [p[v] for p in parts if p["n"]]
                cells.append(f"{_pct(mean(vals))} ({', '.join(_pct(x) for x in vals)})" if vals else "n/a")
            better = sum(p["better"] * p["n"] for p in parts)  # pooled over seeds
            differ = better + sum(p["worse"] * p["n"] for p in parts)
            cells.append(_pct(better / differ) if differ else "n/a")
            lines.append(f"| {group} | {name} | {sum(p['n'] for p in parts)} | " + " | ".join(cells) + " |")
    return lines


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
    lines += arm_table(study, results)
    lines += step_metrics_table(study, results)
    if study.grid:
        lines += grid_tables(study.grid, results)
    if study.step_costs:
        lines += step_table(results)
    wall = sum(r["wall_s"] for r in results if not math.isnan(r["wall_s"]))
    lines += ["", f"{len(results)} runs: {wall / 60:.0f} min of wall time in all (a run that did not find its teacher "
                  "and student in the bootstrap cache built them, and that is counted in it)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    known = studies()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=sorted(known))
    parser.add_argument("--list", action="store_true", help="print the studies and their arms")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the study's (0 1 2 for most)")
    parser.add_argument("--steps", type=int, default=None, help="run.total_steps of every run (default: the recipe's)")
    parser.add_argument("--groups", nargs="+", default=None, help="only these groups (substring match)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_args(argv)
    if args.list or not args.study:
        for study in known.values():
            print(f"{study.name}: {study.claim}")
            for arm in study.arms:
                print(f"    {arm.group} / {arm.label}: recipes/{arm.recipe} {' '.join(arm_overrides(study, arm))}")
        return
    study = known[args.study]
    arms = [a for a in study.arms if not args.groups or any(g in a.group for g in args.groups)]
    if not arms:
        sys.exit(f"no arm of {study.name} matches --groups {args.groups}; see --list")
    out = args.out or ROOT / "runs" / "fidelity" / study.name
    out.mkdir(parents=True, exist_ok=True)
    seeds = args.seeds or list(study.seeds)
    results = [run_arm(study, arm, seed, out, args.steps, args.overrides) for arm in arms for seed in seeds]
    text = render(study, results, "experiments/fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(text)
    write_plot(study, results, out / "results.png")
    print(text)
    print(f"wrote {out / 'results.md'}, results.json and results.png")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.path.insert(0, str(ROOT))
    main()
