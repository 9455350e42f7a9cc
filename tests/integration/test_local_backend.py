"""``run.backend: local`` (:mod:`opd.runtime.local`): the tiny recipe in one process, without Ray.

The local run happens in a child process where ``import ray`` fails as if Ray were not
installed; the Ray run of the same recipe happens here. Both run the same engines with the same
seeds, so their steps, evaluations and checkpointed weights must agree to the last bit; only
timings differ. A Ray run's checkpoint then resumes on the local backend and repeats its last
step exactly.

``trainer.engine: torch`` (:mod:`opd.training.torch_engine`) runs in a child where neither Ray nor
DeepSpeed nor vLLM imports, nor the packages a run can do without (:mod:`opd.optional`), as on a
machine with only torch, transformers and small pure-Python packages: its steps must match the
DeepSpeed engine's to float rounding (the same AdamW and clip, summed in another order), and its
own checkpoint resumes exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"

# Run in the child: Ray refused at import (each attempt recorded), the packages named in
# OPD_TEST_REFUSE made absent (find_spec answers None and an import fails, as for a package that
# is not installed), then `opd train` on the local backend.
NO_RAY_CHILD = """
import json, os, sys
refused = []
for name in os.environ.get("OPD_TEST_REFUSE", "").split():
    sys.modules[name] = None
class NoRay:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "ray":
            refused.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
        return None
sys.meta_path.insert(0, NoRay)
from opd.cli import main
rc = main(["train", *sys.argv[1:]])
print("RESULT " + json.dumps({"rc": rc, "refused": refused, "ray_loaded": "ray" in sys.modules}))
"""


# What a bare GPU machine lacks (scripts/gpu_check.py's case): binary packages beyond torch's and
# transformers' own.
BARE = "deepspeed vllm pyarrow matplotlib tensorboard datasets pandas psutil mlflow wandb scipy"


def _args(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [str(TINY), f"run.output_dir={run_dir}", f"student.bootstrap.cache_dir={cache}",
            f"teacher.bootstrap.cache_dir={cache}", *extra]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _timing(key: str) -> bool:
    """Wall-clock and memory measurements (and throughput derived from them): the only keys that may differ."""
    return key.startswith(("time/", "memory/")) or key.endswith(("_time_s", "_per_s"))


def _assert_same_record(a: dict, b: dict) -> None:
    keys = {k for k in a if not _timing(k)}
    assert keys == {k for k in b if not _timing(k)}, a.keys() ^ b.keys()
    for key in sorted(keys):
        assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (a["step"], key, a[key], b[key])


def _assert_same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6, (a, b)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "cache"  # the bootstrap cache the Ray tests share


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, cache) -> tuple[Path, dict]:
    return _child_run(tmp_path_factory.mktemp("local") / "run", cache, "", "run.backend=local")


def _child_run(run_dir: Path, cache: Path, refuse: str, *extra: str) -> tuple[Path, dict]:
    env = {**os.environ, "OPD_TEST_REFUSE": refuse}
    proc = subprocess.run([sys.executable, "-c", NO_RAY_CHILD, *_args(run_dir, cache, *extra)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def torch_engine_run(tmp_path_factory, cache, local_run) -> tuple[Path, dict]:
    """The local run again with trainer.engine=torch where neither Ray nor DeepSpeed imports
    (after local_run, which builds the bootstrap cache)."""
    return _child_run(tmp_path_factory.mktemp("torch") / "run", cache, BARE, "run.backend=local",
                      "trainer.engine=torch")


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory, cache) -> Path:
    import ray

    from opd.cli import main

    run_dir = tmp_path_factory.mktemp("ray") / "run"
    try:
        assert main(["train", *_args(run_dir, cache, "run.backend=ray")]) == 0
    finally:
        ray.shutdown()
    return run_dir


def test_local_backend_trains_where_ray_cannot_be_imported(local_run):
    run_dir, result = local_run
    assert result == {"rc": 0, "refused": [], "ray_loaded": False}  # nothing even tried to import ray
    steps = [r for r in _records(run_dir) if "time/step_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["time/weight_sync_s"] > 0 for r in steps)
    assert (run_dir / "checkpoints" / "step_2" / "hf" / "model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_local_and_ray_backends_agree_on_every_step_and_weight(local_run, ray_run):
    local, ray_dir = local_run[0], ray_run
    a, b = _records(local), _records(ray_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 2]
    # The comparison below covers at least these (timings aside, every key of every line).
    for key in ("loss", "loss/reverse_kl", "grad_norm", "success", "train_tokens", "learning_rate"):
        assert key in a[1] and key in a[2], key
    assert {"eval/teacher_success", "eval/student_success"} <= a[0].keys() and "eval/student_success" in a[3]
    for ra, rb in zip(a, b):
        _assert_same_record(ra, rb)
    for step in (1, 2):
        _assert_same_weights(local / "checkpoints" / f"step_{step}", ray_dir / "checkpoints" / f"step_{step}")


def test_a_ray_run_resumes_on_the_local_backend_and_repeats_its_step_exactly(ray_run, cache, tmp_path):
    """Step 2 of the Ray run, redone on the local backend from its step-1 checkpoint."""
    from opd.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(ray_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    assert main(["train", *_args(run_dir, cache, "run.backend=local"), "--resume"]) == 0
    a, b = _records(run_dir), _records(ray_run)
    assert [r["step"] for r in a] == [0, 1, 2, 2]
    assert a[:2] == b[:2]  # the lines up to the checkpoint kept as they were, timings included: it resumed
    for ra, rb in zip(a[2:], b[2:]):
        _assert_same_record(ra, rb)
    _assert_same_weights(run_dir / "checkpoints" / "step_2", ray_run / "checkpoints" / "step_2")


def test_local_backend_without_deepspeed_says_what_to_install(monkeypatch, tmp_path):
    from opd.config import load_config
    from opd.runtime.errors import RunError
    from opd.runtime.local import spawn_local_workers

    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.backend=local"])
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails, as when it is absent
    with pytest.raises(RunError, match=r"trainer.engine: deepspeed.*set trainer.engine=torch.*pip install deepspeed"):
        spawn_local_workers(cfg, "no-student", "no-teacher")


def test_the_torch_engine_trains_without_ray_or_deepspeed_as_deepspeed_does(torch_engine_run, local_run):
    (run_dir, result), deepspeed_dir = torch_engine_run, local_run[0]
    assert result["rc"] == 0 and not result["ray_loaded"]
    assert not (run_dir / "tb").exists() and not (run_dir / "trajectories").exists()  # skipped, as said
    a, b = _records(run_dir), _records(deepspeed_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 2]
    for ra, rb in zip(a, b):
        keys = {k for k in rb if not _timing(k)}
        assert keys == {k for k in ra if not _timing(k)}, ra.keys() ^ rb.keys()
        for key in sorted(keys):  # the same update to float rounding (sums in another order)
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key, ra[key], rb[key])
    assert a[1]["loss"] == b[1]["loss"] and a[1]["grad_norm"] == pytest.approx(b[1]["grad_norm"], rel=1e-6)
    step = run_dir / "checkpoints" / "step_2"
    assert sorted(p.name for p in (step / "torch" / "state").iterdir()) == ["model.safetensors",
                                                                          "optimizer.safetensors", "state.json"]
    assert not (step / "ds").exists() and not list(step.rglob("*.pt"))  # nothing pickled
    from safetensors.torch import load_file

    wa = load_file(step / "hf" / "model.safetensors")
    wb = load_file(deepspeed_dir / "checkpoints" / "step_2" / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_the_torch_engine_resumes_its_own_checkpoint_exactly(torch_engine_run, cache, tmp_path):
    from opd.cli import main

    original = torch_engine_run[0]
    run_dir = tmp_path / "run"
    shutil.copytree(original, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    assert main(["train", *_args(run_dir, cache, "run.backend=local", "trainer.engine=torch"), "--resume"]) == 0
    a, b = _records(run_dir), _records(original)
    for ra, rb in zip(a[2:], b[2:]):
        _assert_same_record(ra, rb)
    _assert_same_weights(run_dir / "checkpoints" / "step_2", original / "checkpoints" / "step_2")
