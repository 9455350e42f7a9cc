"""``opd eval`` and ``opd compare`` through the CLI on the tiny recipe's bootstrapped models
(real engines, the real environment pool, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd.evaluation.passk import pass_at_k

pytestmark = pytest.mark.integration

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def _cache(tmp_path: Path) -> list[str]:
    cache = tmp_path.parent / "cache"
    return [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]


def test_eval_writes_the_pass_at_k_grid_the_plot_and_the_episodes(tmp_path, capsys):
    from opd.cli import main
    from opd.evaluation.trajectories import read_episodes

    out = tmp_path / "eval"
    code = main(["eval", f"{TINY}@teacher", *_cache(tmp_path), "--samples", "3", "--tasks", "4", "--budgets",
                 "0.5,1", "--out", str(out), "--name", "teacher"])
    assert code == 0, capsys.readouterr().out
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "pass@2" in printed and "turn budget" in printed
    result = json.loads((out / "teacher.json").read_text())
    assert result["budgets"] == [{"fraction": 0.5, "turns": 3}, {"fraction": 1.0, "turns": 6}]  # tiny.yaml: max_turns 6
    assert (result["tasks"], result["samples"], result["policy"]) == (4, 3, f"teacher of {TINY}")
    assert [(r["turns"], r["k"]) for r in result["pass_at_k"]] == [(t, k) for t in (3, 6) for k in (1, 2, 3)]
    episodes = read_episodes(out / result["episodes"])
    assert len(episodes) == 4 * 3 * 2
    for turns in (3, 6):
        rows = [e for e in episodes if e["turn_budget"] == turns]
        assert sorted({e["sample"] for e in rows}) == [0, 1, 2] and all(len(e["turns"]) <= turns for e in rows)
        # The grid's numbers are the unbiased estimator over the episodes written beside it.
        for k in (1, 2, 3):
            per_task = [pass_at_k(3, sum(e["success"] for e in rows if e["task"] == task), k) for task in {e["task"] for e in rows}]
            cell = next(r for r in result["pass_at_k"] if r["turns"] == turns and r["k"] == k)
            assert abs(cell["value"] - sum(per_task) / len(per_task)) < 1e-12 and cell["low"] <= cell["value"] <= cell["high"]
        budget = next(b for b in result["by_budget"] if b["turns"] == turns)
        assert budget["success"] == sum(e["success"] for e in rows) / len(rows)
        assert sum(budget["end_reasons"].values()) == len(rows)
    assert (out / "teacher.png").stat().st_size > 5000


def test_eval_picks_its_default_budgets_from_the_experts_solutions(tmp_path, capsys, monkeypatch):
    """Issue 54, item 2: without --budgets, the grid is the expert's shortest and median solution
    and the whole budget (no budget every policy must fail), said on the console and in the JSON."""
    from opd.cli import main
    from opd.config import load_config
    from opd.envs import EnvFactory
    from opd.evaluation.passk import expert_lengths, solution_budgets

    monkeypatch.setenv("COLUMNS", "400")  # rich would wrap the line checked below
    out = tmp_path / "eval"
    assert main(["eval", f"{TINY}@teacher", *_cache(tmp_path), "--samples", "2", "--tasks", "4", "--out", str(out),
                 "--name", "default"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    cfg = load_config(TINY)
    tasks = EnvFactory.of(cfg.env)().unwrapped.task_ids(cfg.env.eval_split)[:4]
    lengths = expert_lengths(EnvFactory.of(cfg.env), tasks, cfg.run.seed)
    result = json.loads((out / "default.json").read_text())
    assert result["shortest_solution"] == min(lengths)
    assert [(b["fraction"], b["turns"]) for b in result["budgets"]] == solution_budgets(6, lengths)
    assert f"the environment's expert solves 4 of the 4 tasks in {min(lengths)} to {max(lengths)} turns" in printed
    assert "< shortest solution" not in printed


def test_compare_reports_matched_states_and_refuses_a_bad_source(tmp_path, capsys):
    from opd.cli import main

    out = tmp_path / "eval"
    code = main(["compare", f"{TINY}@student", f"{TINY}@teacher", *_cache(tmp_path), "--tasks", "4", "--out", str(out),
                 "--name", "t_vs_s"])
    assert code == 0, capsys.readouterr().out
    assert "B better" in capsys.readouterr().out
    result = json.loads((out / "compare_t_vs_s.json").read_text())
    assert result["episodes"] == 4 and result["states"] == len(result["records"]) == result["overall"]["n"] > 0
    for group in [result["overall"], *result["by_stage"].values(), *result["by_recovery"].values()]:
        if group["n"]:
            assert abs(group["better"] + group["equal"] + group["worse"] - 1.0) < 1e-9
    assert sum(g["n"] for g in result["by_recovery"].values()) == result["states"]
    for record in result["records"]:
        assert (record["verdict"] == "equal") if record["action_a"] == record["action_b"] else record["verdict"] in {
            "better", "equal", "worse"}

    assert main(["eval", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "is not a run directory" in capsys.readouterr().out
    assert main(["eval", f"{TINY}@teacher", *_cache(tmp_path), "--budgets", "0,1"]) == 2
    assert "fractions of the environment's turn budget in (0, 1]" in capsys.readouterr().out
