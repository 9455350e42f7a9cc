"""Per environment: median reset and step latency, the expert's success on the eval split, and
the number of tasks in each split. Prints a Markdown table (and writes it with ``--out``).

    .venv/bin/python bench/env_table.py                  # every env, default task counts
    .venv/bin/python bench/env_table.py --envs opd/SQLText-v0 --n 50

The expert plays ``info["expert_action"]`` until the episode ends; an episode where the expert
has no action (it lost track) counts as a failure. Latencies are wall-clock on this machine,
measured after one warm-up episode (first-use caches such as generated games are filled then).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from opd.envs import make_env, task_ids

# env id -> (constructor kwargs, eval tasks to play): sized for a 2-core machine.
DEFAULTS: dict[str, tuple[dict, int]] = {
    "opd/FrozenLakeText-v0": ({}, 200),
    "opd/ALFWorldText-v0": ({}, 24),
    "opd/ScienceWorldText-v0": ({}, 30),
    "opd/TextWorldText-v0": ({}, 10),
    "opd/TextWorldExpressText-v0": ({}, 100),
    "opd/BFCLMultiTurn-v0": ({}, 168),
    "opd/SQLText-v0": ({}, 104),
    "opd/ClinicalWorkup-v0": ({"setting": "diagnostic"}, 200),
}


def spread(tasks: list[str], n: int) -> list[str]:
    """``n`` tasks spread evenly over the list (covers every task type of an ordered split)."""
    if n >= len(tasks):
        return tasks
    return [tasks[i * len(tasks) // n] for i in range(n)]


def measure(env_id: str, kwargs: dict, n: int, max_steps: int = 400) -> dict:
    env = make_env(env_id, **kwargs)
    splits = {}
    for split in ("train", "eval", "test"):
        try:
            splits[split] = len(task_ids(env, split))
        except ValueError:
            pass
    tasks = spread(task_ids(env, "eval"), n)
    resets, steps, wins = [], [], 0
    for k, task in enumerate([tasks[0], *tasks]):
        start = time.perf_counter()
        _, info = env.reset(seed=0, options={"task": task})
        reset_s = time.perf_counter() - start
        success = False
        for _ in range(max_steps):
            action = info.get("expert_action")
            if action is None:
                break
            start = time.perf_counter()
            _, _, terminated, truncated, info = env.step(action)
            if k:
                steps.append(time.perf_counter() - start)
            success = bool(info["success"])
            if terminated or truncated:
                break
        if k:  # k == 0 is the warm-up
            resets.append(reset_s)
            wins += success
    env.close()
    return {"env": env_id, "reset_ms": 1000 * statistics.median(resets), "step_ms": 1000 * statistics.median(steps),
            "expert_success": wins / len(tasks), "n": len(tasks), "splits": splits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="*", default=list(DEFAULTS))
    parser.add_argument("--n", type=int, default=0, help="eval tasks per env (0: the defaults)")
    parser.add_argument("--kwargs", default="", help='JSON constructor kwargs, e.g. \'{"setting": "refill"}\'')
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    lines = ["| environment | reset (median) | step (median) | expert success on eval | tasks (train / eval / test) |",
             "|---|---|---|---|---|"]
    for env_id in args.envs:
        kwargs, n = DEFAULTS.get(env_id, ({}, 20))
        kwargs = json.loads(args.kwargs) if args.kwargs else kwargs
        row = measure(env_id, kwargs, args.n or n)
        sizes = " / ".join(str(row["splits"][s]) for s in ("train", "eval", "test") if s in row["splits"])
        label = env_id + (f" {kwargs}" if kwargs else "")
        lines.append(f"| `{label}` | {row['reset_ms']:.2f} ms | {row['step_ms']:.2f} ms | "
                     f"{row['expert_success']:.1%} ({row['n']} tasks) | {sizes} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
