"""Where a step's time goes that is not arithmetic: per phase, the top functions of the local
backend, and per actor call of the Ray backend, what the call costs beside the actor's own work.

    .venv/bin/python bench/step_profile.py                               # the quickstart, about 2 minutes
    .venv/bin/python bench/step_profile.py --recipe recipes/prompt_dataset.yaml --steps 30

Two runs of ``opd train RECIPE`` (no evaluation between steps, no checkpoint or trajectory file):

- **local** (``run.backend=local``, in this process): each phase's calls (the rollout's
  ``collect``, the teacher's ``score_for_training``, the trainer's ``train_built``, the weight
  ``sync_weights``) under a :mod:`cProfile` profiler of its own after the first ``--warmup``
  steps; per phase its time per step and the ``--top`` functions by own time (ms per step).
- **ray** (``run.backend=ray``, a child process): every call the driver makes and every call an
  actor runs is timed where it runs (the methods are wrapped as their modules are imported, in
  the driver and in each actor's process, through a ``sitecustomize`` this script writes to a
  temporary directory on ``PYTHONPATH``); per call: the driver's wall time, the actor's own time,
  the dispatch (driver call to actor start: pickling the arguments, the object store, waking the
  actor), the return (actor end to the driver holding the result) and the actor's minor page
  faults per call (pages the process takes afresh from the kernel).

Results: ``<out>/step_profile.json`` and ``step_profile.md``. Nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ("run.eval_every_steps=0", "run.eval_episodes=8", "run.save_every_steps=0", "run.trajectory_every_steps=0")
PHASES = {"collect": "generation", "score_for_training": "teacher_scoring", "train_built": "training",
          "sync_weights": "weight_sync"}
# The methods timed under Ray: the driver's calls and what each runs in an actor.
RAY_TARGETS = {
    "opd.runtime.actors": {"RayWorkers": ["collect", "score_for_training", "train_built", "sync_weights"]},
    "opd.runtime.workers": {"PolicyWorker": ["collect"], "TeacherWorker": ["score_split"],
                            "RolloutWorker": ["update_weights"]},
    "opd.training.trainer": {"StudentTrainer": ["train_built", "export_weights"]},
}
INNER = {"collect": ["collect"], "score_for_training": ["score_split"], "train_built": ["train_built"],
         "sync_weights": ["export_weights", "update_weights"]}
SITECUSTOMIZE = '''
import os, sys
if os.environ.get("OPD_PROFILE_CALLS"):
    import functools, importlib.abc, importlib.util, json, time
    TARGETS = json.loads(os.environ["OPD_PROFILE_TARGETS"])

    def _faults():
        with open("/proc/self/stat") as f:
            text = f.read()
        return int(text[text.rindex(")") + 2:].split()[7])

    def _timed(fn, where):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            start, faults = time.time(), _faults()
            try:
                return fn(*args, **kwargs)
            finally:
                with open(os.environ["OPD_PROFILE_CALLS"], "a") as out:
                    out.write(json.dumps([where, fn.__name__, os.getpid(), start, time.time(), _faults() - faults]) + "\\n")
        return inner

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for cls, methods in TARGETS[name].items():
                    for method in methods:
                        setattr(getattr(module, cls), method, _timed(getattr(getattr(module, cls), method),
                                                                     "driver" if cls == "RayWorkers" else "actor"))
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
'''


def profile_local(recipe: str, overrides: list[str], steps: int, warmup: int, top: int, run_dir: Path) -> dict:
    """The local run, each phase under its own profiler after ``warmup`` steps."""
    from opd.cli import main
    from opd.runtime import driver, local

    profilers = {phase: cProfile.Profile() for phase in PHASES.values()}
    step_now = {"step": 0}
    run_step = driver.TrainingRun._step

    def counted(self, step):
        step_now["step"] = step
        return run_step(self, step)

    def profiled(method, phase):
        def inner(self, *args, **kwargs):
            if step_now["step"] <= warmup:
                return method(self, *args, **kwargs)
            profilers[phase].enable()
            try:
                return method(self, *args, **kwargs)
            finally:
                profilers[phase].disable()
        return inner

    originals = {name: getattr(local.LocalWorkers, name) for name in PHASES}
    driver.TrainingRun._step = counted
    for name, phase in PHASES.items():
        setattr(local.LocalWorkers, name, profiled(originals[name], phase))
    try:
        if main(["train", recipe, *OVERRIDES, *overrides, f"run.total_steps={steps}", "run.backend=local",
                 f"run.output_dir={run_dir}"]) != 0:
            raise SystemExit("the local run failed")
    finally:
        driver.TrainingRun._step = run_step
        for name, method in originals.items():
            setattr(local.LocalWorkers, name, method)
    profiled_steps = steps - warmup
    out = {}
    for phase, profiler in profilers.items():
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # own time
        total = max((cum for (_, _, _, cum, _) in stats.stats.values()), default=0.0)
        out[phase] = {"ms_per_step": 1e3 * total / profiled_steps,
                      "top": [{"function": pstats.func_std_string(func), "calls_per_step": nc / profiled_steps,
                               "own_ms_per_step": 1e3 * tt / profiled_steps} for func, (_, nc, tt, _, _) in rows[:top]]}
    return out


def profile_ray(recipe: str, overrides: list[str], steps: int, warmup: int, run_dir: Path) -> dict:
    """The Ray run in a child process, its driver's and actors' calls timed where they run."""
    hook = Path(tempfile.mkdtemp(prefix="opd-profile-"))
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    calls = run_dir.with_name("ray_calls.jsonl")
    env = {**os.environ, "OPD_PROFILE_CALLS": str(calls), "OPD_PROFILE_TARGETS": json.dumps(RAY_TARGETS),
           "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [sys.executable, "-m", "opd.cli", "train", recipe, *OVERRIDES, *overrides, f"run.total_steps={steps}",
               "run.backend=ray", f"run.output_dir={run_dir}"]
    if subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit(f"the Ray run failed: {' '.join(command)}")
    rows = [json.loads(line) for line in calls.read_text().splitlines()]
    outer = [r for r in rows if r[0] == "driver"]
    inner = [r for r in rows if r[0] == "actor"]
    per_call: dict[str, list[dict]] = {}
    for count, (_, name, _, start, end, _) in enumerate(outer):
        if count < warmup * len(PHASES):  # the warm-up steps' calls (one of each a step)
            continue
        runs = [r for r in inner if r[1] in INNER[name] and r[3] >= start - 1e-3 and r[4] <= end + 1e-3]
        if not runs:
            continue
        first, last = min(r[3] for r in runs), max(r[4] for r in runs)
        per_call.setdefault(name, []).append({"wall": end - start, "dispatch": first - start, "return": end - last,
                                             "actor": sum(r[4] - r[3] for r in runs),
                                             "faults": sum(r[5] for r in runs)})
    return {name: {key: statistics.median(c[key] for c in cs) * (1 if key == "faults" else 1e3) for key in cs[0]}
            | {"calls": len(cs)} for name, cs in per_call.items()}


def markdown(result: dict) -> str:
    lines = [f"{Path(result['recipe']).name}: {result['steps']} steps, the first {result['warmup']} not profiled", "",
             "### Local backend: per phase, ms per step and the top functions by own time", ""]
    for phase, row in result["local"].items():
        lines.append(f"- **{phase}** {row['ms_per_step']:.1f} ms: " + "; ".join(
            f"`{t['function'].split('/')[-1]}` {t['own_ms_per_step']:.1f} ({t['calls_per_step']:.0f} calls)"
            for t in row["top"]))
    lines += ["", "### Ray backend: per call, medians (ms; faults: the actor's minor page faults per call)", "",
              "| call | driver wall | in the actor | dispatch | return | faults |", "|---|---|---|---|---|---|"]
    for name, row in result["ray"].items():
        lines.append(f"| {name} | {row['wall']:.1f} | {row['actor']:.1f} | {row['dispatch']:.1f} | {row['return']:.1f} "
                     f"| {row['faults']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=6, help="functions shown per phase")
    parser.add_argument("--out", default="runs/bench_step_profile")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("need --steps > --warmup")
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass --out to a new directory")
    out.mkdir(parents=True, exist_ok=True)
    recipe = str(Path(args.recipe).resolve())
    result = {"recipe": recipe, "steps": args.steps, "warmup": args.warmup, "overrides": args.overrides,
              "ray": profile_ray(recipe, args.overrides, args.steps, args.warmup, out / "ray"),
              "local": profile_local(recipe, args.overrides, args.steps, args.warmup, args.top, out / "local")}
    (out / "step_profile.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "step_profile.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
