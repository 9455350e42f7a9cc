"""``scripts/gpu_check.py --allow-cpu``: the GPU check runs on CPU as it would on a bare GPU machine.

The script runs in a child where Ray cannot be imported and DeepSpeed, vLLM and the packages a
run can do without (:mod:`opd.optional`) are absent, as on a machine with only torch,
transformers and ``scripts/gpu_check-requirements.txt``. Every part must pass and report figures
that make sense; the part that needs DeepSpeed is skipped, saying so, and runs in a second child
where DeepSpeed is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BARE = "deepspeed vllm pyarrow matplotlib tensorboard datasets pandas psutil mlflow wandb scipy"

CHILD = """
import os, runpy, sys
for name in os.environ.get("OPD_TEST_REFUSE", "").split():
    sys.modules[name] = None  # absent: find_spec answers None, an import fails
class NoRay:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
        return None
sys.meta_path.insert(0, NoRay)
sys.argv = ["scripts/gpu_check.py", *sys.argv[1:]]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def _check(out: Path, cache: Path, refuse: str, *args: str) -> dict:
    import os

    proc = subprocess.run([sys.executable, "-c", CHILD, "--allow-cpu", "--quick", "--out", str(out),
                           "--cache", str(cache), *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OPD_TEST_REFUSE": refuse})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> dict:
    cache = tmp_path_factory.getbasetemp() / "cache"  # the bootstrap cache the integration tests share
    return _check(tmp_path_factory.mktemp("gpu_check"), cache, BARE)


def test_every_part_passes_with_only_torch_transformers_and_small_packages(bare):
    assert bare["device"] == "cpu" and bare["quick"] is True
    assert set(bare["absent"]) >= {"ray", "deepspeed", "vllm", "pyarrow", "datasets", "matplotlib", "tensorboard"}
    assert {"ray", "deepspeed", "vllm", "pyarrow"}.isdisjoint(n.lower() for n in bare["imported_distributions"])
    assert [bare["parts"][p]["ok"] for p in ("quickstart", "actfirst", "mfu")] == [True, True, True]
    assert bare["parts"]["deepspeed_zero"] == {"ok": None, "skipped": "DeepSpeed is not installed"}


def test_the_quickstart_part_trains_on_the_torch_engine(bare):
    quick = bare["parts"]["quickstart"]
    assert quick["steps"] == 2 and quick["losses_finite"] and all(loss > 0 for loss in quick["losses"])
    assert quick["checkpoint_state"] == ["COMPLETE", "hf", "torch", "trainer.json"]  # the torch engine's state, no DeepSpeed
    split = quick["median_time_split_s"]
    assert 0 < split["time/training_s"] < split["time/step_s"] and split["time/generation_s"] > 0
    assert 0.0 <= quick["student_success_after"] <= 1.0


def test_the_actfirst_part_compares_decode_steps(bare):
    act = bare["parts"]["actfirst"]
    assert act["updates"] == 1 and act["s_ideal"] > 1
    assert act["decode_rows_mean"]["actfirst"] > act["decode_rows_mean"]["vanilla"] > 0  # fewer, wider steps
    assert act["wide_over_narrow_step_cost"] == pytest.approx(
        act["decode_step_ms"]["actfirst"] / act["decode_step_ms"]["vanilla"])
    assert act["wall_clock_ratio"] > 0 and act["rollout_ratio"] > 0


def test_the_mfu_part_counts_flops_against_a_measured_peak(bare):
    mfu = bare["parts"]["mfu"]
    assert mfu["dtype"] == "float32" and mfu["layers"] == 2
    assert mfu["achieved_tflops"] == pytest.approx(mfu["gflop_per_step"] / 1e3 / mfu["step_s"])
    assert 0 < mfu["mfu"] < 1 and mfu["mfu"] == pytest.approx(mfu["achieved_tflops"] / mfu["peak_tflops"])


def test_the_deepspeed_part_runs_where_deepspeed_is_installed(tmp_path_factory):
    report = _check(tmp_path_factory.mktemp("gpu_check_ds"), tmp_path_factory.getbasetemp() / "cache", "",
                    "--parts", "deepspeed_zero")
    part = report["parts"]["deepspeed_zero"]
    assert part["ok"] is True
    for stage in ("zero0", "zero3"):
        assert part[stage]["weights_equal_after_sync"] and part[stage]["trainer_device"] == "cpu"
        assert all(loss == loss for loss in part[stage]["losses"])


def test_the_requirements_file_pins_what_the_cpu_install_resolves():
    pins = [line.split("==") for line in (ROOT / "scripts" / "gpu_check-requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert len(pins) >= 5
    for name, version in pins:
        assert importlib.metadata.version(name) == version, name
