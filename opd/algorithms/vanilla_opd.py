"""Vanilla on-policy distillation, and state-grounded OPD, for multi-turn agents.

One step, top to bottom:

1. **Rollout.** The student plays ``episodes_per_step`` training tasks (think-then-act at every
   turn), recording each token exactly as sampled with its behaviour logprob.
2. **Supervision.** The teacher scores every student response token (``supervision.scoring``:
   its logprob of the token, its top-k, or its full distribution) under its view of the turn:
   ``full`` (the student's own history, as in vanilla OPD) or ``state_grounded`` (the task, the
   executed actions and the observations only: no student reasoning reaches the teacher, so
   its grades stay in-distribution). All turns of a trajectory share one packed forward.
3. **Update.** One sequence per trajectory (every turn's context in the student's own view is
   a prefix of it) with the recipe's losses, by default the sampled reverse KL used as a
   per-token advantage ``log pi_T - log mu`` with a PPO-clipped importance ratio. Episodes of
   the same task (``rollout.group_size``) also get GRPO advantages, for ``ppo_clip``.
4. **Sync.** The trainer's new weights go into the rollout engine, timed.

Departure from the papers: the per-token advantage is not discounted or summed over future
tokens (each token is graded on its own, as in Tinker's OPD recipe); the papers' multi-turn
OPD does the same for the reverse-KL term.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any

import ray
import torch

from opd.chat import student_sequence
from opd.generation.base import TokenScores
from opd.losses import group_advantages
from opd.trajectory import success_rate
from opd.runtime.actors import sync_weights
from opd.trajectory import TokenBatch, Trajectory


def sample_tasks(tasks: list[str], n: int, seed: int, step: int, group_size: int = 1) -> list[str]:
    """Step ``step``'s training tasks, each repeated ``group_size`` times in a row: a pure
    function of (seed, step), so a resumed run draws exactly the tasks an uninterrupted one would."""
    rng = random.Random(f"{seed}:{step}")
    return [task for _ in range(n // group_size) for task in [tasks[rng.randrange(len(tasks))]] * group_size]


def build_token_batch(trajs: list[Trajectory], scores: list[TokenScores] | None, pad_id: int, fmt,
                      group_size: int = 1) -> TokenBatch:
    """One row per trajectory with the teacher's scores placed on its response tokens (none for
    ``scores=None``, e.g. GRPO), and group-relative advantages of the episodes' returns (groups
    of ``group_size`` consecutive trajectories, which played the same task)."""
    rows = [student_sequence(traj, fmt) for traj in trajs]
    # Token n of a trajectory's flat scores sits at the n-th response position of its row.
    index = [[p for start, end in row["response_positions"] for p in range(start, end)] for row in rows]
    batch = TokenBatch.from_rows(rows, pad_id)
    B, T = batch.input_ids_BT.shape
    scores = scores or []
    for b, (positions, score) in enumerate(zip(index, scores)):
        batch.teacher_logprobs_BT[b, positions] = torch.tensor(score.logprobs)
    if scores and scores[0].topk_ids is not None:
        K = scores[0].topk_ids.shape[1]
        ids_BTK = torch.zeros(B, T, K, dtype=torch.long)
        logp_BTK = torch.full((B, T, K), float("-inf"))
        tail_BT = torch.zeros(B, T)
        for b, (positions, score) in enumerate(zip(index, scores)):
            ids_BTK[b, positions] = score.topk_ids
            logp_BTK[b, positions] = score.topk_logprobs
            tail_BT[b, positions] = score.tail_logprob
        batch = replace(batch, teacher_topk_ids_BTK=ids_BTK, teacher_topk_logprobs_BTK=logp_BTK, teacher_tail_logprob_BT=tail_BT)
    if scores and scores[0].full_logprobs is not None:
        full_BTV = torch.zeros(B, T, scores[0].full_logprobs.shape[1])
        for b, (positions, score) in enumerate(zip(index, scores)):
            full_BTV[b, positions] = score.full_logprobs
        batch = replace(batch, teacher_full_logprobs_BTV=full_BTV)
    rewards = torch.tensor([traj.total_reward for traj in trajs])
    groups = torch.arange(len(trajs)) // max(1, group_size)
    return replace(batch, advantage_B=group_advantages(rewards, groups))


def train_step(ctx: Any, step: int) -> dict[str, float]:
    """Run one OPD step; ``ctx`` is the driver's :class:`opd.runtime.driver.RunContext`."""
    cfg, workers = ctx.cfg, ctx.workers
    start = time.perf_counter()
    tasks = sample_tasks(ctx.train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, step, cfg.rollout.group_size)
    trajs, gen = ray.get(workers.rollout.collect.remote(ctx.env_factory, tasks, ctx.train_settings, cfg.run.seed * 100003 + step))
    t_gen = time.perf_counter()
    scores = ray.get(workers.teacher.score.remote(trajs, cfg.supervision))
    t_score = time.perf_counter()
    batch = build_token_batch(trajs, scores, ctx.fmt.pad_id, ctx.fmt, cfg.rollout.group_size)
    train_metrics = ray.get(workers.trainer.train_step.remote(batch))
    t_train = time.perf_counter()
    sync = sync_weights(workers)
    end = time.perf_counter()
    metrics = {k: v for k, v in train_metrics.items() if not k.startswith("time/")}
    metrics.update(episode_metrics(trajs, gen))
    metrics.update(lockstep_decode_metrics(trajs))
    metrics.update({
        "teacher_payload_mb": sum(s.nbytes() for s in scores) / 2**20,
        "time/generation_s": t_gen - start,
        "time/teacher_scoring_s": t_score - t_gen,
        "time/training_s": t_train - t_score,
        "time/weight_sync_s": sync["weight_sync_s"],
        "time/step_s": end - start,
    })
    reverse_kl = [v for k, v in metrics.items() if k.endswith("/reverse_kl")]
    if reverse_kl:
        metrics["reverse_kl_per_token"] = reverse_kl[0]
    return metrics


def lockstep_decode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """The decode steps of a lockstep rollout (one ``generate`` call per turn for every live
    episode, :func:`opd.rollout.vanilla.run_episodes`) and their mean width: turn ``t`` runs as
    many steps as its longest response, each over the rows still generating. ActFirst's stream
    logs the same (``actfirst/stream_steps``), so the bench can compare the cost of a step."""
    steps = rows = 0
    for t in range(max((len(traj.turns) for traj in trajs), default=0)):
        lengths = [len(traj.turns[t].response_ids) for traj in trajs if len(traj.turns) > t]
        steps += max(lengths)
        rows += sum(lengths)
    return {"rollout/decode_steps": float(steps), "rollout/decode_rows_mean": rows / max(steps, 1)}


def episode_metrics(trajs: list[Trajectory], gen: dict[str, float]) -> dict[str, float]:
    """What every algorithm logs about a step's episodes and their generation."""
    turns = [turn for t in trajs for turn in t.turns]
    return {
        "success": success_rate(trajs),
        "turns_per_episode": len(turns) / max(len(trajs), 1),
        "env_errors": float(sum(t.end_reason == "env_error" for t in trajs)),
        "env_restarts": gen.get("env_restarts", 0.0),
        "valid_action_rate": sum(bool(turn.info.get("valid_action", False)) for turn in turns) / max(len(turns), 1),
        "tokens_per_s": gen["generated_tokens"] / max(gen["generation_s"], 1e-9),
    }
