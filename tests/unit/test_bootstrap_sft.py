"""The bootstrap SFT step splits its batch into forwards of similar lengths without changing
the update: the same parameters as one forward padded to the longest row."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from opd import provisioning as bootstrap
from opd.schema import BootstrapConfig


def test_length_grouped_sft_makes_the_padded_update(tokenizer, fmt, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (7, 40, 13, 90, 25, 64):  # a mix like whole episodes next to single turns
        ids = torch.randint(5, 250, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "loss_mask": [0.0] * (n // 2) + [1.0] * (n - n // 2),
                     "behaviour_logprobs": [0.0] * n, "turn_index": [-1] * (n // 2) + [0] * (n - n // 2)})
    boot = OmegaConf.structured(BootstrapConfig(sft_steps=3, batch_size=6, learning_rate=1e-2))
    boot.arch.hidden_size, boot.arch.num_heads, boot.arch.num_layers = 64, 1, 1
    params = {}
    for cap in (0, 100):  # 0: one forward of 6 x 90 padded tokens; 100: one or two rows per forward
        monkeypatch.setattr(bootstrap, "SFT_BATCH_TOKENS", cap)
        model = bootstrap.tiny_qwen3(tokenizer, boot.arch, seed=0).train()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        bootstrap.sft(model, rows, fmt.pad_id, boot, seed=0, log=lambda _: None)
        params[cap] = model.state_dict()
    moved = max((params[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3  # the steps did train
    assert max((params[0][k] - params[100][k]).abs().max().item() for k in before) < 1e-5
