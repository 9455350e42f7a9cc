"""What each scoring mode costs at Qwen3's real vocabulary: the payload per step and the peak
memory of the teacher, the driver and the trainer, against the number of scored tokens.

    .venv/bin/python bench/vocab_memory.py                          # about 15 minutes on 2 idle cores
    .venv/bin/python bench/vocab_memory.py --tokens 1024 4096       # a quick look

Tiny models with Qwen3's vocabulary (151,936 ids) and a small hidden size (``--hidden``, 64), so
that the vocabulary dominates as it does at real scale and the table fits on this machine: a
teacher and a student (Qwen3, 2 layers, tied embeddings, random init). Each step is ``rows`` rows
of ``--row-tokens`` tokens, half of them the student's responses (the scored tokens). Per mode and
number of scored tokens ``N``, each role runs in a process of its own, as on Ray:

- **teacher**: the real :class:`opd.generation.hf.HFEngine` scores the rows
  (:func:`opd.supervision.teacher_view.score_trajectories`, ``supervision.score_batch_tokens``
  4096); its peak resident memory above what it held once the model was loaded.
- **payload**: the bytes of the teacher's answer that cross to the trainer
  (:meth:`opd.generation.base.TokenScores.nbytes`), and the bytes the driver fetches (the sampled
  tokens' logprobs only: the whole answer goes from the teacher to the trainer through the
  object store, :meth:`opd.runtime.workers.TeacherWorker.score_split`), pickled as Ray would.
- **trainer**: the real :class:`opd.training.trainer.StudentTrainer` (the torch engine, one rank,
  float32, micro-batches of ``trainer.micro_batch_tokens`` 4096) receives the answer, builds the
  batch (:func:`opd.algorithms.step.build_token_batch`) and trains one step of ``reverse_kl``;
  its peak resident memory above what it held once the model and its optimizer state were
  allocated (the answer it receives counts).

The modes: ``sampled``; ``topk`` (k = 64, with its tail mass); ``full`` with the vocabulary all at
once (``trainer.vocab_chunk_tokens: -1``, how opd ran before); ``full`` chunked (the default
``vocab_chunk_tokens: 0``: 220 rows of 151,936 at a time); ``hidden`` (the teacher's final hidden
states, its head sent once, chunked as above). A configuration whose ``[N, V]`` float32 rows
alone would pass ``--full-budget-gb`` is not run (marked so).

The same table on paper for Qwen3-4B (hidden 2,560) and Qwen3-32B (hidden 5,120) from the shapes
at the GPU recipes' step size follows the measured one. Results: ``<out>/vocab_memory.json``
and ``vocab_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936
MODES = {  # name: (supervision.scoring, trainer.vocab_chunk_tokens)
    "sampled": ("sampled", 0),
    "topk": ("topk", 0),
    "full": ("full", -1),
    "full chunked": ("full", 0),
    "hidden": ("hidden", 0),
}
TOP_K = 64


def rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_models(out: Path, hidden: int) -> dict[str, str]:
    """The teacher and the student (seeds 1 and 0), saved once under ``out/models``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opd.models import load_tokenizer, save_model, smollm2_tokenizer_dir

    dirs = {}
    for role, seed in (("teacher", 1), ("student", 0)):
        directory = out / "models" / f"{role}-h{hidden}"
        dirs[role] = str(directory)
        if (directory / "model.safetensors").is_file():
            continue
        torch.manual_seed(seed)
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                             num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
                             tie_word_embeddings=True, bos_token_id=None)
        save_model(Qwen3ForCausalLM(config), load_tokenizer(smollm2_tokenizer_dir()), directory)
    return dirs


def episodes(model_dir: str, scored: int, row_tokens: int):
    """Rows of ``row_tokens`` random tokens, turns of 64: an observation, then a response of half
    the turn; ``scored`` response tokens in all."""
    import torch

    from opd.chat import ChatFormat
    from opd.models import load_tokenizer
    from opd.trajectory import Trajectory, Turn

    fmt = ChatFormat.from_tokenizer(load_tokenizer(model_dir))
    gen = torch.Generator().manual_seed(0)
    trajs, left = [], scored
    while left > 0:
        turns = []
        length = 0
        while length < row_tokens and left > 0:
            n_response = min(32, left)
            prompt = fmt.message_ids("user", torch.randint(100, VOCAB, (22,), generator=gen).tolist()) + \
                fmt.assistant_header_ids()
            response = torch.randint(100, VOCAB, (n_response - 1,), generator=gen).tolist() + [fmt.im_end_id]
            turns.append(Turn(prompt_ids=prompt, response_ids=response, response_logprobs=[-1.0] * len(response)))
            length += len(prompt) + len(response)
            left -= n_response
        trajs.append(Trajectory(task=f"row{len(trajs)}", turns=turns))
    return trajs, fmt


def teacher_role(args) -> dict:
    """Score the rows with the real HF engine; write the answer for the trainer's process."""
    import torch
    from safetensors.torch import save_file

    from opd.generation.base import TokenScores
    from opd.generation.hf import HFEngine
    from opd.models import load_model
    from opd.supervision.teacher_view import score_trajectories

    torch.set_num_threads(args.threads)
    trajs, fmt = episodes(args.teacher, args.n, args.row_tokens)
    engine = HFEngine(load_model(args.teacher), fmt.pad_id, device="cpu")
    base = rss_mb()
    reset_peak()
    start = time.perf_counter()
    scores = score_trajectories(engine, trajs, "full", fmt, 16, args.scoring, TOP_K, 4096)
    seconds = time.perf_counter() - start
    peak = rss_mb("VmHWM")
    tensors = {}
    for i, s in enumerate(scores):
        tensors[f"{i}.logprobs"] = torch.tensor(s.logprobs)
        for name in ("topk_ids", "topk_logprobs", "tail_logprob", "full_logprobs", "hidden"):
            if getattr(s, name) is not None:
                tensors[f"{i}.{name}"] = getattr(s, name).contiguous()
    if args.scoring == "hidden":
        head = engine.output_head()
        tensors["head.weight"] = head.weight.contiguous()
    save_file(tensors, args.payload)
    light = [TokenScores(s.logprobs) for s in scores]
    return {"teacher_extra_mb": peak - base, "teacher_s": seconds, "payload_bytes": sum(s.nbytes() for s in scores),
            "driver_bytes": len(pickle.dumps(light, protocol=5)), "rows": len(trajs),
            "scored_tokens": sum(len(s.logprobs) for s in scores)}


def trainer_role(args) -> dict:
    """Receive the answer, build the batch, train one step; the peak above the trainer at rest."""
    import torch
    from safetensors.torch import load_file

    from opd.algorithms.step import build_token_batch
    from opd.generation.base import TokenScores
    from opd.schema import TrainerConfig
    from opd.training.trainer import StudentTrainer, TrainerSpec
    from opd.trajectory import LinearHead

    trajs, fmt = episodes(args.student, args.n, args.row_tokens)
    cfg = TrainerConfig(engine="torch", learning_rate=1e-6, warmup_steps=0, micro_batch_size=len(trajs),
                        micro_batch_tokens=4096, vocab_chunk_tokens=args.chunk)
    trainer = StudentTrainer(TrainerSpec(trainer=cfg, loss_terms=(("reverse_kl", 1.0, {}),), model_dir=args.student,
                                         episodes_per_step=len(trajs), torch_threads=args.threads))
    for p in trainer.engine.module.parameters():  # AdamW's state exists before the step, as in a run
        trainer.engine.optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                                             "step": torch.tensor(0.0)}
    base = rss_mb()
    reset_peak()
    start = time.perf_counter()
    tensors = load_file(args.payload)
    if "head.weight" in tensors:
        trainer.set_teacher_head(LinearHead(tensors.pop("head.weight")))
    scores = []
    for i in range(len(trajs)):
        fields = {name: tensors.get(f"{i}.{name}") for name in ("topk_ids", "topk_logprobs", "tail_logprob",
                                                                "full_logprobs", "hidden")}
        scores.append(TokenScores(tensors[f"{i}.logprobs"].tolist(), **fields))
    del tensors
    metrics = trainer.train_step(build_token_batch(trajs, scores, fmt.pad_id, fmt))
    seconds = time.perf_counter() - start
    return {"trainer_extra_mb": rss_mb("VmHWM") - base, "trainer_s": seconds, "loss": metrics["loss"],
            "reverse_kl": metrics.get("reverse_kl/reverse_kl", float("nan"))}


def role_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for key in ("role", "teacher", "student", "scoring", "payload"):
        parser.add_argument(f"--{key}")
    for key in ("n", "row_tokens", "chunk", "threads"):
        parser.add_argument(f"--{key}", type=int)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from opd.cli import _quiet_libraries

    _quiet_libraries()
    result = teacher_role(args) if args.role == "teacher" else trainer_role(args)
    print("RESULT " + json.dumps(result), flush=True)


def run_role(role: str, **kwargs) -> dict:
    cmd = [sys.executable, __file__, "--role-process", f"--role={role}", *[f"--{k}={v}" for k, v in kwargs.items()]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{role} process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def on_paper(n: int, hidden: int, micro: int = 2048, top_k: int = TOP_K, chunk: int = 2**25 // VOCAB) -> dict:
    """Bytes from the shapes: the payload, and what the loss adds to the trainer beside the model
    and its activations (the teacher's answer for the step, then the student's ``[rows, V]``
    log-softmax with its logits and gradient, three float32 copies, for a micro-batch's ``micro``
    scored tokens at once or a chunk's). Float32 rows; a GPU teacher's hidden states and head in
    bfloat16."""
    v = VOCAB
    rows_all, rows_chunk = 3 * 4 * micro * v, 3 * 4 * chunk * v
    topk = n * (4 + top_k * 12 + 4)
    return {
        "sampled": {"payload": 4 * n, "trainer_extra": 4 * n + rows_chunk},
        "topk": {"payload": topk, "trainer_extra": topk + rows_chunk},
        "full": {"payload": 4 * n * (1 + v), "trainer_extra": 4 * n * (1 + v) + rows_all},
        "full chunked": {"payload": 4 * n * (1 + v), "trainer_extra": 4 * n * (1 + v) + rows_chunk},
        "hidden": {"payload": n * (4 + 2 * hidden), "trainer_extra": n * (4 + 2 * hidden) + 2 * v * hidden + rows_chunk},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536],
                        help="scored tokens per step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--row-tokens", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--full-budget-gb", type=float, default=4.0,
                        help="skip a configuration whose [N, V] float32 rows alone pass this")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="runs/bench_vocab_memory")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from opd.cli import _quiet_libraries

    _quiet_libraries()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dirs = build_models(out, args.hidden)
    rows = []
    for n in args.tokens:
        for mode in args.modes:
            scoring, chunk = MODES[mode]
            rows_gb = 4 * n * VOCAB / 2**30
            if scoring == "full" and rows_gb > args.full_budget_gb:
                rows.append({"mode": mode, "n": n, "skipped": f"[N, V] rows alone: {rows_gb:.1f} GB"})
                print(f"{mode:>13} N={n:>6}: skipped ({rows[-1]['skipped']})", flush=True)
                continue
            payload = str(out / "payload.safetensors")
            common = dict(n=n, row_tokens=args.row_tokens, threads=args.threads, payload=payload)
            teacher = run_role("teacher", teacher=dirs["teacher"], student=dirs["student"], scoring=scoring, chunk=chunk,
                               **common)
            trainer = run_role("trainer", teacher=dirs["teacher"], student=dirs["student"], scoring=scoring, chunk=chunk,
                               **common)
            Path(payload).unlink(missing_ok=True)
            rows.append({"mode": mode, "n": n, **teacher, **trainer})
            r = rows[-1]
            print(f"{mode:>13} N={n:>6}: payload {r['payload_bytes'] / 2**20:9.1f} MiB, driver "
                  f"{r['driver_bytes'] / 2**20:6.2f} MiB, teacher +{r['teacher_extra_mb']:7.0f} MiB, trainer "
                  f"+{r['trainer_extra_mb']:7.0f} MiB ({r['teacher_s']:.1f} s + {r['trainer_s']:.1f} s), "
                  f"reverse KL {r['reverse_kl']:.6f}", flush=True)
    paper = {f"{name} teacher, N={n:,}": on_paper(n, hidden) for name, hidden in (("Qwen3-4B", 2560), ("Qwen3-32B", 5120))
             for n in (65_536,)}
    result = {"vocab": VOCAB, "hidden": args.hidden, "row_tokens": args.row_tokens, "threads": args.threads,
              "rows": rows, "on_paper": paper}
    (out / "vocab_memory.json").write_text(json.dumps(result, indent=2))
    (out / "vocab_memory.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = [f"Vocabulary {result['vocab']:,}, hidden {result['hidden']}, rows of {result['row_tokens']} tokens "
             f"(half scored), {result['threads']} threads.", "",
             "| mode | scored tokens | payload MiB | driver fetches MiB | teacher peak +MiB | trainer peak +MiB | "
             "teacher s | trainer s | reverse KL |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['mode']} | {r['n']:,} | not run: {r['skipped']} | | | | | | |")
            continue
        lines.append(f"| {r['mode']} | {r['n']:,} | {r['payload_bytes'] / 2**20:,.1f} | {r['driver_bytes'] / 2**20:.2f} | "
                     f"{r['teacher_extra_mb']:,.0f} | {r['trainer_extra_mb']:,.0f} | {r['teacher_s']:.1f} | "
                     f"{r['trainer_s']:.1f} | {r['reverse_kl']:.6f} |")
    lines += ["", "On paper (GiB; float32 rows, a bfloat16 teacher's hidden states and head, micro-batches of 2,048 "
              "scored tokens, chunks of 220):", "",
              "| model, scored tokens | mode | payload | trainer extra |", "|---|---|---:|---:|"]
    for where, modes in result["on_paper"].items():
        for mode, b in modes.items():
            lines.append(f"| {where} | {mode} | {b['payload'] / 2**30:,.2f} | {b['trainer_extra'] / 2**30:,.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--role-process":
        role_main(sys.argv[2:])
    else:
        main()
