"""The prompt-dataset recipes run two steps through Ray and DeepSpeed: GKD-style OPD (vanilla_opd,
exact reverse KL over the vocabulary) and plain GRPO, on the shipped arithmetic prompts, each
episode one turn. Tiny bootstrapped models, shared between the two tests through one cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TINY_ARCH = ["arch.hidden_size=64", "arch.num_layers=1", "arch.num_heads=1", "arch.intermediate_size=128"]


@pytest.fixture()
def ray_session():
    import ray

    yield
    ray.shutdown()


def _args(tmp_path: Path, recipe: str, *extra: str) -> list[str]:
    # Smaller than the recipe where it only costs time; the same bootstrap overrides in both tests,
    # so the second reuses the first's models from the shared cache.
    cache = tmp_path.parent / "cache"
    boot = [f"{role}.bootstrap.{key}" for role in ("teacher", "student") for key in
            (f"cache_dir={cache}", "n_episodes=16", "sft_steps=4", "corpus_episodes=20", *TINY_ARCH)]
    return ["train", str(ROOT / "recipes" / f"{recipe}.yaml"), f"run.output_dir={tmp_path / 'run'}",
            "run.total_steps=2", "run.eval_episodes=4", "run.save_every_steps=0", "rollout.episodes_per_step=8",
            "trainer.micro_batch_size=8", "resources.num_cpus=2", "resources.torch_threads=1", *boot, *extra]


def _records(run: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/step_s" in r], [r for r in records if "eval/student_success" in r]


def _check_episodes(run: Path) -> None:
    from opd.evaluation.trajectories import read_episodes

    episodes = read_episodes(run / "trajectories" / "eval_student_step_2.parquet")
    assert len(episodes) == 4 and all(len(e["turns"]) == 1 for e in episodes)
    for e in episodes:  # the env's own text: the prompt, its answer as the expert action, the verdict
        turn = e["turns"][0]
        assert "What is " in e["task_prompt"] and turn["expert_action"].lstrip("-").isdigit()
        assert turn["observation"].startswith(("Correct.", "Incorrect.", "Invalid response: "))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["student_success_after"] is not None


def test_gkd_style_opd_two_steps(tmp_path, ray_session):
    """prompt_dataset.yaml, then prompt_dataset_hidden.yaml (the teacher's hidden states in place of
    its [N, V] rows): the same two steps, loss for loss, for a smaller payload."""
    import ray

    from opd.cli import main

    assert main(_args(tmp_path, "prompt_dataset")) == 0
    steps, evals = _records(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["nonfinite_loss"] == 0.0 and r["grad_norm"] > 0
        assert r["reverse_kl_per_token"] > 0 and r["time/teacher_scoring_s"] > 0
        assert r["turns_per_episode"] == 1.0 and r["env_errors"] == 0.0 and 0.0 <= r["success"] <= 1.0
    _check_episodes(tmp_path / "run")

    ray.shutdown()
    hidden_run = tmp_path / "hidden"
    assert main([*_args(tmp_path, "prompt_dataset_hidden"), f"run.output_dir={hidden_run}"]) == 0
    hidden_steps, _ = _records(hidden_run)
    for full, hidden in zip(steps, hidden_steps, strict=True):
        for key in ("loss", "reverse_kl_per_token", "grad_norm", "success"):
            assert hidden[key] == pytest.approx(full[key], rel=1e-4, abs=1e-6), key
        assert hidden["teacher_payload_mb"] < full["teacher_payload_mb"] / 4  # 64 numbers a token, not 320


def test_grpo_two_steps(tmp_path, ray_session):
    from opd.cli import main

    assert main(_args(tmp_path, "prompt_dataset_grpo", "rollout.group_size=4")) == 0
    steps, evals = _records(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for r in steps:
        assert math.isfinite(r["loss/ppo_clip"]) and r["nonfinite_loss"] == 0.0
        assert r["ppo_clip/advantage_mean"] == pytest.approx(0.0, abs=1e-5) and r["time/teacher_scoring_s"] == 0.0
        assert r["turns_per_episode"] == 1.0 and r["env_errors"] == 0.0
    _check_episodes(tmp_path / "run")
