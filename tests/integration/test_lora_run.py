"""A LoRA student through the whole loop (Ray actors, DeepSpeed ZeRO-1 on CPU, the tiny recipe):
the adapters train, the reference of ``reference_kl`` is the base with the adapters off, each
weight sync sends the adapters alone, and ``opd export`` writes the merged model and the adapter
directory, which transformers and peft load with the same logprobs. ``opd check`` refuses a
target module the student does not have, naming those it has."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
LORA = ["student.lora.rank=8", "student.lora.alpha=16"]


def test_a_lora_student_trains_syncs_its_adapters_and_exports_both(tmp_path, capsys, monkeypatch):
    import ray
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from opd.cli import main
    from opd.models import load_model
    from opd.training.trainer import token_logprobs
    from opd.trajectory import TokenBatch

    monkeypatch.setenv("COLUMNS", "400")  # rich would wrap the messages checked below
    cache = tmp_path / "cache"
    boot = [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]
    run = tmp_path / "run"
    try:
        code = main(["train", str(TINY), f"run.output_dir={run}", *boot, *LORA, "run.save_every_steps=1",
                     "losses=[{name: reverse_kl}, {name: reference_kl, weight: 0.1}]"])
    finally:
        ray.shutdown()
    assert code == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "time/step_s" in line]
    assert [s["step"] for s in steps] == [1, 2]
    student_dir = json.loads((run / "checkpoints" / "step_2" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    base = load_model(student_dir)
    model_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
    # A [8, in] and B [out, 8] of q, k, v, o (64 -> 64), gate, up (64 -> 128), down (128 -> 64), in 2 blocks
    adapter_mb = 2 * (4 * (8 * 64 + 64 * 8) + 3 * (8 * 64 + 128 * 8)) * 4 / 2**20
    for s in steps:
        assert math.isfinite(s["loss"]) and s["nonfinite_loss"] == 0.0 and s["grad_norm"] > 0
        assert s["weight_sync_mb"] == pytest.approx(adapter_mb, rel=1e-6) and s["weight_sync_mb"] < model_mb / 4
    assert steps[0]["reference_kl/kl"] == pytest.approx(0.0, abs=1e-6)  # the adapters start at zero (B = 0)
    assert steps[1]["reference_kl/kl"] > 0  # the base with the adapters off, against the adapted student

    out = tmp_path / "exported"
    assert main(["export", str(run), str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"{out / 'adapter'} holds the LoRA adapters alone" in said
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = [[1, 5, 9, 20, 33, 7, 2, 101, 64, 3], [4, 8, 15, 16, 23, 42, 99, 150]]
    batch = TokenBatch.from_rows([{"input_ids": r, "attention_mask": [1] * len(r), "loss_mask": [1.0] * len(r),
                                   "turn_index": [0] * len(r)} for r in ids], pad_id=0)
    with torch.no_grad():
        a, b = token_logprobs(merged, batch), token_logprobs(adapted, batch)
        start = token_logprobs(load_model(student_dir), batch)
    mask = batch.attention_mask_BT.bool()
    assert float((a - b)[mask].abs().max()) < 1e-4
    assert float((a - start)[mask].abs().max()) > 1e-4  # the export is the trained student, not the start

    code = main(["check", str(TINY), f"run.output_dir={tmp_path / 'other'}", *boot, *LORA,
                 "student.lora.target_modules=[q_proj, qkv]"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 2
    assert ("student.lora.target_modules names ['qkv'], which Qwen3ForCausalLM has no linear layer of; it has "
            "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']") in printed
