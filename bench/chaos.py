"""A seeded chaos run (issue 51): a recipe on two trainer ranks, two rollout and two teacher
replicas while ``OPD_CHAOS`` kills processes at moments drawn from the seed, against the same run
with no fault (:mod:`opd.runtime.chaos`).

    .venv/bin/python bench/chaos.py                                   # tiny recipe, 40 steps, 16 faults
    .venv/bin/python bench/chaos.py --steps 60 --faults 30 --seed 7
    .venv/bin/python bench/chaos.py --recipe recipes/quickstart.yaml --steps 30 --faults 10 -- resources.num_cpus=2

Reported in ``<out>/chaos.json`` and ``.md``: the faults by call and by what was killed (fired,
landed during the call or just after it, environment episodes replayed or lost), the restarts,
every step logged once or not, whether the final checkpoint verifies, the logged values that
differ from the unbroken run's, and the wall time of both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd.runtime.chaos import markdown, report  # noqa: E402

CLUSTER = ["resources.trainer_ranks=2", "resources.trainer_cpus=0.5", "trainer.zero_stage=3",
           "resources.teacher_replicas=2", "resources.rollout_replicas=2", "resources.teacher_cpus=0.25",
           "resources.rollout_cpus=0.25"]


def train(args, run_dir: Path, chaos: str = "") -> tuple[subprocess.CompletedProcess, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cache = args.out / "cache"
    env = {k: v for k, v in os.environ.items() if k != "OPD_CHAOS"} | ({"OPD_CHAOS": chaos} if chaos else {})
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "opd.cli", "train", args.recipe, f"run.output_dir={run_dir}",
         f"run.total_steps={args.steps}", f"run.save_every_steps={args.save_every}", "run.keep_checkpoints=2",
         f"run.max_restarts={args.faults + 5}", f"student.bootstrap.cache_dir={cache}",
         f"teacher.bootstrap.cache_dir={cache}", *CLUSTER, *args.overrides],
        cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=7200)
    (run_dir.parent / f"{run_dir.name}.log").write_text(done.stdout + done.stderr)
    return done, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "tests" / "data" / "tiny.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--faults", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, chaos in (("whole", ""), ("chaos", f"seed={args.seed},faults={args.faults}")):
        done, seconds = train(args, args.out / name, chaos)
        print(f"{name}: exit {done.returncode} in {seconds:.0f} s", flush=True)
        if done.returncode != 0:
            print((done.stdout + done.stderr)[-3000:])
            return 1
        runs[name] = seconds
    result = report(args.out / "chaos", args.out / "whole")
    result |= {"seed": args.seed, "steps_asked": args.steps, "faults_asked": args.faults,
               "wall_s": {k: round(v, 1) for k, v in runs.items()}}
    text = (f"Chaos run: {args.recipe}, {args.steps} steps saving every {args.save_every}, {args.faults} faults "
            f"(seed {args.seed}), 2 trainer ranks (ZeRO-3), 2 rollout and 2 teacher replicas\n\n" + markdown(result) +
            f"\n- wall time: {runs['whole']:.0f} s without faults, {runs['chaos']:.0f} s with them")
    (args.out / "chaos.json").write_text(json.dumps(result, indent=2))
    (args.out / "chaos.md").write_text(text + "\n")
    print(text)
    ok = (result["steps_logged"] == list(range(1, args.steps + 1)) and not result["steps_logged_twice"]
          and result["final_checkpoint_verifies"] and not result["differences"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
