"""RunDir, the one reader of a run directory: what it reads from each file, and what it does with a
line a kill cut short, a file not written yet, and eval/ results."""

from __future__ import annotations

import json

import pytest

from opd.evaluation.run_dir import RunDir, parse_metrics_line

STEPS = [{"step": s, "loss": 1.0 / s, "time/generation_s": 1.0, "time/teacher_scoring_s": 0.5, "time/training_s": 2.0 * s,
          "time/weight_sync_s": 0.1, "time/step_s": 3.6 + s} for s in (1, 2)]


@pytest.fixture
def run(tmp_path) -> RunDir:
    (tmp_path / "config.yaml").write_text("name: r\nalgorithm: grpo\nenv: {id: opd/FrozenLakeText-v0}\n")
    lines = [json.dumps({"step": 0, "eval/student_success": 0.25, "eval/teacher_success": 0.75}),
             *(json.dumps(r) for r in STEPS), json.dumps({"step": 2, "eval/student_success": 0.5}), '{"step": 3, "loss": 0.']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))  # the last line cut short by a kill
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "base.json").write_text(json.dumps({"name": "base"}))
    (tmp_path / "eval" / "broken.json").write_text("{")
    return RunDir(tmp_path)


def test_it_reads_every_file_and_skips_a_line_cut_short(run):
    assert run.is_run() and run.config()["algorithm"] == "grpo"
    assert [r["step"] for r in run.metrics()] == [0, 1, 2, 2]
    assert run.steps() == STEPS
    assert [r["step"] for r in run.evaluations()] == [0, 2]
    assert run.series("eval/student_success") == [(0.0, 0.25), (2.0, 0.5)]
    assert [(p.name, d) for p, d in run.eval_results()] == [("base.json", {"name": "base"})]
    assert run.summary() is None and run.checkpoints() == [] and run.episode_files() == []


def test_the_time_split_is_the_mean_of_each_phase_over_the_steps(run):
    assert run.time_split() == pytest.approx({"generation_s_per_step": 1.0, "teacher_scoring_s_per_step": 0.5,
                                              "training_s_per_step": 3.0, "weight_sync_s_per_step": 0.1,
                                              "step_s_per_step": 5.1})


def test_a_directory_not_written_yet_reads_as_empty(tmp_path):
    run = RunDir(tmp_path / "missing")
    assert not run.is_run() and run.config() == {} and run.metrics() == [] and run.summary() is None
    assert run.time_split()["step_s_per_step"] == 0.0


@pytest.mark.parametrize("line,record", [
    ('{"step": 4, "loss": 1.5}', {"step": 4, "loss": 1.5}),
    ("", None), ('{"loss": 1.0}', None), ('{"step": true}', None), ('{"step": NaN}', None), ("[1, 2]", None),
    ('{"step": 1', None),
])
def test_a_metrics_line_is_a_record_with_a_numeric_step_or_nothing(line, record):
    assert parse_metrics_line(line) == record
