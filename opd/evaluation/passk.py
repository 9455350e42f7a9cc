"""pass@k over a turn-budget grid: how success grows with the number of samples (sampling
breadth) and the number of turns allowed (interaction depth), as in "What Does Multi-Turn RL
Really Improve in LLM Agents?".

Each task is played ``n`` times under each turn budget (the environment made with
``max_turns=budget``: a real replay, not a truncation of longer episodes, so a policy that
reads its remaining turns is measured as it would act). For ``k = 1 … n``, pass@k of a task is
the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (``c`` of its ``n`` samples succeeded, Chen
et al. 2021); the grid's value is its mean over tasks, with a percentile-bootstrap interval
over tasks (tasks resampled with replacement; the samples of a task stay together).

Example:
    >>> pass_at_k(n=8, c=2, k=1)
    0.25
    >>> round(pass_at_k(n=8, c=2, k=4), 4)
    0.7857
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from opd.trajectory import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from ``n``
    (``c`` of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` (one per task)."""
    import numpy as np

    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def budget_turns(max_turns: int, fractions: Sequence[float]) -> list[tuple[float, int]]:
    """``(fraction, turns)`` for each fraction of the environment's turn budget, at least one
    turn each, in increasing order, without repeats (a tiny budget can make two equal)."""
    seen: dict[int, float] = {}
    for fraction in sorted(fractions):
        seen.setdefault(max(1, round(fraction * max_turns)), fraction)
    return [(fraction, turns) for turns, fraction in sorted(seen.items())]


def solution_budgets(max_turns: int, lengths: Sequence[int]) -> list[tuple[float, int]]:
    """The default grid where the environment's expert solved the tasks in ``lengths`` turns:
    its shortest solution, its median and the whole budget, as ``(fraction, turns)`` pairs
    (a budget below the shortest solution can only fail, whoever plays)."""
    ordered = sorted(min(max(1, n), max_turns) for n in lengths)
    picks = {ordered[0], ordered[(len(ordered) - 1) // 2], max_turns}
    return [(turns / max_turns, turns) for turns in sorted(picks)]


def expert_lengths(env_factory: Callable[[], Any], tasks: Sequence[str], seed: int) -> list[int]:
    """The turns the environment's expert (``info["expert_action"]``) takes to solve each task it
    solves; empty where it names no expert action or solves none."""
    from opd.rollout.references import expert_reference

    env = env_factory()
    try:
        references = [expert_reference(env, task, seed) for task in tasks]
    finally:
        env.close()
    return [len(r.actions) for r in references if r.success and r.actions]


@dataclass(frozen=True)
class GridSpec:
    """What ``opd eval`` plays: ``samples`` episodes of every task under each budget in
    ``budgets`` (``(fraction, turns)`` pairs), at ``temperature``."""

    samples: int
    budgets: list[tuple[float, int]]
    temperature: float
    seed: int = 0
    batch: int = 32  # episodes per engine call (and environment processes at once)
    confidence: float = 0.95
    resamples: int = 2000


Collect = Callable[[Any, list[str], float, int], list[Trajectory]]
"""``collect(env_factory, tasks, temperature, seed) -> trajectories``: one episode per task."""


def play_grid(collect: Collect, factory_for_budget: Callable[[int], Any], tasks: list[str], spec: GridSpec,
              advance: Callable[[int, float], None] = lambda n, cost: None) -> dict[int, list[tuple[int, Trajectory]]]:
    """Every ``(sample, trajectory)`` of every task under each budget, keyed by the budget's
    turns. Calls ``collect`` on chunks of ``spec.batch`` episodes; ``advance(n, turns)`` after
    each (``turns``: the budget, what an episode of it may cost)."""
    played: dict[int, list[tuple[int, Trajectory]]] = {}
    for b, (_, turns) in enumerate(spec.budgets):
        factory = factory_for_budget(turns)
        jobs = [(j, task) for j in range(spec.samples) for task in tasks]
        played[turns] = []
        for c in range(0, len(jobs), spec.batch):
            chunk = jobs[c:c + spec.batch]
            seed = spec.seed * 1_000_003 + b * 10_007 + c
            trajs = collect(factory, [task for _, task in chunk], spec.temperature, seed)
            played[turns] += [(j, traj) for (j, _), traj in zip(chunk, trajs)]
            advance(len(chunk), turns)
    return played


def summarise(played: dict[int, list[tuple[int, Trajectory]]], spec: GridSpec) -> dict[str, Any]:
    """The grid's numbers: ``by_budget`` (success, score, turns, invalid actions, end reasons)
    and ``pass_at_k`` (one entry per budget and k, with its interval)."""
    by_budget, grid = [], []
    for b, (fraction, turns) in enumerate(spec.budgets):
        episodes = [traj for _, traj in played[turns]]
        correct: Counter[str] = Counter()
        counted: Counter[str] = Counter()
        for traj in episodes:
            counted[traj.task] += 1
            correct[traj.task] += bool(traj.success)
        scores = [traj.turns[-1].info["score"] for traj in episodes
                  if traj.turns and isinstance(traj.turns[-1].info.get("score"), (int, float))]
        by_budget.append({
            "fraction": fraction, "turns": turns, "episodes": len(episodes),
            "success": sum(t.success for t in episodes) / max(len(episodes), 1),
            "score": sum(scores) / len(scores) if scores else None,
            "return": sum(t.total_reward for t in episodes) / max(len(episodes), 1),
            "mean_turns": sum(len(t.turns) for t in episodes) / max(len(episodes), 1),
            "invalid_actions": sum(not turn.info.get("valid_action", False) for t in episodes for turn in t.turns)
            / max(len(episodes), 1),
            "end_reasons": dict(Counter(t.end_reason for t in episodes)),
        })
        for k in range(1, spec.samples + 1):
            per_task = [pass_at_k(counted[task], correct[task], k) for task in counted]
            low, high = bootstrap_interval(per_task, spec.confidence, spec.resamples, seed=spec.seed + 31 * b + k)
            grid.append({"turns": turns, "fraction": fraction, "k": k,
                         "value": sum(per_task) / max(len(per_task), 1), "low": low, "high": high})
    return {"by_budget": by_budget, "pass_at_k": grid}


def shown_ks(samples: int) -> list[int]:
    """The ks a table shows: 1, 2, 4, … up to ``samples``, and ``samples`` itself."""
    ks = [k for k in (2 ** i for i in range(20)) if k <= samples]
    return ks + ([samples] if samples not in ks else [])


def render_grid(console: Any, result: dict[str, Any]) -> None:
    """The pass@k grid as a table (budgets × k, value and interval), then the per-budget
    figures."""
    from rich.table import Table

    from opd.evaluation.report import signed

    ks = shown_ks(result["samples"])
    table = Table(title=f"pass@k of {result['policy']} on {result['env']} ({result['split']}, {result['tasks']} tasks × "
                        f"{result['samples']} samples, T={result['temperature']:g}; "
                        f"{100 * result['confidence']:.0f}% bootstrap intervals over tasks)")
    table.add_column("turn budget")
    for k in ks:
        table.add_column(f"pass@{k}", justify="right")
    cells = {(row["turns"], row["k"]): row for row in result["pass_at_k"]}
    shortest = result.get("shortest_solution")
    for budget in result["by_budget"]:
        below = " [yellow]< shortest solution[/]" if shortest and budget["turns"] < shortest else ""
        table.add_row(f"{budget['turns']} ({100 * budget['fraction']:.0f}%){below}",
                      *(_cell(cells[budget["turns"], k]) for k in ks))
    console.print(table)
    if shortest and any(b["turns"] < shortest for b in result["by_budget"]):
        console.print(f"[yellow]a budget below {shortest} turns cannot succeed[/]: the environment's expert needs at "
                      f"least {shortest} on these tasks")
    detail = Table(title="per episode, by turn budget")
    for name in ("turn budget", "success", "score", "return", "turns", "invalid actions", "end reasons"):
        detail.add_column(name, justify="left" if name in ("turn budget", "end reasons") else "right")
    for b in result["by_budget"]:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(b["end_reasons"].items(), key=lambda kv: -kv[1]))
        detail.add_row(str(b["turns"]), f"{100 * b['success']:.1f}%", "n/a" if b["score"] is None else f"{b['score']:.2f}",
                       signed(b["return"]), f"{b['mean_turns']:.2f}", f"{b['invalid_actions']:.2f}", reasons)
    console.print(detail)


def _cell(row: dict[str, Any]) -> str:
    return f"{100 * row['value']:.1f}% [{100 * row['low']:.1f}, {100 * row['high']:.1f}]"


def plot_grid(result: dict[str, Any], path: Path) -> Path:
    """pass@k against k, one line per turn budget, with its interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for budget in result["by_budget"]:
        rows = [r for r in result["pass_at_k"] if r["turns"] == budget["turns"]]
        ks = [r["k"] for r in rows]
        line, = ax.plot(ks, [r["value"] for r in rows], marker="o",
                        label=f"{budget['turns']} turns ({100 * budget['fraction']:.0f}%)")
        ax.fill_between(ks, [r["low"] for r in rows], [r["high"] for r in rows], alpha=0.2, color=line.get_color())
    ax.set(xscale="log", xlabel="k (samples)", ylabel="pass@k", ylim=(0, 1.02),
           title=f"{result['name']}: pass@k by turn budget")
    ax.minorticks_off()  # a log axis would label 3x10^0 and 6x10^0 between the ks
    ax.set_xticks(shown_ks(result["samples"]), labels=[str(k) for k in shown_ks(result["samples"])])
    ax.legend(title="turn budget")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
