"""Peak memory of the HF engine's prefill with and without its score budget
(``HFEngine.max_prefill_scores``): the study teachers' model shape (Qwen3, 2 blocks of width 128,
2 heads, a 1,000-token vocabulary) prefills a batch of uncached prompts, as an evaluation's first
turn or a prefix-cache miss does. In one forward its memory grows with rows x new columns x all
columns (the 4-D attention mask and the scores); in column chunks it stays near the budget.
Each arm runs in a fresh process.

    .venv/bin/python bench/prefill_memory.py                       # 48 prompts of 2,048 tokens
    .venv/bin/python bench/prefill_memory.py --rows 48 --tokens 4096

Prints, for each arm: the forwards it took, its seconds, and the process's peak resident memory
above what it held before the prefill (VmHWM - VmRSS), in MiB, then the ratios. The two arms'
next-token logits agree to 1e-4 (checked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from opd.generation.hf import HFEngine

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
rows, tokens, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
config = Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=64, max_position_embeddings=16384, tie_word_embeddings=True,
                     pad_token_id=0, eos_token_id=2, bos_token_id=None)
engine = HFEngine(Qwen3ForCausalLM(config), pad_id=0, max_prefill_scores=budget)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 1000, (tokens - 7 * i,), generator=g).tolist() for i in range(rows)]  # ragged: some padding
before = status("VmRSS")
start = time.perf_counter()
_, _, _, logits = engine.prefill(prompts)
seconds = time.perf_counter() - start
torch.save(logits, sys.argv[4])
print(json.dumps({"forwards": engine.prefill_forwards, "seconds": seconds, "peak_mb": status("VmHWM") - before}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=48, help="prompts in the batch (an evaluation's episodes)")
    parser.add_argument("--tokens", type=int, default=2048, help="the longest prompt's tokens")
    args = parser.parse_args()
    import inspect
    import tempfile

    import torch

    from opd.generation.hf import HFEngine

    default = inspect.signature(HFEngine).parameters["max_prefill_scores"].default
    arms = {"one forward (no budget)": 2**62, f"chunked (budget {default:,} scores)": default}
    rows, logits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (label, budget) in enumerate(arms.items()):
            path = f"{tmp}/{k}.pt"
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.rows), str(args.tokens), str(budget), path],
                                 cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{label}: the child failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
            rows[label] = json.loads(out.stdout.strip().splitlines()[-1])
            logits[label] = torch.load(path)
    first, second = logits.values()
    torch.testing.assert_close(first, second, atol=1e-4, rtol=0)
    print(f"prefill of {args.rows} uncached prompts of up to {args.tokens:,} tokens, the study teachers' model shape")
    print("| prefill | forwards | seconds | peak memory above the start, MiB |")
    print("|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['forwards']} | {r['seconds']:.1f} | {r['peak_mb']:,.0f} |")
    whole, chunked = rows.values()
    print(f"chunked / one forward: memory {chunked['peak_mb'] / whole['peak_mb']:.2f}x, "
          f"time {chunked['seconds'] / whole['seconds']:.2f}x")


if __name__ == "__main__":
    main()
