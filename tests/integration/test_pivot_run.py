"""PivotOPD and GRPO end to end through real Ray actors and DeepSpeed, on tiny models.

The tiny teacher cannot write a judgement, so the judge run also shows the fallback at work:
every answer fails to parse, is counted, and a heuristic pivot is used instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
PIVOT = Path(__file__).resolve().parents[1] / "data" / "pivot_tiny.yaml"


@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    ray.shutdown()


def _steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in r]


def _args(tmp_path, name, *extra):
    cache = tmp_path.parent / "cache"
    return [str(PIVOT), f"run.output_dir={tmp_path / name}", f"student.bootstrap.cache_dir={cache}",
            f"teacher.bootstrap.cache_dir={cache}", *extra]


def test_pivot_opd_two_steps_with_the_judge_and_its_fallback(tmp_path, ray_session):
    from opd.cli import main

    assert main(["train", *_args(tmp_path, "pivot", "pivot.finder=judge", "pivot.judge_max_new_tokens=24")]) == 0
    steps = _steps(tmp_path / "pivot")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["pivot/failures"] > 0  # a random-move student fails most maps
        assert r["pivot/judge_parse_failure_rate"] == 1.0  # a 0.1M-parameter teacher writes no JSON...
        assert r["pivot/found_rate"] == 1.0  # ...so the teacher-logprob fallback names every pivot
        assert 0.0 <= r["pivot/mean_turn"] < 6
        assert r["pivot_preventive/tokens"] > 0
        for key in ("loss/ppo_clip", "loss/pivot_preventive", "loss/pivot_recovery", "pivot_preventive/reverse_kl"):
            assert math.isfinite(r[key]), key
    # Recovery rows exist where an episode went on after its pivot, and their loss is live.
    assert sum(r["pivot/recovery_rows"] for r in steps) > 0
    assert any(r["pivot_recovery/forward_kl"] > 0 for r in steps)
    summary = json.loads((tmp_path / "pivot" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_grpo_two_steps_without_the_teacher(tmp_path, ray_session):
    from opd.cli import main

    assert main(["train", *_args(tmp_path, "grpo", "algorithm=grpo", "losses=[{name: ppo_clip}]")]) == 0
    steps = _steps(tmp_path / "grpo")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["time/teacher_scoring_s"] == 0.0 and "pivot/failures" not in r
        assert math.isfinite(r["loss/ppo_clip"]) and r["ppo_clip/advantage_mean"] == pytest.approx(0.0, abs=1e-5)


def test_grpo_refuses_losses_that_need_the_teacher(tmp_path, capsys):
    from opd.cli import main

    assert main(["train", *_args(tmp_path, "bad", "algorithm=grpo", "losses=[{name: reverse_kl}]")]) == 2
    assert "need the teacher's grades" in capsys.readouterr().out
