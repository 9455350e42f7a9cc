"""The bootstrap's tokenizer: a byte-level BPE trained on the environment's own text, or one
that exists (SmolLM2's, a directory).

The corpus is the text of random valid episodes on the train split, seeded with the words the
environment's actions are made of (its ``tokenizer_words``) and the chat's words, so that each is
learnt as a whole. It is trained once per setting and cached beside the models
(``tokenizer-<key>/``, :func:`opd.bootstrap.cache.tokenizer_key`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from opd.bootstrap.cache import tokenizer_key
from opd.bootstrap.rows import scripted_episode, scripted_policy
from opd.envs import EnvFactory
from opd.models import load_tokenizer, save_directory_atomically, smollm2_tokenizer_dir, train_chat_tokenizer
from opd.progress import Progress
from opd.schema import BootstrapConfig, EnvConfig

TOKENIZER_CORPUS_EPISODES = 300
CHAT_WORDS = ("user", "assistant", "system", "Invalid action")  # in every environment's tokenizer corpus


def build_tokenizer(env_cfg: EnvConfig, vocab_size: int, cache_root: Path, corpus_episodes: int = TOKENIZER_CORPUS_EPISODES,
                    log: Callable[[str], None] | None = None):
    """The shared tokenizer for an environment, trained once on its text and cached; ``log``
    (if given) hears how far the corpus's episodes are."""
    return load_tokenizer(str(tokenizer_dir(env_cfg, vocab_size, cache_root, corpus_episodes, log)))


def tokenizer_dir(env_cfg: EnvConfig, vocab_size: int, cache_root: Path, corpus_episodes: int = TOKENIZER_CORPUS_EPISODES,
                  log: Callable[[str], None] | None = None) -> Path:
    """The directory of :func:`build_tokenizer`'s tokenizer, trained there first if it is not yet.
    For a mixed run's environment (``env.mix``) the corpus's episodes come from every member in
    turn (its task lists interleave them)."""
    factory = EnvFactory.of(env_cfg)
    words = tuple(getattr(factory.env_class(), "tokenizer_words", ()))
    directory = cache_root / f"tokenizer-{tokenizer_key(env_cfg, vocab_size, corpus_episodes, words)}"
    if (directory / "tokenizer.json").is_file():
        return directory
    env = factory()
    tasks = env.unwrapped.task_ids(env_cfg.train_split)
    rng = random.Random(0)
    corpus = [*words, *CHAT_WORDS]
    n_episodes = min(corpus_episodes, len(tasks))
    with Progress(log or (lambda _: None), "tokenizer corpus episode", n_episodes, prefix="bootstrap") as progress:
        for i in range(n_episodes):
            for obs, action, _ in scripted_episode(env, tasks[i], scripted_policy("random_valid", rng), seed=i):
                corpus += [obs, action]
            progress.advance(i + 1)
        env.close()
        tokenizer = train_chat_tokenizer(corpus, vocab_size=vocab_size)
        save_directory_atomically(directory, tokenizer.save_pretrained)
        progress.finish(f"BPE of {vocab_size} tokens trained (cached in {directory})")
    return directory


def resolve_tokenizer(boot: BootstrapConfig, env_cfg: EnvConfig, cache_root: Path,
                      log: Callable[[str], None] | None = None):
    """The tokenizer ``boot.tokenizer`` names: trained on the env's text (``""``), SmolLM2's
    (``"smollm2"``), or the one saved in a directory."""
    if not boot.tokenizer:
        return build_tokenizer(env_cfg, boot.tokenizer_vocab_size, cache_root, boot.corpus_episodes, log)
    if boot.tokenizer == "smollm2":
        return load_tokenizer(smollm2_tokenizer_dir(cache_root))
    return load_tokenizer(boot.tokenizer)
