"""Generation throughput and weight-sync time, HF engine against vLLM, on this machine.

    .venv/bin/python bench/vllm_vs_hf.py            # needs vLLM (OPD_VLLM=1 scripts/setup.sh)

For a tiny Qwen3 (the test models' shape) and for SmolLM2-135M (the one real pretrained model
offline), both engines generate the same batch of prompts (greedy budget of new tokens, no stop
token, so both produce exactly prompts x tokens) in the same run; tokens/s and the vLLM/HF ratio
are printed, with the time to load a full state dict into each engine in place.
"""

from __future__ import annotations

import time

import torch

from opd.schema import TinyArchConfig
from opd.generation.base import SamplingParams
from opd.generation.hf import HFEngine
from opd.generation.vllm_engine import VLLMEngine
from opd.models import load_model, save_model, smollm2_model_dir, tiny_qwen3, train_chat_tokenizer


def tiny_model_dir() -> str:
    tokenizer = train_chat_tokenizer(["left down right up, the frozen lake has holes"] * 20, vocab_size=300)
    directory = "/tmp/opd-bench-tiny"
    save_model(tiny_qwen3(tokenizer, TinyArchConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128), seed=0),
               tokenizer, directory)
    return directory


def measure(name: str, path: str, prompts: int, new_tokens: int) -> dict:
    vocab = load_model(path).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(10, vocab, (32,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    row = {"model": name, "prompts": prompts, "new_tokens": new_tokens}
    state = load_model(path).state_dict()
    for label, engine in (("hf", HFEngine.from_pretrained(path)), ("vllm", VLLMEngine.from_pretrained(path))):
        engine.generate(batch[:2], SamplingParams(max_new_tokens=2, seed=0))  # warm-up
        start = time.perf_counter()
        out = engine.generate(batch, params)
        seconds = time.perf_counter() - start
        row[f"{label}_tokens_per_s"] = sum(len(c.response_ids) for c in out) / seconds
        start = time.perf_counter()
        engine.update_weights({k: v.clone() for k, v in state.items()})
        row[f"{label}_weight_sync_s"] = time.perf_counter() - start
        del engine
    row["vllm_over_hf"] = row["vllm_tokens_per_s"] / row["hf_tokens_per_s"]
    return row


if __name__ == "__main__":  # vLLM spawns helpers: keep the entry point guarded
    rows = [measure("tiny-qwen3 (0.1M)", tiny_model_dir(), 64, 32),
            measure("SmolLM2-135M", smollm2_model_dir(), 16, 16)]
    print("| model | batch | HF tokens/s | vLLM tokens/s | vLLM / HF | HF sync | vLLM sync |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prompts']} x {r['new_tokens']} | {r['hf_tokens_per_s']:.0f} | {r['vllm_tokens_per_s']:.0f} | "
              f"{r['vllm_over_hf']:.3f} | {r['hf_weight_sync_s']:.3f} s | {r['vllm_weight_sync_s']:.3f} s |")
