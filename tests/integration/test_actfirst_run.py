"""A two-step ActFirst-OPD run through the real CLI: Ray actors, DeepSpeed (CPU, gloo), tiny
bootstrapped Qwen3s with ``<think>`` plans, FrozenLake's engine, references built on first use.
Then one step of the "w/o ID" ablation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
RECIPE = Path(__file__).resolve().parents[1] / "data" / "actfirst_tiny.yaml"


@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    ray.shutdown()


def _steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in r]


def test_actfirst_two_steps_and_the_ablation(tmp_path, ray_session):
    from opd.cli import main

    cache = tmp_path / "cache" / "bootstrap"
    common = [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]
    assert main(["train", str(RECIPE), f"run.output_dir={tmp_path / 'run'}", *common]) == 0
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["nonfinite_loss"] == 0.0 and r["reverse_kl_per_token"] > 0
        # One full response added while its episode lived per turn; one packed row per episode.
        assert r["turns_per_episode"] * 8 == r["actfirst/full_requests"] and r["train_rows"] == 8
        assert r["actfirst/late_full_requests"] == 0.0
        # Every episode starts aligned with its expert reference: turn 0's prompt shows o_ref(1).
        assert r["actfirst/reference_prompt_share"] >= 1 / r["turns_per_episode"] - 1e-9
        assert 0.0 <= r["actfirst/alignment_rate"] <= r["actfirst/alignment_rate_turn_0"] <= 1.0
        T, l_fast, l_full = r["actfirst/turns"], r["latency/fast_s"], r["latency/full_s"]
        assert 0 < l_fast < l_full  # 4-token actions against 16-token think-then-act responses
        assert r["actfirst/s_ideal"] == pytest.approx(T * l_full / ((T - 1) * l_fast + l_full))
        assert r["time/generation_s"] >= r["time/critical_path_s"] > 0
        assert r["actfirst/stream_rows_mean"] > 8  # full responses shared the fast turns' decode steps
        assert r["train_tokens"] == r["actfirst/full_tokens"]  # the loss covers the full responses only
    assert steps[0]["time/references_s"] > steps[1]["time/references_s"]  # built in step 1, read in step 2
    assert steps[1]["loss"] != steps[0]["loss"]
    # The anchor: step 1 trains the starting weights themselves, step 2 a student that has moved.
    assert steps[0]["reference_kl/kl"] == pytest.approx(0.0, abs=1e-6) and steps[1]["reference_kl/kl"] > 1e-6
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"eval/teacher_success", "eval/student_success"} <= set(records[0])  # evaluation: the driver's own
    stored = list((tmp_path / "cache" / "references").glob("*/opd_references.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["kept"] == 64

    # The "w/o ID" ablation: no reference prompt at all, hence no alignment to report.
    assert main(["train", str(RECIPE), f"run.output_dir={tmp_path / 'ablation'}", *common,
                 "actfirst.inverse_dynamics=false", "run.total_steps=1"]) == 0
    (ablation,) = _steps(tmp_path / "ablation")
    assert ablation["actfirst/reference_prompt_share"] == 0.0 and "actfirst/alignment_rate" not in ablation
    assert ablation["train_rows"] == 8 and math.isfinite(ablation["loss"])
