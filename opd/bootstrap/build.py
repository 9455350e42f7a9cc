"""Building a bootstrapped model: rows from a scripted policy, SFT, and the cached directory.

:func:`build_bootstrap_model` returns the directory of the model a ``bootstrap`` section
describes, building it on first use: the tokenizer (:mod:`opd.bootstrap.tokenizer`), the scripted
episodes and their rows (:mod:`opd.bootstrap.rows`), optionally a round of DAgger
(:func:`dagger_rows`), the SFT (:mod:`opd.bootstrap.sft`), then the model saved whole under its
cache key (:mod:`opd.bootstrap.cache`).
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import Callable, Iterator

from opd.bootstrap.cache import BOOTSTRAP_THREADS, bootstrap_key
from opd.bootstrap.rows import (actfirst_rows, env_state_of, expert_labelled_rows, hint_rows, scripted_episode,
                                scripted_policy, sft_row)
from opd.bootstrap.sft import fixed_threads, initial_model, sft
from opd.bootstrap.shipped import shipped_model
from opd.bootstrap.tokenizer import resolve_tokenizer
from opd.chat import ChatFormat
from opd.envs import EnvFactory
from opd.models import save_directory_atomically, save_model
from opd.progress import Progress
from opd.schema import BootstrapConfig, EnvConfig

DAGGER_CHUNK = 16  # episodes played together (one batched generate a turn, their envs alive at once)


def bootstrap_dir(boot: BootstrapConfig, env_cfg: EnvConfig, seed: int) -> Path:
    """Where the model ``boot`` describes lives in its cache, built or not."""
    return Path(os.path.expanduser(boot.cache_dir)) / f"{boot.policy}-{bootstrap_key(boot, env_cfg, seed)}"


def build_bootstrap_model(boot: BootstrapConfig, env_cfg: EnvConfig, seed: int, log: Callable[[str], None] = print) -> str:
    """Return the directory of the model ``boot`` describes: the copy shipped with opd where
    there is one (:mod:`opd.bootstrap.shipped`, unless ``boot.shipped`` is off), else the one in
    the cache, built on first use."""
    shipped = shipped_model(boot, env_cfg, seed)
    if shipped is not None:
        log(f"bootstrap: the {boot.policy} model of {env_cfg.id} is shipped with opd ({shipped.name}; "
            "bootstrap.shipped: false builds it here instead)")
        return str(shipped)
    directory = bootstrap_dir(boot, env_cfg, seed)
    cache_root = directory.parent
    if (directory / "model.safetensors").is_file():
        return str(directory)
    _build(boot, env_cfg, seed, log, cache_root, directory)
    release_freed_memory()
    return str(directory)


def release_freed_memory() -> None:
    """Give the memory a finished build freed back to the system. The build runs in the driver,
    and glibc keeps freed heap for reuse: after SFT of SmolLM2 (its AdamW moments, gradients and
    activations) the driver went on holding 8.8 GB for the whole run."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _build(boot: BootstrapConfig, env_cfg: EnvConfig, seed: int, log: Callable[[str], None], cache_root: Path,
           directory: Path) -> None:
    """Build the model ``boot`` describes into ``directory`` (see :func:`build_bootstrap_model`)."""
    log(f"bootstrap: building the {boot.policy} model of {env_cfg.id} ({boot.n_episodes} episodes, "
        f"{boot.sft_steps} SFT steps; cached in {directory} for later runs)")
    tokenizer = resolve_tokenizer(boot, env_cfg, cache_root, log)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    rows, tasks = scripted_rows(boot, env_cfg, tokenizer, fmt, seed, log)
    model = initial_model(boot, tokenizer, seed)
    if boot.dagger_episodes:  # the init model plays the next games; the expert labels its turns
        following = [tasks[(boot.n_episodes + i) % len(tasks)] for i in range(boot.dagger_episodes)]
        rows += dagger_rows(model, following, env_cfg, tokenizer, fmt, boot, seed, log)
    model.train()
    dagger = f" and {boot.dagger_episodes} DAgger episodes" if boot.dagger_episodes else ""
    log(f"bootstrap: SFT of a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter model on "
        f"{boot.n_episodes} {boot.policy} episodes{dagger} ({len(rows)} sequences) for {boot.sft_steps} steps")
    with fixed_threads(BOOTSTRAP_THREADS):  # the same weights on any machine (see BOOTSTRAP_THREADS)
        sft(model, rows, fmt.pad_id, boot, seed, log)
    with _no_progress_bars():
        save_directory_atomically(directory, lambda d: save_model(model.eval(), tokenizer, d))


def scripted_rows(boot: BootstrapConfig, env_cfg: EnvConfig, tokenizer, fmt: ChatFormat, seed: int,
                  log: Callable[[str], None]) -> tuple[list[dict[str, list]], list[str]]:
    """The SFT rows of ``boot.n_episodes`` episodes of the scripted policy on the train split (in
    each layout ``boot.history`` names, plus ActFirst's and the hinted turns the options ask for),
    and the train tasks."""
    env = EnvFactory.of(env_cfg)()
    tasks = env.unwrapped.task_ids(env_cfg.train_split)
    rng = random.Random(seed)
    choose = scripted_policy(boot.policy, rng)
    state_of = env_state_of(env_cfg)
    rows = []
    action_only_rng = random.Random(f"{seed}:action_only")  # its own stream: the episodes do not depend on it
    with Progress(log, f"{boot.policy} episode", boot.n_episodes, prefix="bootstrap") as progress:
        for i in range(boot.n_episodes):
            task = tasks[i % len(tasks)]
            steps = scripted_episode(env, task, choose, seed=i, explore_prob=boot.explore_prob, rng=rng)
            for layout in ("full", "state_grounded") if boot.history == "both" else (boot.history,):
                rows.append(sft_row(steps, task, tokenizer, fmt, boot.think, layout, state_of))
            if boot.action_only_prob > 0:
                rows += actfirst_rows(steps, tokenizer, fmt, boot.action_only_prob, boot.think, action_only_rng, state_of)
            if boot.hint_prob > 0:
                rows += hint_rows(steps, tokenizer, fmt, boot.hint_prob, random.Random(f"{seed}:hint:{i}"), boot.think,
                                  state_of)
            progress.advance(i + 1)
        env.close()
        progress.finish(f"{len(rows)} SFT sequences")
    return rows, tasks


def dagger_rows(model, tasks: list[str], env_cfg: EnvConfig, tokenizer, fmt: ChatFormat, boot: BootstrapConfig,
                seed: int, log: Callable[[str], None]) -> list[dict[str, list]]:
    """DAgger's rows: ``model`` plays one episode per task (at ``boot.dagger_temperature``), and
    every turn whose state the env's expert can act in becomes a row: the episode as the model
    played it up to that turn's prompt, and the expert's action as the target.

    Imitating the expert's own episodes teaches the states the expert reaches; a policy that
    errs then stands in states the expert never showed it (a receptacle that is not there, an
    action that did nothing) and repeats itself. Here it learns what to do from its own."""
    from opd.generation.hf import HFEngine
    from opd.rollout.vanilla import EpisodeSettings, run_episodes

    think = boot.think
    settings = EpisodeSettings(max_new_tokens=512 if think else 64, temperature=boot.dagger_temperature,
                               max_context_tokens=int(getattr(model.config, "max_position_embeddings", 4096)),
                               env_isolation="inprocess")
    engine = HFEngine(model, pad_id=fmt.pad_id, device=str(next(model.parameters()).device))  # the SFT's device
    factory = EnvFactory.of(env_cfg)
    state_of = env_state_of(env_cfg)
    rows: list[dict[str, list]] = []
    labelled = solved = 0
    with Progress(log, "DAgger episode", len(tasks), prefix="bootstrap") as progress:
        for first in range(0, len(tasks), DAGGER_CHUNK):
            chunk = tasks[first:first + DAGGER_CHUNK]
            for traj in run_episodes(engine, factory, chunk, tokenizer, fmt, settings, seed, first_index=first):
                solved += traj.success
                new = expert_labelled_rows(traj, tokenizer, fmt, think, state_of)
                labelled += len(new)
                rows += new
            if labelled == 0:  # after the first chunk: no expert here, so no use playing on
                raise ValueError(f"key 'bootstrap.dagger_episodes': env {env_cfg.id!r} named no expert action in any "
                                 "state its init model reached; DAgger needs an env with an expert (info['expert_action']).")
            progress.advance(first + len(chunk), f"{solved} solved")
        progress.finish(f"{solved} of {len(tasks)} solved by the init model, {labelled} turns labelled by the expert")
    return rows


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' own bars ("Writing model shards") off while a built model is saved: the
    build reports its progress itself. Put back as they were afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
