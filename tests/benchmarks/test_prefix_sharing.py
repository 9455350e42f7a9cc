"""Benchmark: prefix-shared (packed) teacher scoring against naive per-turn forwards.

For trajectories of T = 2, 5, 10, 20 turns (FrozenLake observations, responses with a
reasoning block, state-grounded view), both ways are timed in the same run on the same engine:

- packed: one forward per trajectory, all turns as branches off one trunk;
- naive: one forward per turn over the full rendered context (the T requests of a trajectory
  batched together, which is the fair baseline on a CPU).

The model is a 4-layer, 256-wide Qwen3 so that compute, not Python overhead, dominates. Target
(issue 3): at least T/2 faster at T = 10, with logprobs equal to 1e-4.

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

TURNS = (2, 5, 10, 20)
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
        rows.append({"turns": turns, "packed_s": packed_s, "naive_s": naive_s, "speedup": naive_s / packed_s,
                     "max_abs_diff": diff, "packed_tokens": len(pack_trajectory(trajs[0], "state_grounded", fmt).input_ids),
                     "naive_tokens": sum(len(r.input_ids) for r in naive_requests(trajs[0], "state_grounded", fmt))})
    return rows


@pytest.mark.benchmark
def test_prefix_sharing_is_faster_and_exact():
    rows = run_benchmark()
    for row in rows:
        print(row)
        assert row["max_abs_diff"] <= 1e-4
    at_ten = next(r for r in rows if r["turns"] == 10)
    assert at_ten["speedup"] >= 10 / 2, at_ten


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    print(f"{'T':>3} {'packed ms':>10} {'naive ms':>10} {'speedup':>8} {'max|diff|':>10} {'tokens packed/naive':>20}")
    for r in run_benchmark(n_trajectories=8, repeats=3):
        print(f"{r['turns']:>3} {1000 * r['packed_s']:>10.1f} {1000 * r['naive_s']:>10.1f} {r['speedup']:>8.2f} "
              f"{r['max_abs_diff']:>10.2e} {r['packed_tokens']:>9}/{r['naive_tokens']}")
