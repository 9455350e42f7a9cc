"""Every scoring mode and loss family trains through the real loop (Ray actors, DeepSpeed on
CPU): top-k with exact reverse + forward KL, full-vocabulary GJSD at turn level and the same from
the teacher's hidden states (chunked over the vocabulary), GRPO groups with PPO-clip next to OPD,
and a teacher of another tokenizer (SmolLM2's) with span-aligned scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def _train(tmp_path, name: str, *overrides: str) -> tuple[int, list[dict], Path]:
    import ray

    from opd.cli import main

    cache = tmp_path.parent / "cache"
    run = tmp_path / name
    try:
        code = main(["train", str(TINY), f"run.output_dir={run}", f"student.bootstrap.cache_dir={cache}",
                     f"teacher.bootstrap.cache_dir={cache}", "run.save_every_steps=0", *overrides])
    finally:
        ray.shutdown()
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, [r for r in records if "time/step_s" in r], run


CASES = {
    "topk": (["supervision.scoring=topk", "supervision.top_k=8",
              "losses=[{name: reverse_kl}, {name: forward_kl, weight: 0.5}]"],
             ["loss/reverse_kl", "loss/forward_kl", "reverse_kl/reverse_kl", "forward_kl/forward_kl"]),
    "grpo": (["rollout.group_size=4", "losses=[{name: reverse_kl}, {name: ppo_clip, weight: 0.5}]"],
             ["loss/reverse_kl", "loss/ppo_clip", "ppo_clip/clip_frac"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scoring_mode_and_losses_train(tmp_path, case):
    overrides, keys = CASES[case]
    code, steps, _ = _train(tmp_path, case, *overrides)
    assert code == 0 and len(steps) == 2
    for record in steps:
        for key in keys:
            assert math.isfinite(record[key]), key
        assert record["nonfinite_loss"] == 0.0 and record["grad_norm"] > 0
    if case in ("topk", "full"):
        # Exact divergences are non-negative; the payload grows with what the teacher sends.
        assert all(r[keys[-1]] >= 0 for r in steps)
        assert steps[0]["teacher_payload_mb"] > 0
    if case == "grpo":
        assert steps[0]["ppo_clip/advantage_mean"] == pytest.approx(0.0, abs=1e-5)  # centred within groups


def test_hidden_state_scoring_trains_as_full_scoring_does(tmp_path):
    """The same run with ``scoring: full`` and with ``scoring: hidden`` (the teacher's final hidden
    states, its head sent once to the trainer, the divergence 7 tokens at a time): the same
    losses step by step, for a payload of ``[N, H]`` in place of ``[N, V]`` (64 against 300)."""
    gjsd = "losses=[{name: gjsd, args: {beta: 0.5, normalize: turn}}]"
    runs = {}
    for scoring, extra in (("full", []), ("hidden", ["trainer.vocab_chunk_tokens=7"])):
        code, steps, _ = _train(tmp_path, scoring, f"supervision.scoring={scoring}", gjsd, *extra)
        assert code == 0 and len(steps) == 2
        runs[scoring] = steps
    for full, hidden in zip(runs["full"], runs["hidden"]):
        assert math.isfinite(full["gjsd/gjsd"]) and full["gjsd/gjsd"] >= 0 and full["grad_norm"] > 0
        for key in ("loss/gjsd", "gjsd/gjsd", "grad_norm", "success"):
            assert hidden[key] == pytest.approx(full[key], rel=1e-4, abs=1e-6), key
        # 4 bytes per sampled token's logprob, then [N, V] or [N, H] float32 rows.
        ratio = (full["teacher_payload_mb"]) / hidden["teacher_payload_mb"]
        assert ratio == pytest.approx((1 + 300) / (1 + 64), rel=1e-6)


def test_cross_tokenizer_teacher_trains_and_is_refused_without_the_option(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich would wrap the messages checked below
    smollm2 = ["teacher.bootstrap.tokenizer=smollm2"]
    code, steps, _ = _train(tmp_path, "cross", *smollm2, "supervision.cross_tokenizer=true")
    out = capsys.readouterr().out
    assert code == 0 and len(steps) == 2, out[-2000:]
    assert "cross-tokenizer scoring (the tokenizers differ: vocabulary sizes differ: student 300, teacher 49152" in out
    for record in steps:
        assert math.isfinite(record["loss"]) and math.isfinite(record["reverse_kl_per_token"])

    code, steps, _ = _train(tmp_path, "refused", *smollm2)
    captured = capsys.readouterr()
    printed = " ".join((captured.out + captured.err).split())
    assert code == 2 and steps == []
    assert "the teacher's tokenizer differs from the student's: vocabulary sizes differ: student 300, teacher 49152" in printed
    assert "Or set supervision.cross_tokenizer: true" in printed
