"""LoRA students (:mod:`opd.training.lora`) on the real trainer (DeepSpeed on CPU, every ZeRO
stage on one rank, and the torch engine) with a real tiny Qwen3: only the adapters train and
sit in the optimizer, the reference is the base model with the adapters off, a weight sync sends
the adapters and a rollout engine that merges them gives the trainer's logprobs, and a checkpoint
holds the adapters (not the frozen weights) and resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from opd.generation.hf import HFEngine
from opd.models import load_model
from opd.schema import LoraConfig, TrainerConfig
from opd.training import lora
from opd.training.trainer import StudentTrainer, TrainerSpec, token_logprobs
from opd.trajectory import TokenBatch


def _batch(fmt, vocab: int, seed: int = 0) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(4):
        ids = [fmt.im_start_id, *torch.randint(5, vocab, (9 + r,), generator=gen).tolist()]
        loss = [0.0] * 4 + [1.0] * (len(ids) - 4)
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": loss,
                     "turn_index": [-1] * 4 + [0] * (len(ids) - 4),
                     "behaviour_logprobs": [0.0] * 4 + [-1.5] * (len(ids) - 4),
                     "teacher_logprobs": [0.0] * 4 + (-torch.rand(len(ids) - 4, generator=gen) * 3).tolist()})
    return TokenBatch.from_rows(rows, fmt.pad_id)


def _trainer(model_dir: str, engine: str = "deepspeed", zero_stage: int = 0, rank: int = 8, terms=None):
    cfg = OmegaConf.structured(TrainerConfig(engine=engine, learning_rate=1e-2, warmup_steps=0, micro_batch_size=2,
                                             zero_stage=zero_stage))
    terms = terms or (("reverse_kl", 1.0, {}),)
    return StudentTrainer(TrainerSpec(cfg, tuple(terms), model_dir, episodes_per_step=4,
                                      lora=LoraConfig(rank=rank, alpha=16.0) if rank else None))


def _lora_params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if "lora_" in n}


def _frozen_params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize("engine, zero_stage", [("torch", 0), ("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2),
                                                ("deepspeed", 3)])
def test_only_the_adapters_train(tiny_model_dir, fmt, engine, zero_stage):
    trainer = _trainer(tiny_model_dir, engine, zero_stage)
    vocab = trainer.vocab_size
    frozen, adapters = _frozen_params(trainer), _lora_params(trainer)
    assert adapters and all(not p.requires_grad for n, p in trainer.engine.module.named_parameters() if "lora_" not in n)
    metrics = trainer.train_step(_batch(fmt, vocab))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    with trainer._full_parameters():
        after_frozen, after_adapters = _frozen_params(trainer), _lora_params(trainer)
    if zero_stage != 3:  # ZeRO-3 partitions the live tensors: compared gathered, above
        assert all(torch.equal(after_frozen[n], frozen[n]) for n in frozen)
    moved = [n for n in adapters if not torch.equal(after_adapters[n], adapters[n])]
    assert moved and any("lora_B" in n for n in moved)  # B starts at zero and moves first
    # Adam's state is the adapters' alone (DeepSpeed's ZeRO optimizers wrap torch's AdamW, whose
    # state is then kept per flat partition).
    optimizer = getattr(trainer.engine.optimizer, "optimizer", trainer.engine.optimizer)
    held = sum(state["exp_avg"].numel() for state in optimizer.state.values())
    def size(p):  # ZeRO-3 keeps a partition in the live tensor
        return int(getattr(p, "ds_numel", p.numel()))

    adapter_size = sum(size(p) for n, p in trainer.engine.module.named_parameters() if "lora_" in n)
    total = sum(size(p) for p in trainer.engine.module.parameters())
    assert 0 < held <= adapter_size + 64 and adapter_size < total / 4, (held, adapter_size, total)


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model_dir, fmt):
    terms = (("reverse_kl", 1.0, {}), ("reference_kl", 0.5, {}))
    trainer = _trainer(tiny_model_dir, "torch", terms=terms)
    assert trainer.reference is None  # no second copy
    batch = _batch(fmt, trainer.vocab_size)
    trainer.train_step(batch)
    trainer.train_step(batch)  # the adapters now differ from zero
    base = load_model(tiny_model_dir)
    with torch.no_grad(), trainer._adapters_off():
        off = token_logprobs(trainer.engine.module, batch)
    with torch.no_grad():
        on = token_logprobs(trainer.engine.module, batch)
        want = token_logprobs(base, batch)
    mask = batch.attention_mask_BT.bool()
    assert float((off - want)[mask].abs().max()) < 1e-6
    assert float((on - want)[mask].abs().max()) > 1e-4  # the adapters did move the policy


def test_a_weight_sync_sends_the_adapters_and_the_rollout_merges_them(tiny_model_dir, fmt):
    trainer = _trainer(tiny_model_dir, "deepspeed", 1)
    batch = _batch(fmt, trainer.vocab_size)
    for _ in range(2):
        trainer.train_step(batch)
    update = trainer.export_weights()
    assert isinstance(update, lora.LoraUpdate)
    model_bytes = sum(p.numel() * p.element_size() for p in load_model(tiny_model_dir).parameters())
    assert 0 < update.nbytes() < model_bytes / 4
    rollout = HFEngine(load_model(tiny_model_dir), fmt.pad_id, device="cpu")
    rollout.update_weights(lora.LoraMerger(tiny_model_dir).merged(update))
    with torch.no_grad():
        got = token_logprobs(rollout.model, batch)
        want = token_logprobs(trainer.engine.module, batch)
    mask = batch.attention_mask_BT.bool()
    assert float((got - want)[mask].abs().max()) < 1e-5


@pytest.mark.parametrize("engine, zero_stage", [("torch", 0), ("deepspeed", 1), ("deepspeed", 3)])
def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model_dir, fmt, tmp_path, engine, zero_stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first = _trainer(tiny_model_dir, engine, zero_stage)
    batch = _batch(fmt, first.vocab_size)
    first.train_step(batch)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    # The engine's state holds the adapters' weights (and their Adam moments), not the frozen ones;
    # DeepSpeed excludes frozen weights by parameter name, which misses a tied head's second name.
    state_dir = tmp_path / "ckpt" / first.state_dirname
    if engine == "torch":
        from safetensors import safe_open

        with safe_open(str(state_dir / "state" / "model.safetensors"), "pt") as f:
            saved = set(f.keys())
    else:
        from opd.training.checkpoint import safe_torch_load

        files = list(state_dir.rglob("*model_states.pt"))
        with safe_torch_load():
            saved = set(torch.load(files[0], map_location="cpu")["module"]) if zero_stage != 3 else set()
    assert all("lora_" in name or name.endswith("lm_head.weight") for name in saved), saved
    assert zero_stage == 3 or sum("lora_" in name for name in saved) == 28  # A and B of 7 layers x 2 blocks
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == tiny_model_dir

    second = _trainer(tiny_model_dir, engine, zero_stage)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    first.train_step(batch)
    second.train_step(batch)
    with first._full_parameters(), second._full_parameters():
        a, b = _lora_params(first), _lora_params(second)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    # The merged model and the adapter directory load without opd, with the trainer's logprobs.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf", dtype=torch.float32).eval()
    with_adapter = PeftModel.from_pretrained(load_model(tiny_model_dir), tmp_path / "ckpt" / "adapter").eval()
    restored = _trainer(tiny_model_dir, engine, zero_stage)
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    with torch.no_grad():
        with restored._full_parameters():
            want = token_logprobs(restored.engine.module, batch)
        mask = batch.attention_mask_BT.bool()
        for model in (merged, with_adapter):
            assert float((token_logprobs(model, batch) - want)[mask].abs().max()) < 1e-4


def test_a_target_module_the_model_lacks_is_named_with_those_it_has(tiny_model_dir):
    with pytest.raises(ValueError, match=r"names \['qkv'\], which Qwen3ForCausalLM has no linear layer of; it has "
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        lora.check_model_dir(tiny_model_dir, ["q_proj", "qkv"])
    lora.check_model_dir(tiny_model_dir, ["q_proj", "v_proj"])
