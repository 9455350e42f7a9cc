"""The trainer's model FLOPs utilisation (MFU) on a SmolLM2-135M-shaped student, on this machine.

    .venv/bin/python bench/mfu.py                                # 3-4 minutes on 2 idle cores
    .venv/bin/python bench/mfu.py --rows 8 --tokens 512 1024     # the issue's rows (about 6x longer)

One optimizer step of the real :class:`opd.training.trainer.StudentTrainer` (DeepSpeed on the CPU
accelerator, the recipe's default loss ``reverse_kl`` with ``sampled`` scoring, float32) on a
randomly initialised model of SmolLM2-135M's shape (Llama, 30 layers, hidden 576, MLP 1536, 9
heads / 3 KV heads, vocabulary 49,152, tied embeddings), over multi-turn rows built as a run
builds them (:func:`opd.algorithms.step.build_token_batch`: prompts and observations, then
responses that carry the loss, about ``--response-share`` of each row).

The same trainer runs its step two ways, interleaved so that the machine's drift hits both alike:

- ``before``: as the trainer ran before issue 22: the LM head and a log-softmax over the whole
  vocabulary at every position (``[B, T, V]``, forward and backward; the trainer's
  ``gather_logprobs`` off, as for a recipe with a user's loss), AdamW's per-op loop (``fused`` off in its
  parameter groups) and DeepSpeed's gradient all-reduce over the single rank;
- ``now``: as it runs now: the LM head and the log-softmax only at the positions the loss reads,
  the fused AdamW, no single-rank all-reduce.

The learning rate is tiny (1e-12; the cost of a step does not depend on it), so both ways see
the same weights and the script checks that they give the same loss.

**FLOPs**, counted from the model's shape and the tokens, forward plus backward (a matmul of
``m x k`` by ``k x n`` is ``2 m k n``; the backward is twice the forward):

    FLOPs = 6 * N_body * tokens  +  6 * N_head * head_positions  +  sum over rows of 12 * L * d * T_row^2

- ``N_body``: the weights of every linear layer of the transformer blocks (q, k, v, o, gate, up,
  down: 106.2M here); embeddings and norms do no matmul.
- ``N_head = V * H`` (28.3M here), counted at every position where the LM head is computed: each
  real token ``before`` (padding is waste and not counted), the trained positions plus the one
  per row that checks the head ``now``.
- ``tokens``: the real (unpadded) tokens of the rows; ``T_row`` a row's length.
- Attention: ``Q K^T`` and ``A V`` are ``2 T^2 d`` each per layer forward (``d`` = heads x head
  dim = 576), times 3 for the backward: ``12 L d T^2`` a row, the full square (PaLM's
  convention). A causal kernel skips about half of it; the JSON also gives the MFU with half.

The optimizer's update, gradient clipping and the log-softmax are counted as time, not FLOPs.

**Peak**: the best of ``--peak-repeats`` float32 ``torch.mm`` of two ``--peak-size`` square
matrices with the trainer's thread count, measured right before every timed step (the machine is
shared, so its speed moves: each step is set against the peak measured beside it). MFU = achieved
FLOP/s / that peak, the median over ``--repeats``. On a loaded machine the step (tens of seconds)
and the peak (a fraction of a second) may get different shares of the cores, so the table also
gives the MFU by CPU time: the step's FLOPs per CPU second of this process against the peak's. The profile (``torch.profiler``, top entries by
self CPU time) is of the warm-up step each way (the first one, ``before``, also creates AdamW's
state). Results go to ``<out>/mfu.json`` and ``mfu.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SMOLLM2_135M = dict(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100_000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
MODES = {"before": False, "now": True}


def set_mode(trainer, now: bool, allreduce_now: bool) -> None:
    """The trainer as it runs ``now`` or as it ran ``before`` (see the module docstring)."""
    trainer.gather_logprobs = now  # before: every position's log-softmax (what a user's loss still gets)
    trainer.engine.enable_backward_allreduce = allreduce_now if now else True
    for group in trainer.engine.optimizer.param_groups:
        group["fused"] = now


def model_dir(out: Path) -> str:
    """A randomly initialised (seed 0) SmolLM2-135M-shaped Llama with SmolLM2's tokenizer, saved
    once under ``out/model``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from opd.models import load_tokenizer, save_model, smollm2_tokenizer_dir

    directory = out / "model"
    if (directory / "model.safetensors").is_file():
        return str(directory)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    save_model(model, load_tokenizer(smollm2_tokenizer_dir()), directory)
    return str(directory)


def episodes(fmt, rows: int, tokens: tuple[int, int], response_share: float, seed: int):
    """``rows`` multi-turn episodes of random tokens, row lengths spread over ``tokens``: a task
    prompt, then turns of an observation and a response (``response_share`` of the turn, ending
    with ``<|im_end|>``), with the teacher's ``sampled`` scores of every response token."""
    import torch

    from opd.generation.base import TokenScores
    from opd.trajectory import Trajectory, Turn

    gen = torch.Generator().manual_seed(seed)
    vocab = SMOLLM2_135M["vocab_size"]

    def text(n: int) -> list[int]:
        return torch.randint(100, vocab - 100, (max(n, 1),), generator=gen).tolist()

    trajs, scores = [], []
    for r in range(rows):
        target = tokens[0] + (tokens[1] - tokens[0]) * r // max(rows - 1, 1)
        turn_tokens = 64
        turns, length = [], 0
        while length < target:
            width = min(turn_tokens, target - length)
            n_response = max(2, round(width * response_share))
            prompt = fmt.message_ids("user", text(width - n_response - 6)) + fmt.assistant_header_ids()
            response = text(n_response - 1) + [fmt.im_end_id]
            turns.append(Turn(prompt_ids=prompt, response_ids=response,
                              response_logprobs=(-torch.rand(len(response), generator=gen) * 2).tolist()))
            length += len(prompt) + len(response)
        trajs.append(Trajectory(task=f"row{r}", turns=turns))
        n = sum(len(t.response_ids) for t in turns)
        scores.append(TokenScores(logprobs=(-torch.rand(n, generator=gen) * 3).tolist()))
    return trajs, scores


def matmul_peak(size: int, repeats: int) -> tuple[float, float]:
    """Best float32 ``torch.mm`` FLOP/s of two ``size`` square matrices over ``repeats`` calls, and
    its best FLOPs per CPU second of this process (all threads)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return 2 * size**3 / wall, 2 * size**3 / cpu


def step_flops(model, batch, gathered: bool, micro_batch_size: int, micro_batch_tokens: int) -> dict[str, float]:
    """The step's model FLOPs (see the module docstring) and the counts behind them."""
    import torch

    head = model.get_output_embeddings()
    n_body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    n_head = head.weight.numel()
    cfg = model.config
    d_attn = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    lengths = batch.attention_mask_BT.sum(1)
    tokens = int(lengths.sum())
    micro = batch.micro_batches(micro_batch_size, micro_batch_tokens)
    if gathered:
        head_positions = int((batch.loss_mask_BT[:, 1:] > 0).sum()) + len(batch)  # + the head check, one per row
    else:
        head_positions = tokens
    attention = 12 * cfg.num_hidden_layers * d_attn * float((lengths.double() ** 2).sum())
    body, lm_head = 6 * n_body * tokens, 6 * n_head * head_positions
    return {"flops": body + lm_head + attention, "body_flops": body, "head_flops": lm_head, "attention_flops": attention,
            "n_body": n_body, "n_head": n_head, "tokens": tokens, "head_positions": head_positions,
            "trained_tokens": int(batch.loss_mask_BT.sum()), "padded_tokens": sum(m.input_ids_BT.numel() for m in micro),
            "micro_batches": len(micro)}


def profile_top(trainer, batch, top: int) -> list[dict]:
    """The ``top`` entries of one step's profile by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(batch)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"name": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:top]]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs=2, default=(192, 384), metavar=("MIN", "MAX"),
                        help="row lengths, spread from MIN to MAX")
    parser.add_argument("--response-share", type=float, default=0.25, help="share of each turn's tokens that are its response")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-size", type=int, default=2048)
    parser.add_argument("--peak-repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="profile entries to report; 0: no profile")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: the machine's core count")
    parser.add_argument("--out", default="runs/bench_mfu")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    from omegaconf import OmegaConf

    from opd.algorithms.step import build_token_batch
    from opd.chat import ChatFormat
    from opd.cli import _quiet_libraries
    from opd.models import load_tokenizer
    from opd.schema import TrainerConfig
    from opd.training.trainer import StudentTrainer, TrainerSpec

    _quiet_libraries()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    path = model_dir(out)
    fmt = ChatFormat.from_tokenizer(load_tokenizer(path))
    trajs, scores = episodes(fmt, args.rows, tuple(args.tokens), args.response_share, seed=0)
    batch = build_token_batch(trajs, scores, fmt.pad_id, fmt)
    cfg = OmegaConf.structured(TrainerConfig(learning_rate=1e-12, micro_batch_size=args.rows))
    terms = [("reverse_kl", 1.0, {})]
    trainer = StudentTrainer(TrainerSpec(cfg, tuple(terms), path, episodes_per_step=args.rows, dtype=args.dtype,
                                         torch_threads=args.threads))
    threads = torch.get_num_threads()
    allreduce_now = trainer.engine.enable_backward_allreduce
    flops = {mode: step_flops(trainer.engine.module, batch, gathered, cfg.micro_batch_size, cfg.micro_batch_tokens)
             for mode, gathered in MODES.items()}

    times = {mode: [] for mode in MODES}
    cpu_times = {mode: [] for mode in MODES}
    peaks = {mode: [] for mode in MODES}
    cpu_peaks = {mode: [] for mode in MODES}
    losses = {mode: [] for mode in MODES}
    profiles = {}
    for mode, gathered in MODES.items():  # a first round warms up, profiled
        set_mode(trainer, gathered, allreduce_now)
        if args.top:
            profiles[mode] = profile_top(trainer, batch, args.top)
        else:
            trainer.train_step(batch)
    for _ in range(args.repeats):
        for mode, gathered in MODES.items():
            set_mode(trainer, gathered, allreduce_now)
            peak, cpu_peak = matmul_peak(args.peak_size, args.peak_repeats)
            peaks[mode].append(peak)
            cpu_peaks[mode].append(cpu_peak)
            start, start_cpu = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(batch)
            times[mode].append(time.perf_counter() - start)
            cpu_times[mode].append(time.process_time() - start_cpu)
            losses[mode].append(metrics["loss"])
    set_mode(trainer, True, allreduce_now)
    gap = max(abs(a - b) for a, b in zip(losses["before"], losses["now"]))
    if gap > 1e-4 * max(1.0, abs(losses["before"][0])):
        raise SystemExit(f"the two ways give different losses {losses}")

    results = {}
    for mode in MODES:
        f = flops[mode]
        mfu = [f["flops"] / t / p for t, p in zip(times[mode], peaks[mode])]
        causal = f["flops"] - f["attention_flops"] / 2
        results[mode] = {
            "step_s": statistics.median(times[mode]), "step_times_s": times[mode],
            "tokens_per_s": f["tokens"] / statistics.median(times[mode]),
            "achieved_gflops": statistics.median(f["flops"] / t / 1e9 for t in times[mode]),
            "peak_gflops": statistics.median(p / 1e9 for p in peaks[mode]), "peaks_gflops": [p / 1e9 for p in peaks[mode]],
            "mfu": statistics.median(mfu), "mfus": mfu,
            "mfu_causal_attention": statistics.median(causal / t / p for t, p in zip(times[mode], peaks[mode])),
            "step_cpu_s": statistics.median(cpu_times[mode]), "step_cpu_times_s": cpu_times[mode],
            "mfu_cpu_time": statistics.median(f["flops"] / c / p for c, p in zip(cpu_times[mode], cpu_peaks[mode])),
            "losses": losses[mode], **f, "profile_top": profiles.get(mode, []),
        }
    lengths = batch.attention_mask_BT.sum(1).tolist()
    result = {"model": "SmolLM2-135M shape, random weights", "dtype": args.dtype, "torch_threads": threads,
              "loss": "reverse_kl (sampled)", "rows": args.rows, "row_tokens": lengths,
              "response_share": float(batch.loss_mask_BT.sum()) / sum(lengths), "repeats": args.repeats,
              "peak": f"float32 torch.mm {args.peak_size}^2, best of {args.peak_repeats}, before every step",
              "load_average": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
              "max_loss_gap": gap, "wall_s": time.perf_counter() - started, "results": results}
    (out / "mfu.json").write_text(json.dumps(result, indent=2))
    before, after = results["before"], results["now"]
    lines = [f"Trainer MFU, {args.dtype}, {threads} threads: {len(lengths)} rows of {min(lengths)}-{max(lengths)} tokens "
             f"({sum(lengths)} in all, {result['response_share']:.0%} trained), SmolLM2-135M shape, DeepSpeed on CPU, "
             f"reverse_kl; medians of {args.repeats}, each step against the matmul peak measured beside it", "",
             "| trainer | step (s) | tokens/s | GFLOP a step | achieved GFLOP/s | peak GFLOP/s | MFU | MFU by CPU time |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['flops'] / 1e9:.0f} | "
                     f"{r['achieved_gflops']:.1f} | {r['peak_gflops']:.1f} | **{r['mfu']:.1%}** | {r['mfu_cpu_time']:.1%} |")
    lines += ["", f"Speed-up: {before['step_s'] / after['step_s']:.2f}x a step; same losses within {gap:.1e}. "
              f"Load average {result['load_average']}."]
    for mode, top in profiles.items():
        lines += ["", f"Profile, {mode} (top {len(top)} by self CPU time):", "",
                  "| op | self CPU (s) | share | calls |", "|---|---|---|---|"]
        lines += [f"| `{e['name']}` | {e['self_cpu_s']:.2f} | {e['share']:.0%} | {e['calls']} |" for e in top]
    (out / "mfu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
