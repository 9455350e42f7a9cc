"""What names a bootstrapped model in the cache: a content hash of everything that decides its
weights bit for bit.

A built model lives in ``bootstrap.cache_dir/<policy>-<key>/`` and its tokenizer in
``tokenizer-<key>/``; a later run with the same settings finds it there. The key holds every
setting of the ``bootstrap`` section (but where the cache is, and the seed, which is given
apart), the environment's id, the kwargs that change its tasks and text (:func:`data_kwargs`),
its ``data_version``, the train split, the seed, and the build environment (:func:`build_environment`).

Example:
    >>> bootstrap_key(cfg.teacher.bootstrap, cfg.env, seed=0)  # doctest: +SKIP
    'c0ffee1234567890'
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from omegaconf import OmegaConf

from opd.envs import EnvFactory
from opd.schema import BootstrapConfig, EnvConfig

CACHE_VERSION = 3  # bump when the recipe of a bootstrapped model, or its environment's text, changes
# The bootstrap's SFT runs on this many threads whatever the machine: ATen splits a reduction among
# the threads it has, so the same recipe built with 7 threads and with 1 differed (2.6e-7 after 60
# steps, then apart), which is how one recipe's teacher scored 75%, 87% and 92% on three machines.
BOOTSTRAP_THREADS = 2


def build_environment() -> dict[str, str]:
    """What else decides a bootstrapped model's weights bit for bit: the torch release and the CPU
    kernels it picks (``AVX2``, ``AVX512``...; oneDNN and MKL round differently on each). The
    thread count is pinned (:data:`BOOTSTRAP_THREADS`)."""
    return {"torch": torch.__version__.split("+")[0], "cpu": torch.backends.cpu.get_cpu_capability(),
            "threads": str(BOOTSTRAP_THREADS)}


def digest(payload: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``payload`` as sorted JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plain(node: Any) -> Any:
    """An OmegaConf node as plain containers; anything else as it is."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def data_kwargs(env_cfg: EnvConfig) -> dict:
    """The env's kwargs that can change what the bootstrap trains on (its tasks, text and expert):
    all but the env class's ``reward_kwargs``. They, not all kwargs, name the cached models, so
    that runs which differ only in their reward share one teacher and one student.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(id="opd/ClinicalWorkup-v0", module="",
        ...                       kwargs={"setting": "refill", "reward": "outcome_info_gain"})
        >>> data_kwargs(cfg)
        {'setting': 'refill'}
    """
    if list(getattr(env_cfg, "mix", None) or []):  # a mixed run's: each member's, by name
        from opd.envs import env_class
        from opd.mixture import member_specs

        return {"mix": [{**m, "kwargs": {k: v for k, v in m["kwargs"].items()
                                         if k not in getattr(env_class(m["id"], m["module"]), "reward_kwargs", ())}}
                        for m in member_specs(env_cfg)]}
    kwargs = dict(plain(env_cfg.kwargs))
    reward_only = getattr(EnvFactory.of(env_cfg).env_class(), "reward_kwargs", frozenset())
    return {k: v for k, v in kwargs.items() if k not in reward_only}


def tokenizer_key(env_cfg: EnvConfig, vocab_size: int, corpus_episodes: int, words: tuple[str, ...]) -> str:
    """The content hash that names a trained tokenizer's cache directory."""
    return digest({"v": CACHE_VERSION, "env": env_cfg.id, "kwargs": data_kwargs(env_cfg), "vocab": vocab_size,
                   "corpus": corpus_episodes, "words": list(words)})


# Settings that say where a model is kept or found, not what it is.
NOT_KEYED = ("cache_dir", "seed", "shipped")  # the seed is the key's argument


def bootstrap_key(boot: BootstrapConfig, env_cfg: EnvConfig, seed: int, build: bool = True) -> str:
    """The content hash that names a bootstrapped model's cache directory; with ``build=False``
    without the build environment: the recipe's key, which names a shipped model
    (:mod:`opd.bootstrap.shipped`), the same on every machine."""
    settings = {k: v for k, v in plain(boot).items() if k not in NOT_KEYED}
    if isinstance(settings.get("arch"), dict) and not settings["arch"].get("vocab_size"):
        settings["arch"] = {k: v for k, v in settings["arch"].items() if k != "vocab_size"}  # as keyed before it existed
    payload = {"v": CACHE_VERSION, "boot": settings, "env": env_cfg.id, "kwargs": data_kwargs(env_cfg),
               "data": getattr(EnvFactory.of(env_cfg).env_class(), "data_version", ""), "split": env_cfg.train_split,
               "seed": seed}
    return digest({**payload, "build": build_environment()} if build else payload)
