"""Shared fixtures: a real byte-level BPE tokenizer trained here and tiny Qwen3 models.

Nothing is downloaded: the tokenizer is trained on FrozenLake's own text in a second, and the
models are built from a config (head_dim 64, as vLLM's CPU attention requires).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from opd.schema import TinyArchConfig  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from environments.frozenlake import FrozenLakeTextEnv
    from opd.models import train_chat_tokenizer

    env = FrozenLakeTextEnv(n_train_tasks=40, n_eval_tasks=10)
    corpus = ["left down right up", "<think> I should weigh the holes first </think>", "Invalid action"]
    for task in env.task_ids("train"):
        obs, info = env.reset(options={"task": task})
        corpus.append(obs)
        for action in ("right", "down", "up"):
            obs, _, terminated, truncated, _ = env.step(action)
            corpus.append(obs)
            if terminated or truncated:
                break
    return train_chat_tokenizer(corpus, vocab_size=300)


@pytest.fixture(scope="session")
def fmt(tokenizer):
    from opd.chat import ChatFormat

    return ChatFormat.from_tokenizer(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A saved tiny Qwen3 (random init, seed 0) with the test tokenizer."""
    from opd.models import save_model, tiny_qwen3

    directory = tmp_path_factory.mktemp("tiny-model")
    save_model(tiny_qwen3(tokenizer, TinyArchConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128), seed=0),
               tokenizer, directory)
    return str(directory)
