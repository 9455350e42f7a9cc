"""What a LoRA student saves in the trainer's memory, and why the process's resident peak on CPU
can say the opposite: SmolLM2-135M-Instruct, a full fine-tune against rank-16 adapters on every
linear layer (``opd.training.lora.wrap``, as ``student.lora`` builds it), AdamW, a few steps of a
4 x 600-token micro-batch, each case in a fresh process.

    .venv/bin/python bench/lora_memory.py            # about 3 minutes on 2 idle cores

Per case: the trainable parameters, the optimizer's state, the activations kept for the
backward pass (the bytes of the distinct tensors autograd saves, counted through
``saved_tensors_hooks`` on the first forward), the process's peak resident memory (``VmHWM``) and
the median step time. Each case runs twice: with glibc's default allocator, whose mmap threshold
rises after the first frees so that the activations (a few MB each) land on the heap, where the
holes the frees leave are kept; and with ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB, which puts
every activation in its own mapping, handed back when freed. peft's adapted layer makes a few
more temporaries per layer than a plain linear (the adapters' output, then its sum with the
base's), so on the default heap it fragments more. Results: ``<out>/lora_memory.json`` and
``lora_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXED_THRESHOLD = 1 << 20


def one_case(student: str, steps: int, rows: int, length: int) -> dict:
    """In this process: the student, ``steps`` AdamW steps, and what they held."""
    import torch

    from opd.models import smollm2_model_dir
    from opd.schema import LoraConfig
    from opd.training.lora import wrap
    from opd.training.trainer import peak_rss_mb
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir(), dtype=torch.float32)
    if student == "lora":
        model = wrap(model, LoraConfig(rank=16, alpha=32.0, target_modules=["all-linear"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        if step == 0:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                logits = model(input_ids=ids).logits
        else:
            logits = model(input_ids=ids).logits
        loss = -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"trainable_params": sum(p.numel() for p in trainable), "optimizer_state_mb": state / 2**20,
            "saved_activations_mb": sum(saved.values()) / 2**20, "peak_rss_mb": peak_rss_mb(),
            "median_step_s": statistics.median(seconds[1:] or seconds)}


def run_case(student: str, allocator: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(FIXED_THRESHOLD)
    out = subprocess.run([sys.executable, __file__, "--case", student, "--steps", str(args.steps), "--rows",
                          str(args.rows), "--length", str(args.length)], env=env, capture_output=True, text=True,
                         check=False, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the {student} case ({allocator} allocator) failed:\n{out.stderr[-3000:]}")
    return {"student": student, "allocator": allocator, **json.loads(out.stdout.strip().splitlines()[-1])}


def table(rows: list[dict]) -> str:
    lines = ["| student | allocator | trainable params | optimizer state MiB | saved activations MiB | "
             "peak RSS MiB | median step s |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        alloc = "glibc default" if r["allocator"] == "default" else "mmap threshold 1 MiB"
        lines.append(f"| {r['student']} | {alloc} | {r['trainable_params']:,} | {r['optimizer_state_mb']:,.1f} | "
                     f"{r['saved_activations_mb']:,.0f} | {r['peak_rss_mb']:,.0f} | {r['median_step_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=600)
    parser.add_argument("--out", default="runs/bench_lora_memory")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one_case(args.case, args.steps, args.rows, args.length)))
        return
    rows = []
    for allocator in ("default", "fixed"):
        for student in ("full", "lora"):
            print(f"{student}, {allocator} allocator ...", flush=True)
            rows.append(run_case(student, allocator, args))
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_memory.json").write_text(json.dumps(rows, indent=1))
    (out / "lora_memory.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
