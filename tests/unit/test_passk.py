"""pass@k, its intervals and the turn-budget grid, against brute force and a real environment."""

from __future__ import annotations

import itertools
import math

import pytest

from opd.envs import EnvFactory
from opd.evaluation.passk import (GridSpec, bootstrap_interval, budget_turns, expert_lengths, pass_at_k, play_grid,
                                  render_grid, shown_ks, solution_budgets, summarise)
from opd.trajectory import Trajectory, Turn


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_success(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_tasks():
    values = [0.0, 1.0] * 10
    low, high = bootstrap_interval(values, 0.95, 2000, seed=1)
    assert low < 0.5 < high
    wide = high - low
    low4, high4 = bootstrap_interval(values * 4, 0.95, 2000, seed=1)
    assert low4 < 0.5 < high4 and high4 - low4 < wide * 0.7  # about half as wide with 4x the tasks
    assert bootstrap_interval([0.3] * 7) == pytest.approx((0.3, 0.3))
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)  # seeded


def test_budgets_are_whole_turns_without_repeats():
    assert budget_turns(8, [1.0, 0.25, 0.5]) == [(0.25, 2), (0.5, 4), (1.0, 8)]
    assert budget_turns(2, [0.1, 0.25, 0.5, 1.0]) == [(0.1, 1), (1.0, 2)]  # 0.1, 0.25 and 0.5 of 2 turns are 1 turn
    assert shown_ks(8) == [1, 2, 4, 8] and shown_ks(6) == [1, 2, 4, 6]


def _traj(task: str, success: bool, turns: int = 1) -> Trajectory:
    return Trajectory(task=task, turns=[Turn([], [1], [0.0], info={"valid_action": True})] * turns, success=success,
                      end_reason="success" if success else "truncated")


def test_summarise_averages_each_tasks_unbiased_estimate():
    # Task a: 3 of 4 samples succeed; task b: 0 of 4; task c: 4 of 4.
    counts = {"a": 3, "b": 0, "c": 4}
    played = {5: [(j, _traj(task, j < c)) for task, c in counts.items() for j in range(4)]}
    spec = GridSpec(samples=4, budgets=[(1.0, 5)], temperature=1.0)
    result = summarise(played, spec)
    for row in result["pass_at_k"]:
        expected = sum(pass_at_k(4, c, row["k"]) for c in counts.values()) / 3
        assert row["value"] == pytest.approx(expected)
        assert row["low"] <= row["value"] <= row["high"]
    assert [r["value"] for r in result["pass_at_k"]] == sorted(r["value"] for r in result["pass_at_k"])
    budget = result["by_budget"][0]
    assert budget["success"] == pytest.approx(7 / 12) and budget["end_reasons"] == {"success": 7, "truncated": 5}


def test_each_budget_is_played_for_real_under_its_own_turn_limit():
    """The expert solves a FrozenLake task within a budget exactly when its path fits in it:
    the grid makes the environment with ``max_turns=budget``, it does not cut longer episodes."""
    base = {"map_size": 4, "max_turns": 8, "n_eval_tasks": 12}
    tasks = EnvFactory("opd/FrozenLakeText-v0", base)().unwrapped.task_ids("eval")

    def expert_collect(factory, task_list, temperature, seed):
        trajs = []
        for task in task_list:
            env = factory()
            _, info = env.reset(seed=seed, options={"task": task})
            traj, done = Trajectory(task=task), False
            while not done:
                _, reward, term, trunc, info = env.step(info["expert_action"])
                traj.turns.append(Turn([], [1], [0.0], reward=reward, info={"valid_action": True}))
                done = term or trunc
            traj.success = bool(info["success"])
            traj.end_reason = "success" if traj.success else "truncated"
            trajs.append(traj)
        return trajs

    spec = GridSpec(samples=2, budgets=budget_turns(8, [0.25, 0.5, 1.0]), temperature=0.0, batch=5)
    advanced = []
    played = play_grid(expert_collect, lambda turns: EnvFactory("opd/FrozenLakeText-v0", {**base, "max_turns": turns}),
                       tasks, spec, lambda n, cost: advanced.append((n, cost)))
    assert sum(n for n, _ in advanced) == len(tasks) * 2 * 3
    # Each chunk's cost is its budget's turns: what the time left of `opd eval` weighs it by.
    assert sum(n * cost for n, cost in advanced) == len(tasks) * 2 * (2 + 4 + 8)
    full = {traj.task: len(traj.turns) for _, traj in played[8] if traj.success}
    assert len(full) == len(tasks)  # the expert solves every task given its whole budget
    for turns in (2, 4):
        for _, traj in played[turns]:
            assert len(traj.turns) <= turns
            assert traj.success == (full[traj.task] <= turns), (turns, traj.task, full[traj.task])
    shares = [summarise(played, spec)["by_budget"][b]["success"] for b in range(3)]
    assert shares[0] <= shares[1] < shares[2] == 1.0 and not math.isnan(shares[0])


def test_default_budgets_come_from_the_experts_solutions_and_a_budget_below_them_is_flagged():
    """Issue 54, item 2: the quickstart's FrozenLake needs at least 6 moves, so budgets of 2 and 4
    turns (0.25 and 0.5 of 8) were 0% for every policy. The default grid is the expert's shortest
    and median solution and the whole budget; a budget given below the shortest is flagged."""
    import io

    from rich.console import Console

    base = {"map_size": 4, "max_turns": 8, "n_eval_tasks": 12}
    factory = EnvFactory("opd/FrozenLakeText-v0", base)
    tasks = factory().unwrapped.task_ids("eval")
    lengths = expert_lengths(factory, tasks, seed=0)
    assert len(lengths) == len(tasks) and all(1 <= n <= 8 for n in lengths)
    ordered = sorted(lengths)
    grid = solution_budgets(8, lengths)
    assert [t for _, t in grid] == sorted({ordered[0], ordered[(len(ordered) - 1) // 2], 8})
    assert all(f == t / 8 for f, t in grid)
    assert solution_budgets(6, [3, 9, 9]) == [(0.5, 3), (1.0, 6)]  # capped at the budget, no repeats
    assert expert_lengths(EnvFactory("opd/PromptDataset-v0", {"path": "environments/prompt_data/arith_tiny.jsonl"}),
                          ["row-00000"], 0) == [1]  # a prompt dataset: one answer, one turn

    result = {"policy": "p", "env": "e", "split": "eval", "tasks": 2, "samples": 1, "temperature": 1.0,
              "confidence": 0.95, "shortest_solution": 6, "pass_at_k": [
                  {"turns": t, "k": 1, "value": v, "low": v, "high": v} for t, v in ((2, 0.0), (8, 0.5))],
              "by_budget": [{"turns": t, "fraction": t / 8, "success": v, "score": None, "return": r, "mean_turns": t,
                             "invalid_actions": 0.0, "end_reasons": {}} for t, v, r in ((2, 0.0, -0.001), (8, 0.5, 0.5))]}
    console = Console(file=io.StringIO(), width=200, color_system=None)
    render_grid(console, result)
    shown = console.file.getvalue()
    assert "2 (25%) < shortest solution" in shown and "8 (100%) <" not in shown
    assert "a budget below 6 turns cannot succeed" in shown
    assert "-0.00" not in shown and " 0.00 " in shown  # a return that rounds to zero has no sign
