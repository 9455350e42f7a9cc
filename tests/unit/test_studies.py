"""experiments/fidelity.py: every study file binds (each arm's recipe plus overrides), a bad one is
refused naming its key, and the tables report what the runs measured."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from experiments import fidelity
from opd.config import load_config

STUDIES = fidelity.studies()
ARMS = [(study, arm) for study in STUDIES.values() for arm in study.arms]


def test_the_shipped_studies_are_all_there():
    assert set(STUDIES) == {"teachers", "loss", "view", "clinical_reward", "multiturn_rl", "smollm2", "pivot_ablation",
                            "curricula"}


@pytest.mark.parametrize("study,arm", ARMS, ids=[f"{s.name}:{a.group}:{a.label}" for s, a in ARMS])
def test_every_arm_binds(study, arm):
    overrides = fidelity.arm_overrides(study, arm)
    cfg = load_config(fidelity.RECIPES_DIR / arm.recipe, overrides)
    for override in overrides:  # the override took: the bound config holds the value
        key, value = override.split("=", 1)
        node = cfg
        for part in key.split("."):
            node = node[part] if isinstance(node, dict) else getattr(node, part)
        if value.startswith("["):  # a list of sections (losses): each given key holds its given value
            given = yaml.safe_load(value)
            assert len(node) == len(given)
            for section, entries in zip(node, given):
                assert {k: OmegaConf.to_container(section)[k] for k in entries} == entries
        elif isinstance(node, float):
            assert node == float(value)
        elif isinstance(node, bool):
            assert node is yaml.safe_load(value)
        else:
            assert str(node) == value


def test_arms_of_a_group_differ_only_in_their_overrides():
    for study in STUDIES.values():
        groups = {}
        for arm in study.arms:
            groups.setdefault(arm.group, set()).add(arm.recipe)
        assert all(len(recipes) == 1 for recipes in groups.values()), study.name


@pytest.mark.parametrize("text,message", [
    ("name: bad\nclaim: c\narms: [{label: a, recipe: r.yaml}]\nseed: [0]\n", "unknown key(s) seed"),
    ("name: bad\nclaim: c\narms: [{label: a, recipe: r.yaml, override: [x=1]}]\n", "arms[0]: unknown key(s) override"),
    ("name: bad\nclaim: c\narms: []\n", "at least one arm"),
    ("name: other\nclaim: c\narms: [{label: a, recipe: r.yaml}]\n", "the name its file has"),
])
def test_a_bad_study_file_is_refused_naming_the_key(tmp_path, text, message):
    path = tmp_path / "bad.study.yaml"
    path.write_text(text)
    with pytest.raises(fidelity.StudyError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        fidelity.Study.load(path)


def _record(group, arm, seed, teacher_success, before, after, **heldout):
    return {"group": group, "arm": arm, "seed": seed, "teacher": teacher_success, "before": before, "after": after,
            "train_time_s": 60.0, "steps": 10, "heldout": heldout, "wall_s": 90.0, "step_metrics": {}}


def test_the_arm_table_puts_each_arm_beside_the_teacher_and_the_student_before(tmp_path):
    study = STUDIES["clinical_reward"]
    results = [_record("refill", arm, s, 0.7, 0.3, after,
                       teacher={"value": 0.9, "questions_asked": 4.0},
                       student_before={"value": 0.1, "questions_asked": 0.5},
                       student_after={"value": value + s / 10, "questions_asked": q})
               for arm, after, value, q in (("outcome", 0.4, 0.2, 1.0), ("outcome_info_gain", 0.6, 0.5, 3.0))
               for s in (0, 1)]
    lines = fidelity.arm_table(study, results)
    assert lines[0] == ("| group | policy | seed 0 | seed 1 | success, mean | gain | value | questions_asked "
                        "| premature_commitment | high_risk_value |")
    assert lines[2] == "| refill | teacher |  |  | 70% |  | 0.9 | 4 |  |  |"
    assert lines[3] == "| refill | student before |  |  | 30% |  | 0.1 | 0.5 |  |  |"
    assert lines[4] == "| refill | outcome | 40% | 40% | **40%** | +10 pts | 0.25 | 1 |  |  |"
    assert lines[5] == "| refill | outcome_info_gain | 60% | 60% | **60%** | +30 pts | 0.55 | 3 |  |  |"
    text = fidelity.render(study, results, command="experiments/fidelity.py --study clinical_reward")
    assert "4 runs: 6 min of wall time in all" in text
    fidelity.write_plot(study, results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 5000


def test_the_step_metrics_table_averages_over_the_seeds_and_says_what_an_arm_does_not_log():
    study = STUDIES["pivot_ablation"]
    results = [{**_record("FrozenLake", "GRPO", s, 0.9, 0.2, 0.3), "step_metrics": {}} for s in (0, 1)]
    results += [{**_record("FrozenLake", "PivotOPD", s, 0.9, 0.2, 0.5),
                 "step_metrics": {"pivot/failures": 4.0 + s, "pivot/found_rate": 0.5}} for s in (0, 1)]
    lines = fidelity.step_metrics_table(study, results)
    grpo = next(line for line in lines if line.startswith("| FrozenLake | GRPO |"))
    pivot = next(line for line in lines if line.startswith("| FrozenLake | PivotOPD |"))
    assert grpo == "| FrozenLake | GRPO | " + " | ".join(["n/a"] * len(study.step_metrics)) + " |"
    assert pivot.startswith("| FrozenLake | PivotOPD | 4.5 | 0.5 | n/a |")


def _finished_run(tmp_path: Path, arm, seed: int, steps: int, after: float = 0.6) -> Path:
    run_dir = fidelity.run_dir_of(tmp_path, arm, seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({
        "teacher_success": 0.9, "student_success_before": 0.1, "student_success_after": after, "train_time_s": 12.0,
        "steps": steps, "heldout": {"teacher": {"return": 0.8}}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step_s": 2.0, "valid_action_rate": 0.5}) + "\n")
    return run_dir


def test_a_finished_run_is_read_not_rerun(tmp_path, monkeypatch):
    study = STUDIES["teachers"]
    arm = study.arms[0]
    steps = load_config(fidelity.RECIPES_DIR / arm.recipe).run.total_steps
    _finished_run(tmp_path, arm, 3, steps)
    monkeypatch.setattr(fidelity.subprocess, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    record = fidelity.run_arm(study, arm, 3, tmp_path, None, [])
    assert (record["teacher"], record["before"], record["after"], record["heldout"]["teacher"]["return"]) == (0.9, 0.1, 0.6, 0.8)
    assert record["per_step"] == {"step_s": 2.0, "valid_action_first": 0.5, "valid_action_last": 0.5}
    assert math.isnan(record["wall_s"])  # no cost file: the run's cost is unknown, not zero


def test_a_run_shorter_than_its_recipe_now_asks_goes_on_from_its_checkpoint(tmp_path, monkeypatch):
    """A recipe's total_steps raised after a study ran: the finished run is resumed (opd train
    --resume, the same run directory, the study's arm overrides), not started again, and the
    study's wall time adds the two parts."""
    study = STUDIES["pivot_ablation"]  # its study-wide override, run.total_steps=60, reaches the run
    arm = study.arms[0]
    run_dir = _finished_run(tmp_path, arm, 0, 20, after=0.1)
    run_dir.with_name(run_dir.name + ".cost.json").write_text(json.dumps({"wall_s": 100.0}))
    calls = []

    def opd_train(cmd, **kwargs):  # stands in for the opd process: it would train for minutes
        calls.append(cmd)
        _finished_run(tmp_path, arm, 0, 60, after=0.7)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(fidelity.subprocess, "run", opd_train)
    record = fidelity.run_arm(study, arm, 0, tmp_path, None, [])
    assert len(calls) == 1 and calls[0][-1] == "--resume" and f"run.output_dir={run_dir}" in calls[0]
    assert calls[0][:4] == [*fidelity.OPD, "train"] and "run.total_steps=60" in calls[0] and "algorithm=grpo" in calls[0]
    assert record["after"] == 0.7 and record["steps"] == 60
    assert record["wall_s"] > 100.0  # the first part's time and the resumed part's
    fidelity.run_arm(study, arm, 0, tmp_path, None, [])
    assert len(calls) == 1  # now as long as asked: read, not run


def test_grid_tables_put_base_beside_trained_per_budget_and_state_kind(tmp_path):
    """The multiturn_rl study's tables from opd eval's and opd compare's result files."""
    study = STUDIES["multiturn_rl"]
    records = []
    for seed, (base, trained, better) in enumerate([(0.5, 0.75, 0.25), (0.25, 0.25, 0.5)]):
        run_dir = tmp_path / f"r{seed}"
        (run_dir / "eval").mkdir(parents=True)
        for who, value in (("base", base), ("trained", trained)):
            entries = [{"turns": t, "fraction": f, "k": k, "value": value + (0.1 if k == 4 else 0.0), "low": 0, "high": 1}
                       for t, f in ((4, 0.5), (8, 1.0)) for k in (1, 2, 3, 4)]
            (run_dir / "eval" / f"{who}.json").write_text(json.dumps({"pass_at_k": entries}))
        share = {"better": better, "equal": 1 - better, "worse": 0.0, "n": 10}
        empty = {"better": 0.0, "equal": 0.0, "worse": 0.0, "n": 0}
        (run_dir / "eval" / "compare_base_vs_trained.json").write_text(json.dumps({
            "overall": share, "by_stage": {"early": share, "middle": share, "late": empty},
            "by_recovery": {"error_recovery": share, "on_track": empty}}))
        records.append({"group": "FrozenLake", "seed": seed, "grid": fidelity.read_grid(run_dir)})
    assert study.grid is not None and study.grid.samples == 4
    lines = fidelity.grid_tables(study.grid, records)
    row = next(line for line in lines if line.startswith("| FrozenLake | 0.5 | 1 |"))
    assert row == "| FrozenLake | 0.5 | 1 | 38% (50%, 25%) | 50% (75%, 25%) | +12 pts |"
    assert not any(line.startswith("| FrozenLake | 0.5 | 2 |") for line in lines)  # only k = 1 and k = samples
    assert any(line.startswith("| FrozenLake | 1 | 4 | 48% (60%, 35%)") for line in lines)
    recovery = next(line for line in lines if line.startswith("| FrozenLake | error recovery |"))
    assert recovery == "| FrozenLake | error recovery | 20 | 38% (25%, 50%) | 62% (75%, 50%) | 0% (0%, 0%) | 100% |"
    late = next(line for line in lines if line.startswith("| FrozenLake | stage: late |"))
    assert late.endswith("| 0 | n/a | n/a | n/a | n/a |")


def test_per_step_reads_cost_and_memory_from_the_training_steps():
    steps = [{"step": 1, "time/step_s": 30.0, "teacher_payload_mb": 0.5, "memory/trainer_peak_rss_mb": 2000.0,
              "memory/driver_peak_rss_mb": 700.0, "valid_action_rate": 0.1},
             {"step": 2, "time/step_s": 10.0, "teacher_payload_mb": 0.7, "memory/trainer_peak_rss_mb": 2500.0,
              "memory/driver_peak_rss_mb": 650.0, "valid_action_rate": 0.2},
             {"step": 3, "time/step_s": 20.0, "teacher_payload_mb": 0.6, "memory/trainer_peak_rss_mb": 2400.0,
              "memory/driver_peak_rss_mb": 690.0, "valid_action_rate": 0.6}]
    got = fidelity.per_step(steps)
    assert got == {"step_s": 20.0, "teacher_payload_mb": 0.6, "trainer_peak_rss_mb": 2500.0, "driver_peak_rss_mb": 700.0,
                   "valid_action_first": 0.1, "valid_action_last": 0.6}
    line = fidelity.step_table([{"group": "SQL", "seed": 0, "per_step": got}])[-1]
    assert line == "| SQL | 0 | 20.0 s | 0.6 MiB | 2,500 MiB | 700 MiB | 10% → 60% |"
    assert fidelity.per_step([]) == {}


def test_better_of_differing_states_pools_the_seeds_by_their_state_counts():
    parts = [{"better": 0.2, "equal": 0.6, "worse": 0.2, "n": 10}, {"better": 0.5, "equal": 0.0, "worse": 0.5, "n": 30}]
    empty = {"better": 0.0, "equal": 0.0, "worse": 0.0, "n": 0}
    records = [{"group": "G", "seed": s, "grid": {"pass_at_k": {}, "compare": {"all": p, "stage: late": empty}}}
               for s, p in enumerate(parts)]
    grid = fidelity.Grid()
    row = next(line for line in fidelity.grid_tables(grid, records) if line.startswith("| G | all |"))
    assert row.endswith("| 50% |")  # (2 + 15) better of (2 + 15) + (2 + 15) differing
    records[1]["grid"]["compare"]["all"] = {"better": 0.1, "equal": 0.0, "worse": 0.9, "n": 30}
    row = next(line for line in fidelity.grid_tables(grid, records) if line.startswith("| G | all |"))
    assert row.endswith("| 15% |")  # (2 + 3) of (2 + 3) + (2 + 27): 5 of 34


def test_a_staged_teacher_goes_on_from_each_stage_and_teaches_the_chosen_stage(monkeypatch, tmp_path):
    """ALFWorld's teacher is three SFT stages: each stage binds with the arm's overrides, starts from
    the stage before (bootstrap.init) in the first stage's tokenizer, and the run gets the last stage
    as teacher and ``student_stage`` as student. The builds stand in for minutes of SFT."""
    study = STUDIES["teachers"]
    arm = next(a for a in study.arms if a.teacher_stages)
    built = []

    def build(model_cfg, env_cfg, seed, log):
        boot = model_cfg.bootstrap
        built.append((boot.init, boot.tokenizer, boot.n_episodes, boot.sft_steps, boot.learning_rate, boot.seed,
                      dict(env_cfg.kwargs)))
        directory = tmp_path / f"stage{len(built)}"
        directory.mkdir()
        for name in ("tokenizer.json", "config.json"):
            (directory / name).write_text("{}")
        return str(directory)

    monkeypatch.setattr("opd.bootstrap.resolve_model_path", build)
    models = fidelity.staged_models(study, arm, ["env.kwargs.max_turns=20"])
    stage1, stage2, stage3 = (str(tmp_path / f"stage{i}") for i in (1, 2, 3))
    assert [b[:6] for b in built] == [("", "", 960, 500, 1e-3, 0), (stage1, stage1, 1920, 750, 5e-4, 0),
                                      (stage2, stage1, 1920, 750, 3e-4, 1)]
    assert all(b[6]["vary_train_rooms"] is True and b[6]["show_admissible"] is False and b[6]["max_turns"] == 20
               for b in built)
    assert models == [f"teacher.path={stage3}", "teacher.bootstrap=null", f"student.path={stage1}", "student.bootstrap=null"]
    cfg = load_config(fidelity.RECIPES_DIR / arm.recipe, [*arm.overrides, *models])
    assert (cfg.teacher.path, cfg.teacher.bootstrap, cfg.student.path) == (stage3, None, stage1)


def test_the_shared_student_study_keeps_lifts_apart_per_environment_and_seed():
    """experiments/shared_student.py's table: the single and mixed lifts from each run's summary,
    the share kept (mean and per seed), and no share where the single teacher lifted nothing."""
    from experiments import shared_student

    def single(before, after):
        return {"teacher_success": 0.9, "student_success_before": before, "student_success_after": after}

    def mixed(lake_after, simon_after):
        return {"by_environment": {"lake": {"teacher": 0.9, "student_before": 0.1, "student_after": lake_after},
                                   "simon": {"teacher": 1.0, "student_before": 0.0, "student_after": simon_after}}}

    records = [{"label": "mixed", "seed": 0, "summary": mixed(0.5, 0.0)},
               {"label": "mixed", "seed": 1, "summary": mixed(0.3, 0.0)},
               {"label": "lake", "seed": 0, "summary": single(0.1, 0.6)},
               {"label": "lake", "seed": 1, "summary": single(0.1, 0.5)},
               {"label": "simon", "seed": 0, "summary": single(0.0, 0.0)},
               {"label": "simon", "seed": 1, "summary": single(0.0, 0.0)}]
    rows, md = shared_student.table(records, ["lake", "simon"], [0, 1])
    lake, simon = rows
    assert lake["single_lift"] == pytest.approx(0.45) and lake["mixed_lift"] == pytest.approx(0.3)
    assert lake["kept"] == pytest.approx(0.3 / 0.45)
    assert lake["kept_per_seed"] == [pytest.approx(0.4 / 0.5), pytest.approx(0.2 / 0.4)]
    assert simon["kept"] is None and simon["kept_per_seed"] == [None, None]
    assert "| lake | 90% | 10% | 60%, 50% | 50%, 30% | +45 pts | +30 pts | **67%** (80%, 50%) | not met |" in md
