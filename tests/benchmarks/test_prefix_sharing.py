"""Benchmark: prefix-shared (packed) teacher scoring against naive per-turn forwards.

For trajectories of T = 2, 5, 10, 20, 30 and 50 turns (FrozenLake observations, responses with
a reasoning block, state-grounded view), both ways are timed in the same run on the same engine:

- packed: one forward per trajectory, all turns as branches off one trunk;
- naive: one forward per turn over the full rendered context (the T requests of a trajectory
  batched together, which is the fair baseline on a CPU).

Beside each speed-up, the ideal one the token counts give (the tokens the naive forwards run over
those of the packed one) and the measured share of it; and the packed pass's peak memory over
the setup's, each T in a fresh process (``VmHWM``), against the episode's packed tokens, so that a
pass whose memory grows faster than the episode shows.

The model is a 4-layer, 256-wide Qwen3 so that compute, not Python overhead, dominates. Targets:
at least T/2 faster at T = 10, with logprobs equal to 1e-4 (issue 3); at least 15x at T = 20, and
at T = 50 within 80% of the ideal (issue 52).

    python -m tests.benchmarks.test_prefix_sharing     # prints the table
"""

from __future__ import annotations

import time

import pytest

from opd.chat import ChatFormat, first_prompt_ids, next_prompt_ids
from opd.schema import TinyArchConfig
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.models import tiny_qwen3, train_chat_tokenizer
from opd.supervision.teacher_view import naive_requests, pack_trajectory, unpack_scores
from opd.trajectory import Trajectory, Turn

TURNS = (2, 5, 10, 20, 30, 50)
RESPONSE = "<think> plan the route around the holes </think> left"


def _setup():
    env = EnvFactory("opd/FrozenLakeText-v0", {"max_turns": max(TURNS), "n_train_tasks": 8, "n_eval_tasks": 2})()
    obs, _ = env.reset(options={"task": "fl4-train-00000"})
    tokenizer = train_chat_tokenizer([obs, "left down right up", RESPONSE], vocab_size=300)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    arch = TinyArchConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768)
    engine = HFEngine(tiny_qwen3(tokenizer, arch, seed=0), pad_id=fmt.pad_id, device="cpu")
    return env, tokenizer, fmt, engine


def _trajectory(env, tokenizer, fmt, turns: int) -> Trajectory:
    traj = Trajectory(task="fl4-train-00000")
    obs, _ = env.reset(options={"task": "fl4-train-00000"})
    prompt = first_prompt_ids(fmt, tokenizer, obs)
    for _ in range(turns):  # "left" from the start bumps the wall: the episode never ends early
        response = tokenizer.encode(RESPONSE, add_special_tokens=False) + [fmt.im_end_id]
        start, end = fmt.action_span(response)
        obs, *_ = env.step("left")
        traj.turns.append(Turn(prompt, response, [0.0] * len(response), start, end, "left", obs))
        prompt = next_prompt_ids(fmt, tokenizer, obs)
    return traj


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_benchmark(n_trajectories: int = 4, repeats: int = 2) -> list[dict]:
    env, tokenizer, fmt, engine = _setup()
    rows = []
    for turns in TURNS:
        trajs = [_trajectory(env, tokenizer, fmt, turns) for _ in range(n_trajectories)]
        packed = lambda: engine.score([pack_trajectory(t, "state_grounded", fmt) for t in trajs], batch_size=n_trajectories)  # noqa: E731
        naive = lambda: [engine.score(naive_requests(t, "state_grounded", fmt), batch_size=turns) for t in trajs]  # noqa: E731
        packed_scores, naive_scores = packed(), naive()  # warm-up, and the equality check
        diff = max(
            abs(a - b)
            for traj, flat, per_turn in zip(trajs, packed_scores, naive_scores)
            for p, n in zip(unpack_scores(traj, flat.logprobs), [s.logprobs for s in per_turn])
            for a, b in zip(p, n)
        )
        # Packed scoring is cheap, so it gets more repeats: the best of several is what the
        # machine can do when nothing else disturbs it (these machines are noisy).
        packed_s, naive_s = _best_of(packed, 3 * repeats), _best_of(naive, repeats)
        packed_tokens = len(pack_trajectory(trajs[0], "state_grounded", fmt).input_ids)
        naive_tokens = sum(len(r.input_ids) for r in naive_requests(trajs[0], "state_grounded", fmt))
        rows.append({"turns": turns, "packed_s": packed_s, "naive_s": naive_s, "speedup": naive_s / packed_s,
                     "max_abs_diff": diff, "packed_tokens": packed_tokens, "naive_tokens": naive_tokens,
                     "ideal": naive_tokens / packed_tokens, "of_ideal": naive_s / packed_s / (naive_tokens / packed_tokens)})
    return rows


def packed_peak_mb(turns: int, n_trajectories: int) -> float:
    """In a fresh process: the packed pass's peak resident memory over the setup's, in MiB."""
    import json
    import subprocess
    import sys

    code = (f"import json, torch; torch.set_num_threads(2)\n"
            f"from tests.benchmarks.test_prefix_sharing import _setup, _trajectory, pack_trajectory\n"
            f"from opd.training.trainer import peak_rss_mb\n"
            f"env, tokenizer, fmt, engine = _setup()\n"
            f"trajs = [_trajectory(env, tokenizer, fmt, {turns}) for _ in range({n_trajectories})]\n"
            f"requests = [pack_trajectory(t, 'state_grounded', fmt) for t in trajs]\n"
            f"before = peak_rss_mb()\n"
            f"engine.score(requests, batch_size={n_trajectories})\n"
            f"print(json.dumps(peak_rss_mb() - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.benchmark
def test_prefix_sharing_is_faster_and_exact():
    rows = run_benchmark()
    for row in rows:
        print(row)
        assert row["max_abs_diff"] <= 1e-4
    at_ten = next(r for r in rows if r["turns"] == 10)
    assert at_ten["speedup"] >= 10 / 2, at_ten
    at_twenty, at_fifty = (next(r for r in rows if r["turns"] == t) for t in (20, 50))
    assert at_twenty["speedup"] >= 15, at_twenty
    assert at_fifty["of_ideal"] >= 0.8, at_fifty


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    print("| T | packed ms | naive ms | speed-up | ideal (tokens) | of ideal | max abs diff | tokens packed / naive "
          "| packed pass peak MiB | MiB per 1k packed tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in run_benchmark(n_trajectories=8, repeats=3):
        peak = packed_peak_mb(r["turns"], 8)
        print(f"| {r['turns']} | {1000 * r['packed_s']:.1f} | {1000 * r['naive_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['ideal']:.2f} | {r['of_ideal']:.0%} | {r['max_abs_diff']:.2e} | {r['packed_tokens']} / "
              f"{r['naive_tokens']} | {peak:.0f} | {1000 * peak / (8 * r['packed_tokens']):.2f} |", flush=True)
