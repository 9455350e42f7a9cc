"""A served teacher against in-process ones, on the same model and machine: equality of the
scores and their cost.

    .venv/bin/python bench/server_teacher.py            # about 6 minutes on 2 idle cores
    .venv/bin/python bench/server_teacher.py --model /path/to/model --trajectories 8 --turns 10

The model is SmolLM2-135M-Instruct (the real model, offline; ``--model`` takes any directory).
The trajectories are the first ``--turns`` turns of a ten-turn episode in its tokenizer (each
turn a reasoning block and an action; :func:`tests.unit.test_chat.ten_turn_trajectory`), scored in the state-grounded view
(every turn a branch) and the full view (every turn on the trunk).

- **Equality**: the teacher's logprobs of the same student tokens through ``vllm serve``
  (:class:`opd.generation.server.ServerEngine`) against the in-process vLLM engine and the HF
  engine: max absolute difference, sampled and top-k (20).
- **Cost**: response tokens scored per second, through the server (both layouts:
  ``teacher.server.request: episode`` and ``turn``) and in process (HF, vLLM), each the best of
  ``--repeats`` passes over the same trajectories, with the tokens each sent through the model. Every
  engine runs on 2 torch threads (``OMP_NUM_THREADS=2``; vLLM lowers its own to 1 without it),
  the server in its own process, idle while the others run.

Results: ``<out>/server_teacher.json`` and ``server_teacher.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def max_diff(a, b) -> float:
    worst = max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs))
    if a[0].topk_logprobs is not None:
        worst = max(worst, max(float((s.topk_logprobs - t.topk_logprobs).abs().max()) for s, t in zip(a, b)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: SmolLM2-135M-Instruct, offline)")
    parser.add_argument("--trajectories", type=int, default=1)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="passes per engine in the cost table (the best is kept)")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")  # before torch: vLLM (in process and served) keeps 2 threads

    import torch

    from opd.chat import ChatFormat
    from opd.generation.hf import HFEngine
    from opd.generation.server import LocalServer, ServerEngine, ServerSpec
    from opd.generation.vllm_engine import VLLMEngine
    from opd.models import load_tokenizer, smollm2_model_dir
    from opd.supervision.teacher_view import score_trajectories
    from tests.unit.test_chat import ten_turn_trajectory

    torch.set_num_threads(2)
    model = args.model or smollm2_model_dir()
    tokenizer = load_tokenizer(model)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    trajs = [ten_turn_trajectory(tokenizer, fmt) for _ in range(args.trajectories)]
    for traj in trajs:
        del traj.turns[args.turns:]
    scored = sum(t.num_response_tokens for t in trajs)
    print(f"model {model}; {len(trajs)} trajectories of {args.turns} turns, {scored} response tokens", flush=True)

    server = LocalServer(model, "teacher", max_model_len=4096).start()
    try:
        engines = {"hf": HFEngine.from_pretrained(model), "vllm": VLLMEngine.from_pretrained(model),
                   "server (episode)": ServerEngine(ServerSpec((server.url,), "teacher", request="episode")),
                   "server (turn)": ServerEngine(ServerSpec((server.url,), "teacher", request="turn"))}
        equality, cost = [], []
        for view in ("state_grounded", "full"):
            for mode in ("sampled", "topk"):
                got = {name: score_trajectories(e, trajs, view, fmt, mode=mode, top_k=20) for name, e in engines.items()}
                row = {"view": view, "mode": mode,
                       "served vs vllm": max_diff(got["server (episode)"], got["vllm"]),
                       "served vs hf": max_diff(got["server (episode)"], got["hf"]),
                       "vllm vs hf": max_diff(got["vllm"], got["hf"]),
                       "turn vs episode": max_diff(got["server (turn)"], got["server (episode)"])}
                equality.append(row)
                print(json.dumps(row), flush=True)
            for name, engine in engines.items():
                sent_before = getattr(engine, "scored_tokens", 0)
                seconds = best_of(lambda: score_trajectories(engine, trajs, view, fmt, mode="sampled"), args.repeats)
                row = {"view": view, "engine": name, "seconds": seconds, "tokens_per_s": scored / seconds}
                if hasattr(engine, "scored_tokens"):
                    row["tokens_sent"] = (engine.scored_tokens - sent_before) // args.repeats
                cost.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_teacher.json").write_text(json.dumps({"model": model, "trajectories": len(trajs), "turns": args.turns,
                                                          "response_tokens": scored, "equality": equality,
                                                          "cost": cost}, indent=2))
    lines = ["| view | mode | served vs in-process vLLM | served vs HF | vLLM vs HF | turn vs episode |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['view']} | {r['mode']} | {r['served vs vllm']:.2e} | {r['served vs hf']:.2e} | "
              f"{r['vllm vs hf']:.2e} | {r['turn vs episode']:.2e} |" for r in equality]
    lines += ["", "| view | engine | response tokens scored / s | seconds | tokens sent |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['view']} | {r['engine']} | {r['tokens_per_s']:,.0f} | {r['seconds']:.2f} | "
              f"{r.get('tokens_sent', '')} |" for r in cost]
    (out / "server_teacher.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
