"""GPU check of the CPU code path: the same plain classes on CUDA, without Ray.

Runs, on one GPU: real FrozenLake rollouts with the HF engine, packed against naive teacher
scoring in both views, and two DeepSpeed (NCCL) reverse-KL steps at ZeRO stages 0 and 3 with a
weight sync into the rollout engine after each. Prints one JSON line of measured values.

    python scripts/gpu_check.py            # needs a CUDA GPU; not part of the test suite
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from opd.algorithms.step import build_token_batch
from opd.chat import ChatFormat
from opd.schema import TinyArchConfig, TrainerConfig
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.models import save_model, tiny_qwen3, train_chat_tokenizer
from opd.rollout.vanilla import EpisodeSettings, run_episodes
from opd.supervision.teacher_view import naive_requests, pack_trajectory, score_trajectories, unpack_scores
from opd.training.trainer import StudentTrainer


def main() -> None:
    import os

    assert torch.cuda.is_available() or os.environ.get("OPD_GPU_CHECK_ALLOW_CPU") == "1", "this check needs a CUDA GPU"
    out: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    factory = EnvFactory("opd/FrozenLakeText-v0", {"n_train_tasks": 64, "n_eval_tasks": 8})
    env = factory()
    corpus = ["left down right up", "<think> plan </think>"]
    for task in env.unwrapped.task_ids("train")[:32]:
        corpus.append(env.reset(options={"task": task})[0])
    tokenizer = train_chat_tokenizer(corpus, vocab_size=300)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    work = tempfile.mkdtemp()
    arch = TinyArchConfig(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    save_model(tiny_qwen3(tokenizer, arch, seed=0), tokenizer, f"{work}/student")
    save_model(tiny_qwen3(tokenizer, arch, seed=1), tokenizer, f"{work}/teacher")
    student, teacher = HFEngine.from_pretrained(f"{work}/student"), HFEngine.from_pretrained(f"{work}/teacher")
    out["engine_device"] = str(student.device)
    tasks = env.unwrapped.task_ids("train")[:16]
    start = time.perf_counter()
    trajs = run_episodes(student, factory, tasks, tokenizer, fmt, EpisodeSettings(max_new_tokens=6), seed=0)
    out["rollout_s"] = round(time.perf_counter() - start, 3)
    out["turns"] = sum(len(t.turns) for t in trajs)
    worst = 0.0
    for view in ("state_grounded", "full"):
        for traj in trajs[:4]:
            packed = unpack_scores(traj, teacher.score([pack_trajectory(traj, view, fmt)])[0].logprobs)
            naive = [s.logprobs for s in teacher.score(naive_requests(traj, view, fmt))]
            worst = max(worst, max(abs(a - b) for p, n in zip(packed, naive) for a, b in zip(p, n)))
    out["packed_vs_naive_max_abs_diff"] = worst
    scores = score_trajectories(teacher, trajs, "state_grounded", fmt)
    batch = build_token_batch(trajs, scores, fmt.pad_id, fmt)
    for stage in (0, 3):
        cfg = OmegaConf.structured(TrainerConfig(learning_rate=1e-3, zero_stage=stage, micro_batch_size=8))
        trainer = StudentTrainer(cfg, [("reverse_kl", 1.0, {})], f"{work}/student", episodes_per_step=16, total_steps=2)
        losses = [trainer.train_step(batch)["loss"] for _ in range(2)]
        start = time.perf_counter()
        student.update_weights(trainer.export_weights())
        sync_s = time.perf_counter() - start
        served, trained = student.state_dict(), trainer.export_weights()
        out[f"zero{stage}"] = {
            "losses": losses,
            "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
            "weights_equal_after_sync": all(torch.equal(served[k], trained[k].cpu()) for k in trained),
            "sync_s": round(sync_s, 4),
            "trainer_device": str(trainer.engine.device),
        }
        trainer.save_checkpoint(f"{work}/ckpt{stage}")
        out[f"zero{stage}"]["hf_export"] = sorted(p.name for p in Path(f"{work}/ckpt{stage}/hf").iterdir())
        student.update_weights(HFEngine.from_pretrained(f"{work}/student").state_dict())  # reset for the next stage
        del trainer
    print("GPU_CHECK " + json.dumps(out))


if __name__ == "__main__":
    main()
