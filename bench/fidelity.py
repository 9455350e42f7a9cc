"""The source papers' effects at CPU scale, each beside its baseline: one command per table.

    .venv/bin/python bench/fidelity.py --study teachers            # OPD lifts a weaker student, 4 environments
    .venv/bin/python bench/fidelity.py --study loss                # forward KL (top k) vs sampled reverse KL
    .venv/bin/python bench/fidelity.py --study view                # state-grounded vs full-context teacher
    .venv/bin/python bench/fidelity.py --study clinical_reward     # GRPO, outcome vs outcome + info gain
    .venv/bin/python bench/fidelity.py --study multiturn_rl        # GRPO vs its base: pass@k x budget, matched states
    .venv/bin/python bench/fidelity.py --study smollm2             # a real pretrained student (SmolLM2-135M) on SQL
    .venv/bin/python bench/fidelity.py --list                      # the studies and their arms

A study is a set of arms (a recipe and its overrides) run over seeds. Each arm and seed is one
``opd train`` in its own process (its own Ray); the recipes pin the bootstrap seeds, so every
seed of an environment trains the same teacher and starting student and a seed changes the
tasks and the sampling only. Writes under ``--out`` (default ``runs/fidelity/<study>``):
``results.json`` (one record per run), ``results.md`` (the table, with the CPU time the study
took) and ``results.png`` (held-out figure per arm, one dot per seed). A finished run is reused
(delete its directory to rerun it), so an interrupted study resumes where it stopped; one that
finished with fewer steps than its recipe now asks goes on from its last checkpoint.
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

from opd.config import load_config

ROOT = Path(__file__).resolve().parents[1]
STUDIES_DIR = ROOT / "recipes" / "studies"


@dataclass(frozen=True)
class Arm:
    """One row of a study's table: a recipe with overrides, run once per seed."""

    label: str
    recipe: str  # under recipes/studies/
    overrides: tuple[str, ...] = ()
    group: str = ""  # rows of the same group are compared (an environment, a setting)
    # The teacher built in stages, each a list of overrides of the recipe's teacher.bootstrap whose SFT
    # goes on from the previous stage's model (bootstrap.init) in the first stage's tokenizer; the run
    # gets the last stage as its teacher and stage ``student_stage`` (when set) as its student.
    teacher_stages: tuple[tuple[str, ...], ...] = ()
    student_stage: int | None = None


@dataclass(frozen=True)
class Study:
    name: str
    claim: str  # what the paper says, in a line
    arms: tuple[Arm, ...]
    figures: tuple[str, ...] = ()  # held-out figures besides success (summary.json's heldout keys)
    seeds: tuple[int, ...] = (0, 1, 2)  # --seeds' default
    grid: bool = False  # after each run: opd eval's pass@k x turn-budget grid of the base and the trained
    # student, and opd compare's matched states between them (the multi-turn RL paper's measures)
    step_costs: bool = False  # a table of what a training step cost (time, payload, peak memory)


# The view study needs a student that reasons before it acts (its reasoning is what the full view
# shows the teacher), and one teacher trained in both history layouts, so that each view is in
# its training distribution. Its text environment is the clinical simulator: a work-up goes on
# after a misread finding, so the full view shows the teacher the student's wrong copies of past
# findings beside the findings themselves (in Simon says a wrong move ends the game, so past turns
# are always right and the two views carry the same information). The plan's state line is the
# env's (ClinicalWorkupEnv.state_line: the finding, not the reset's instruction line, which the
# first attempt copied); with the study's 500-token BPE a plan and its action take 50 tokens on
# average and 78 at most, so 96 new tokens. 100 OPD steps, not the recipe's 200: the teachers
# study's students made most of their gain by step 100 (50% -> 69-77%), and a reasoning step
# costs several plain ones. The student gets 100 SFT steps, not the recipe's 50: after 50 its plans
# were broken text (8% of its greedy actions valid, 2% sampled), and in both views OPD only moved
# it between degenerate policies (commit at once, which is right half the time; repeat a test).
# Rollouts at temperature 0.5 (at 1.0 the first step's samples were 23% valid, 97% greedily) and
# lr 2e-4. The loss is the symmetric JSD (gjsd, beta 0.5), not the recipe's forward KL, which broke
# this student's samples in both views at every setting tried (77% valid at step 1, 25% at step 30);
# in a 25-step screen the JSD kept them at 73-78%. At 3 seeds it still taught the greedy student to
# keep asking in both views (52% -> 0% and 18%; docs/results.md, "State-grounded vs full-context
# teacher, clinical").
CLINICAL_REASONING = ("teacher.bootstrap.think=plan", "teacher.bootstrap.history=both", "student.bootstrap.think=plan",
                      "student.bootstrap.sft_steps=100", "rollout.max_new_tokens=96", "rollout.temperature=0.5",
                      "trainer.learning_rate=2e-4", "run.total_steps=100",
                      "losses=[{name: gjsd, args: {beta: 0.5, estimator: topk}}]")

# The quickstart's loss, in place of a study recipe's forward KL: sampled reverse KL as a per-token
# advantage with PPO's clip, the teacher's logprob of each student token, the quickstart's step.
REVERSE_KL = ("supervision.scoring=sampled", "losses=[{name: reverse_kl, args: {clip_ratio: 0.2}}]",
              "trainer.learning_rate=0.0005")

# ALFWorld as docs/results.md's ALFWorld section built it: generated games, no admissible list, the
# training rooms furnished anew in every game (vary_train_rooms), 10% exploring turns in the SFT
# episodes. Its teacher is a tiny Qwen3 (4 layers of 256) SFT on the search expert in three stages:
# t4 (960 episodes, 500 steps; 6% of the 48 held-out games), t5 (1,920 episodes, 750 more steps;
# 25%), t6 (the same games with other exploring turns, 750 more; 29%). t6 teaches t4. About 2 h of
# CPU to build here, then found in the bootstrap cache.
ALFWORLD_VARIED = ("env.kwargs.show_admissible=false", "env.kwargs.n_train_tasks=3600", "env.kwargs.vary_train_rooms=true")
ALFWORLD_STAGES = (
    ("teacher.bootstrap.explore_prob=0.1", "teacher.bootstrap.arch.hidden_size=256", "teacher.bootstrap.arch.num_layers=4",
     "teacher.bootstrap.arch.num_heads=4", "teacher.bootstrap.arch.intermediate_size=768",
     "teacher.bootstrap.n_episodes=960", "teacher.bootstrap.sft_steps=500", "teacher.bootstrap.learning_rate=1e-3"),
    ("teacher.bootstrap.explore_prob=0.1", "teacher.bootstrap.n_episodes=1920", "teacher.bootstrap.sft_steps=750",
     "teacher.bootstrap.learning_rate=5e-4"),
    ("teacher.bootstrap.explore_prob=0.1", "teacher.bootstrap.n_episodes=1920", "teacher.bootstrap.sft_steps=750",
     "teacher.bootstrap.learning_rate=3e-4", "teacher.bootstrap.seed=1"),
)

STUDIES: dict[str, Study] = {s.name: s for s in (
    Study(
        name="teachers",
        claim="a teacher that can do the task lifts a weaker student by on-policy distillation",
        arms=(
            Arm("OPD", "twx_simonsays_opd.yaml", group="TextWorldExpress simonsays"),
            Arm("OPD", "sql_opd.yaml", group="SQL"),
            Arm("OPD", "clinical_opd.yaml", group="clinical diagnostic"),
            Arm("OPD", "alfworld_opd.yaml", group="ALFWorld (generated, admissible commands shown)"),
            Arm("OPD", "alfworld_opd.yaml", ALFWORLD_VARIED, group="ALFWorld (generated, rooms varied, no admissible list)",
                teacher_stages=ALFWORLD_STAGES, student_stage=0),
        ),
        figures=("return",),
    ),
    Study(
        name="loss",
        claim="at this scale the loss decides whether OPD teaches these students: forward KL over the teacher's top k "
              "against sampled reverse KL, the same steps",
        arms=tuple(
            Arm(label, recipe, overrides, group)
            for recipe, group in (("clinical_opd.yaml", "clinical diagnostic"), ("twx_simonsays_opd.yaml", "TextWorldExpress simonsays"))
            for label, overrides in (("forward KL, top 16", ()), ("reverse KL, sampled", REVERSE_KL))
        ),
        figures=("return",),
        seeds=(0,),
    ),
    Study(
        name="view",
        claim="a state-grounded teacher (actions and observations only) distils better than one reading the full context",
        arms=(
            Arm("state_grounded", "frozenlake_view.yaml", ("supervision.teacher_view=state_grounded",), "FrozenLake"),
            Arm("full", "frozenlake_view.yaml", ("supervision.teacher_view=full",), "FrozenLake"),
            *(Arm(view, "clinical_opd.yaml", (f"supervision.teacher_view={view}", *CLINICAL_REASONING),
                  "clinical diagnostic") for view in ("state_grounded", "full")),
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
    Study(
        name="multiturn_rl",
        claim=("multi-turn RL beats its base with a roomy turn budget, an edge that fades or reverses as the budget "
               "tightens; its next action is better in under half the matched states, the gain in error recovery and late stages"),
        arms=(Arm("GRPO", "frozenlake_grpo.yaml", group="FrozenLake"),),
        grid=True,
    ),
    Study(
        name="smollm2",
        claim="OPD moves a real pretrained student (SmolLM2-135M-Instruct, 49k vocabulary) toward a teacher that can do the task",
        arms=(Arm("OPD", "sql_smollm2.yaml", group="SQL, SmolLM2-135M student"),),
        figures=("return",),
        seeds=(0,),  # one short run: a SmolLM2 step is tens of seconds on 2 cores
        step_costs=True,
    ),
)}

# opd eval's grid in the multiturn_rl study: samples per task, turn budgets (fractions of max_turns:
# 6 and 8 of FrozenLake's 8 turns; the BFS expert needs 6 on most 4x4 maps, so half the budget
# leaves every policy at 0%) and temperature; every held-out task of the run's evaluation is played.
GRID_SAMPLES, GRID_BUDGETS, GRID_TEMPERATURE = 4, "0.75,1", 1.0


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


def run_arm(study: Study, arm: Arm, seed: int, out: Path, steps: int | None, extra: list[str]) -> dict:
    """Train one arm at one seed (or reuse a finished run) and read its figures."""
    run_dir = run_dir_of(out, arm, seed)
    cost = run_dir.with_name(run_dir.name + ".cost.json")
    overrides = [f"run.output_dir={run_dir}", f"run.seed={seed}", *arm.overrides,
                 *([f"run.total_steps={steps}"] if steps else []), *extra]
    summary = run_dir / "summary.json"
    done_steps = json.loads(summary.read_text())["steps"] if summary.is_file() else None
    wanted = load_config(STUDIES_DIR / arm.recipe, overrides).run.total_steps
    if done_steps is None or done_steps < wanted:
        # A run that finished with fewer steps than asked now (a recipe's total_steps raised) goes on
        # from its last checkpoint (opd train --resume: the run an uninterrupted one would have been).
        resume = done_steps is not None
        print(f"[{time.strftime('%H:%M:%S')}] {arm.group} / {arm.label}, seed {seed}"
              + (f" (from step {done_steps} to {wanted})" if resume else ""), flush=True)
        start, cpu = time.perf_counter(), machine_cpu_s()
        models = staged_models(arm, extra) if arm.teacher_stages else []
        cmd = [str(ROOT / ".venv" / "bin" / "opd"), "train", str(STUDIES_DIR / arm.recipe), *overrides, *models,
               *(["--resume"] if resume else [])]
        log = out / f"{run_dir.name}.log"
        with log.open("a" if resume else "w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.exit(f"{arm.group} / {arm.label}, seed {seed} failed (exit {done.returncode}); see {log}")
        wall, cpu = time.perf_counter() - start, machine_cpu_s() - cpu
        before = json.loads(cost.read_text()) if resume and cost.is_file() else {"wall_s": 0.0, "cpu_s": 0.0}
        cost.write_text(json.dumps({"wall_s": before["wall_s"] + wall, "cpu_s": before["cpu_s"] + cpu}))
        print(f"    done in {wall:.0f}s ({cpu / 60:.1f} CPU min)", flush=True)
    if study.grid:
        grid_of(run_dir, out)
    return read_run(arm, seed, run_dir)


def staged_models(arm: Arm, extra: list[str] | None = None) -> list[str]:
    """Build (or find in the bootstrap cache) the models of ``arm.teacher_stages`` in turn (with the
    arm's and the command line's overrides, so they see the run's environment), and
    return the overrides that make the last one the run's teacher and ``arm.student_stage`` its
    student. Each stage's cache key names the previous stage's directory, so a stage is rebuilt
    whenever one before it is."""
    from opd.provisioning import resolve_model_path

    dirs: list[str] = []
    for i, stage in enumerate(arm.teacher_stages):
        chain = (f"teacher.bootstrap.init={dirs[-1]}", f"teacher.bootstrap.tokenizer={dirs[0]}") if dirs else ()
        cfg = load_config(STUDIES_DIR / arm.recipe, [*arm.overrides, *(extra or ()), *stage, *chain])
        print(f"    teacher stage {i + 1} of {len(arm.teacher_stages)}", flush=True)
        dirs.append(resolve_model_path(cfg.teacher, cfg.env, 0, lambda msg: print(f"      {msg}", flush=True)))
    models = [f"teacher.path={dirs[-1]}", "teacher.bootstrap=null"]
    if arm.student_stage is not None:
        models += [f"student.path={dirs[arm.student_stage]}", "student.bootstrap=null"]
    print(f"    {' '.join(models)}", flush=True)
    return models


def grid_of(run_dir: Path, out: Path) -> None:
    """``opd eval`` of the starting (``@0``) and the trained student over the pass@k x budget grid,
    then ``opd compare`` of the two in matched states (A: the start; B: trained), each skipped when
    its result is already there. Written to the run's ``eval/``."""
    opd = str(ROOT / ".venv" / "bin" / "opd")
    grid = ["--samples", str(GRID_SAMPLES), "--budgets", GRID_BUDGETS, "--temperature", str(GRID_TEMPERATURE)]
    steps = [("base.json", [opd, "eval", f"{run_dir}@0", "--name", "base", *grid]),
             ("trained.json", [opd, "eval", str(run_dir), "--name", "trained", *grid]),
             ("compare_base_vs_trained.json", [opd, "compare", f"{run_dir}@0", str(run_dir), "--name", "base_vs_trained"])]
    cost_file = run_dir.with_name(run_dir.name + ".grid_cost.json")
    cost = json.loads(cost_file.read_text()) if cost_file.is_file() else {}
    for name, cmd in steps:
        if (run_dir / "eval" / name).is_file():
            continue
        print(f"    {' '.join(cmd[1:3])}", flush=True)
        log = out / f"{run_dir.name}.{name.removesuffix('.json')}.log"
        start, cpu = time.perf_counter(), machine_cpu_s()
        with log.open("w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd[1:3])} failed (exit {done.returncode}); see {log}")
        cost[name] = {"wall_s": time.perf_counter() - start, "cpu_s": machine_cpu_s() - cpu}
        cost_file.write_text(json.dumps(cost))


def read_grid(run_dir: Path) -> dict:
    """pass@k per (who, budget fraction, k), and compare's shares (better / equal / worse, n) per row."""
    passk = {}
    for who in ("base", "trained"):
        for e in json.loads((run_dir / "eval" / f"{who}.json").read_text())["pass_at_k"]:
            passk[f"{who}|{e['fraction']:g}|{e['k']}"] = e["value"]
    cmp = json.loads((run_dir / "eval" / "compare_base_vs_trained.json").read_text())
    rows = {"all": cmp["overall"], **{f"stage: {k}": v for k, v in cmp["by_stage"].items()},
            **{k.replace("_", " "): v for k, v in cmp["by_recovery"].items()}}
    return {"pass_at_k": passk, "compare": rows}


def read_run(arm: Arm, seed: int, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    heldout = summary.get("heldout", {})
    cost_file = run_dir.with_name(run_dir.name + ".cost.json")
    cost = json.loads(cost_file.read_text()) if cost_file.is_file() else {}
    grid_file = run_dir.with_name(run_dir.name + ".grid_cost.json")
    for part in (json.loads(grid_file.read_text()) if grid_file.is_file() else {}).values():  # opd eval / compare
        for k in ("wall_s", "cpu_s"):
            cost[k] = cost.get(k, math.nan) + part[k]
    return {"group": arm.group, "arm": arm.label, "seed": seed, "run_dir": str(run_dir),
            "teacher": summary["teacher_success"], "before": summary["student_success_before"],
            "after": summary["student_success_after"], "train_time_s": summary["train_time_s"],
            "steps": summary["steps"], "heldout": heldout,
            "wall_s": cost.get("wall_s", math.nan), "cpu_s": cost.get("cpu_s", math.nan),
            "per_step": per_step(run_dir),
            **({"grid": read_grid(run_dir)} if (run_dir / "eval" / "compare_base_vs_trained.json").is_file() else {})}


def per_step(run_dir: Path) -> dict:
    """From metrics.jsonl's training steps: the median step time and teacher payload, the peak
    memory of the trainer and driver processes, and the first and last steps' valid-action rate."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if "time/step_s" in r]
    if not rows:
        return {}
    out = {"step_s": statistics.median(r["time/step_s"] for r in rows)}
    for key, name, pick in (("teacher_payload_mb", "teacher_payload_mb", statistics.median),
                            ("memory/trainer_peak_rss_mb", "trainer_peak_rss_mb", max),
                            ("memory/driver_peak_rss_mb", "driver_peak_rss_mb", max)):
        values = [r[key] for r in rows if key in r]
        if values:
            out[name] = pick(values)
    if "valid_action_rate" in rows[0]:
        out["valid_action_first"], out["valid_action_last"] = rows[0]["valid_action_rate"], rows[-1]["valid_action_rate"]
    return out


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
        lines.append("| " + " | ".join([group, "student before", *("" for _ in seeds), _pct(mean([r["before"] for r in rows])),
                                        *(_fig(mean([b[f] for b in before if f in b])) for f in study.figures)]) + " |")
        for label in dict.fromkeys(r["arm"] for r in rows):
            mine = {r["seed"]: r for r in rows if r["arm"] == label}
            after = [r["heldout"].get("student_after", {}) for r in mine.values()]
            lines.append("| " + " | ".join([group, label, *(_pct(mine[s]["after"]) if s in mine else "" for s in seeds),
                                            f"**{_pct(mean([r['after'] for r in mine.values()]))}**",
                                            *(_fig(mean([a[f] for a in after if f in a])) for f in study.figures)]) + " |")
    return lines


def grid_tables(results: list[dict]) -> list[str]:
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
    keys = [k for k in keys if k.split("|")[1] in ("1", str(GRID_SAMPLES))]
    lines = ["", f"pass@k on the held-out tasks ({GRID_SAMPLES} samples per task at T={GRID_TEMPERATURE:g}; "
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
    lines += grid_tables(results)
    if study.step_costs:
        lines += step_table(results)
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
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the study's (0 1 2 for most)")
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
    seeds = args.seeds or list(study.seeds)
    results = [run_arm(study, arm, seed, out, args.steps, args.overrides) for arm in arms for seed in seeds]
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
