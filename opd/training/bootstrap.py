"""Build a tiny model by SFT on a scripted policy's trajectories, cached by content hash.

This is how the CPU quickstart gets a teacher and a student with no download: a byte-level BPE
tokenizer is trained on the environment's own text, then

- the teacher is a tiny Qwen3 fine-tuned on the environment expert's trajectories, and
- the student is a tiny Qwen3 fine-tuned on uniformly random *valid* actions: it has learnt the
  answer format, not the task (the role a small pretrained instruct model plays in a real run).

Both share the one tokenizer, so the teacher can score the student's tokens. Built models live
under ``bootstrap.cache_dir/<hash>/`` and are reused by every later run with the same settings.

Example:
    >>> path = build_bootstrap_model(cfg.teacher.bootstrap, cfg.env, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from opd.chat import ChatFormat, first_prompt_ids, next_prompt_ids, student_sequence
from opd.envs import EnvFactory
from opd.models import (load_tokenizer, save_directory_atomically, save_model, smollm2_tokenizer_dir, tiny_qwen3,
                        train_chat_tokenizer)
from opd.trajectory import TokenBatch, Trajectory, Turn

TOKENIZER_CORPUS_EPISODES = 300
CACHE_VERSION = 2  # bump when the recipe of a bootstrapped model, or its environment's text, changes


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def scripted_episode(env, task: str, choose: Callable[[dict], str], seed: int, explore_prob: float = 0.0,
                     rng: random.Random | None = None) -> list[tuple[str, str, bool]]:
    """Play ``task`` with ``choose(info) -> action``.

    With probability ``explore_prob`` a turn plays a random valid move instead, marked as not to
    be trained on (noise injection, as in DART): the policy then sees states off its own path
    and learns to recover from them, which is what a teacher grading a student's mistakes needs.

    Returns:
        ``[(observation, action, train_on), ...]``: each observation is the one the action
        answers; the last entry is the final observation with an empty action.
    """
    rng = rng or random.Random(seed)
    obs, info = env.reset(seed=seed, options={"task": task})
    steps = []
    while True:
        admissible = info.get("admissible_actions") or []
        explore = bool(admissible) and rng.random() < explore_prob
        action = rng.choice(admissible) if explore else choose(info)
        if action is None:  # the policy has no move here (an expert that lost track): stop
            steps.append((obs, "", False))
            return steps
        steps.append((obs, action, not explore))
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            steps.append((obs, "", False))
            return steps


def _policy(kind: str, rng: random.Random) -> Callable[[dict], str | None]:
    """The scripted policy: the env's expert (else its first admissible action), or a uniformly
    random admissible action (else the expert's). ``None`` when the env offers neither."""

    def expert(info: dict) -> str | None:
        return info.get("expert_action") or next(iter(info.get("admissible_actions") or []), None)

    if kind == "expert":
        return expert
    return lambda info: rng.choice(info["admissible_actions"]) if info.get("admissible_actions") else expert(info)


def build_tokenizer(env_cfg: Any, vocab_size: int, cache_root: Path, corpus_episodes: int = TOKENIZER_CORPUS_EPISODES):
    """The shared tokenizer for an environment, trained once on its text and cached."""
    payload = {"v": CACHE_VERSION, "env": env_cfg.id, "kwargs": _plain(env_cfg.kwargs), "vocab": vocab_size}
    if corpus_episodes != TOKENIZER_CORPUS_EPISODES:  # the default stays out: earlier caches keep their key
        payload["corpus"] = corpus_episodes
    key = _digest(payload)
    directory = cache_root / f"tokenizer-{key}"
    if (directory / "tokenizer.json").is_file():
        return load_tokenizer(str(directory))
    factory = EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module)
    env = factory()
    tasks = env.unwrapped.task_ids(env_cfg.train_split)
    rng = random.Random(0)
    corpus = ["left", "down", "right", "up", "user", "assistant", "system", "Invalid action"]
    for i in range(min(corpus_episodes, len(tasks))):
        for obs, action, _ in scripted_episode(env, tasks[i], _policy("random_valid", rng), seed=i):
            corpus += [obs, action]
    env.close()
    tokenizer = train_chat_tokenizer(corpus, vocab_size=vocab_size)
    save_directory_atomically(directory, tokenizer.save_pretrained)
    return load_tokenizer(str(directory))


def resolve_tokenizer(boot: Any, env_cfg: Any, cache_root: Path):
    """The tokenizer ``boot.tokenizer`` names: trained on the env's text (``""``), SmolLM2's
    (``"smollm2"``), or the one saved in a directory."""
    if not boot.tokenizer:
        return build_tokenizer(env_cfg, boot.tokenizer_vocab_size, cache_root, boot.corpus_episodes)
    if boot.tokenizer == "smollm2":
        return load_tokenizer(smollm2_tokenizer_dir(cache_root))
    return load_tokenizer(boot.tokenizer)


def _sft_row(steps: list[tuple[str, str, bool]], task: str, tokenizer, fmt: ChatFormat) -> dict[str, list]:
    """One SFT sequence; turns not to be trained on (exploration) get no loss."""
    traj = Trajectory(task=task)
    for k, (obs, action, _) in enumerate(steps[:-1]):
        prompt = first_prompt_ids(fmt, tokenizer, obs) if k == 0 else next_prompt_ids(fmt, tokenizer, obs)
        response = tokenizer.encode(action, add_special_tokens=False) + [fmt.im_end_id]
        traj.turns.append(Turn(prompt_ids=prompt, response_ids=response, response_logprobs=[0.0] * len(response),
                               action_start=0, action_end=len(response) - 1, action_text=action))
    row = student_sequence(traj, fmt)
    for (start, end), (_, _, train_on) in zip(row["response_positions"], steps):
        if not train_on:
            row["loss_mask"][start:end] = [0.0] * (end - start)
    return row


def build_bootstrap_model(boot: Any, env_cfg: Any, seed: int, log: Callable[[str], None] = print) -> str:
    """Return the directory of the model ``boot`` describes, building it on first use."""
    cache_root = Path(os.path.expanduser(boot.cache_dir))
    # An unset tokenizer stays out of the key, so models built before that option keep their key.
    settings = {k: v for k, v in _plain(boot).items() if k != "cache_dir" and not (k == "tokenizer" and not v)
                and not (k == "corpus_episodes" and v == TOKENIZER_CORPUS_EPISODES)}
    key = _digest({"v": CACHE_VERSION, "boot": settings, "env": env_cfg.id,
                   "kwargs": _plain(env_cfg.kwargs), "split": env_cfg.train_split, "seed": seed})
    directory = cache_root / f"{boot.policy}-{key}"
    if (directory / "model.safetensors").is_file():
        return str(directory)
    tokenizer = resolve_tokenizer(boot, env_cfg, cache_root)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    env = EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module)()
    tasks = env.unwrapped.task_ids(env_cfg.train_split)
    rng = random.Random(seed)
    choose = _policy(boot.policy, rng)
    rows = []
    for i in range(boot.n_episodes):
        task = tasks[i % len(tasks)]
        steps = scripted_episode(env, task, choose, seed=i, explore_prob=boot.explore_prob, rng=rng)
        rows.append(_sft_row(steps, task, tokenizer, fmt))
    env.close()
    model = tiny_qwen3(tokenizer, boot.arch, seed=seed).train()
    log(f"bootstrap: SFT of a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter model on "
        f"{len(rows)} {boot.policy} episodes for {boot.sft_steps} steps (cached in {directory})")
    sft(model, rows, fmt.pad_id, boot, seed, log)
    save_directory_atomically(directory, lambda d: save_model(model.eval(), tokenizer, d))
    return str(directory)


def sft(model, rows: list[dict], pad_id: int, boot: Any, seed: int, log: Callable[[str], None]) -> None:
    """Cross-entropy on response tokens, AdamW with linear warm-up and cosine decay."""
    from opd.losses import sft as sft_loss
    from opd.training.trainer import token_logprobs

    optimizer = torch.optim.AdamW(model.parameters(), lr=boot.learning_rate, weight_decay=0.0)
    warmup = max(1, boot.sft_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, boot.sft_steps) / boot.sft_steps)),
    )
    rng = random.Random(seed)
    for step in range(boot.sft_steps):
        batch = TokenBatch.from_rows(rng.sample(rows, min(boot.batch_size, len(rows))), pad_id)
        loss, _ = sft_loss(batch.with_student(token_logprobs(model, batch)), {})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % max(1, boot.sft_steps // 5) == 0:
            log(f"bootstrap: step {step + 1}/{boot.sft_steps} loss {loss.item():.4f}")
