"""Where a run's models come from: a path given in the recipe, or a tiny model built here.

:func:`resolve_model_path` is the one entry: a role's ``path``, or, with a ``bootstrap`` section,
the directory of a tiny model built by SFT on a scripted policy's trajectories and cached by
content hash (:func:`~opd.bootstrap.build.build_bootstrap_model`).

This is how the CPU quickstart gets a teacher and a student with no download: a byte-level BPE
tokenizer is trained on the environment's own text (:mod:`opd.bootstrap.tokenizer`), then

- the teacher is a tiny Qwen3 fine-tuned on the environment expert's trajectories, and
- the student is a tiny Qwen3 fine-tuned on uniformly random *valid* actions: it has learnt the
  answer format, not the task (the role a small pretrained instruct model plays in a real run).

Both share the one tokenizer, so the teacher can score the student's tokens. Built models live
under ``bootstrap.cache_dir/<policy>-<key>/`` (:mod:`opd.bootstrap.cache`) and are reused by
every later run with the same settings.

The package, in the order a build runs:

- :mod:`~opd.bootstrap.tokenizer`: the BPE trained on the environment's text, or an existing one;
- :mod:`~opd.bootstrap.rows`: scripted episodes and the SFT rows made of them;
- :mod:`~opd.bootstrap.sft`: the starting model and the SFT loop;
- :mod:`~opd.bootstrap.build`: the build itself, DAgger's rows, the cached directory;
- :mod:`~opd.bootstrap.cache`: the content hash that names it;
- :mod:`~opd.bootstrap.shipped`: the CPU recipes' models shipped with opd, used instead of a build.

Options that shape the rows (``docs/actfirst.md``, ``docs/pivot.md``):

- ``think: plan`` puts a ``<think> ... </think>`` block before each action: a state summary (the
  environment's ``state_line``, by default the observation's last line) and a plan naming the
  move (:func:`~opd.bootstrap.rows.plan_text`), so a full response is many times longer than its
  action, as a reasoning model's is.
- ``action_only_prob: p`` also trains a share ``p`` of the turns in ActFirst's layouts, each as
  its own row whose context holds the executed actions and observations only: the two
  action-only prompts (:func:`opd.chat.action_only_prompt_ids`; with the reference next
  observation, the one the move led to, or without) and, with ``think``, the standard prompt
  answered with the full response (where ActFirst's full requests are made).
- ``history: state_grounded`` trains every response after its state-grounded context (past turns
  show their action only), one packed row per episode with each response a branch: the view in
  which a ``state_grounded`` teacher scores, and ActFirst's student is evaluated; ``history:
  both`` trains each episode in both layouts (two rows), for a teacher that is at home in either.
- ``hint_prob: p`` trains a share ``p`` of the turns with PivotOPD's hint line.
- ``init: smollm2`` (or a model directory) starts the SFT from a pretrained model, optionally cut
  to its first ``init_layers`` blocks (:func:`~opd.bootstrap.sft.initial_model`), instead of a
  tiny Qwen3 from scratch.
- ``dagger_episodes: N`` (with ``init``) is a round of DAgger: the init model plays the N train
  games after the expert's (at ``dagger_temperature``), and each turn it played becomes a row
  whose context is its own episode and whose target is the env's expert action in the state it
  reached (:func:`~opd.bootstrap.build.dagger_rows`). Imitating only the expert's episodes, a
  policy never sees the states its own mistakes lead to, and loops in them.

A build reports its stages (the tokenizer's corpus, the scripted episodes, the SFT steps with
their loss) through ``log`` with :class:`opd.progress.Progress`: a bar on a terminal, a line at
every tenth of a stage otherwise, and a closing line per stage either way.

Example:
    >>> path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, log=print)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from opd.bootstrap.build import bootstrap_dir, build_bootstrap_model
from opd.bootstrap.shipped import shipped_model
from opd.models import smollm2_dir, smollm2_model_dir
from opd.schema import EnvConfig, ModelConfig

__all__ = ["build_bootstrap_model", "existing_model_path", "resolve_model_path", "resolve_student_path",
           "resolve_teacher_path", "with_mix_tokenizer"]


def resolve_model_path(model_cfg: ModelConfig, env_cfg: EnvConfig, seed: int, log: Callable[[str], None]) -> str:
    """The model directory (or hub id) of a role: ``model_cfg.path``, or the tiny model its
    ``bootstrap`` section describes, built on first use. ``seed`` seeds that build unless
    ``bootstrap.seed`` pins it (so runs with other seeds share the model). ``path: smollm2`` is
    SmolLM2-135M-Instruct, the one pretrained model available offline (made on first use)."""
    if model_cfg.bootstrap is not None:
        if model_cfg.bootstrap.seed is not None:
            seed = model_cfg.bootstrap.seed
        return build_bootstrap_model(model_cfg.bootstrap, env_cfg, seed, log)
    if model_cfg.path == "smollm2":
        return smollm2_model_dir()
    return model_cfg.path


def resolve_teacher_path(cfg, log: Callable[[str], None], name: str = "teacher") -> str:
    """Teacher ``name``'s model directory (:func:`resolve_model_path`): the recipe's ``teacher``
    section, or a key of ``teachers`` (built, for a ``bootstrap`` section, on the environment
    routed to it, :func:`opd.mixture.teacher_env`); for a teacher served over HTTP (``engine:
    server``) the directory of its tokenizer, the student's when its ``path`` is empty (the run's
    start checks that the server's tokenizer is that one)."""
    from opd.mixture import DEFAULT_TEACHER, teacher_env

    section = cfg.teacher if name == DEFAULT_TEACHER else cfg.teachers[name]
    if section.engine == "server" and not section.path:
        return resolve_student_path(cfg, log)
    return resolve_model_path(with_mix_tokenizer(section, cfg.env, log), teacher_env(cfg, name), cfg.run.seed, log)


def resolve_student_path(cfg, log: Callable[[str], None]) -> str:
    """The student's model directory (:func:`resolve_model_path` on the recipe's environment,
    seeded ``run.seed + 1``)."""
    return resolve_model_path(with_mix_tokenizer(cfg.student, cfg.env, log), cfg.env, cfg.run.seed + 1, log)


def with_mix_tokenizer(model_cfg: ModelConfig, env_cfg: EnvConfig, log: Callable[[str], None]) -> ModelConfig:
    """``model_cfg`` with ``bootstrap.tokenizer: mix`` made the directory of the BPE trained on the
    text of the whole ``env_cfg.mix`` (built once and cached, :func:`~opd.bootstrap.tokenizer.build_tokenizer`):
    one tokenizer for the student and every teacher of a mixed run, each teacher built on its own
    environment. Any other model section comes back as it is."""
    boot = model_cfg.bootstrap
    if boot is None or boot.tokenizer != "mix":
        return model_cfg
    from omegaconf import OmegaConf

    from opd.bootstrap.tokenizer import tokenizer_dir

    directory = tokenizer_dir(env_cfg, boot.tokenizer_vocab_size, Path(os.path.expanduser(boot.cache_dir)),
                              boot.corpus_episodes, log)
    return OmegaConf.merge(model_cfg, {"bootstrap": {"tokenizer": str(directory)}})


def existing_model_path(model_cfg: ModelConfig, env_cfg: EnvConfig, seed: int) -> Path | None:
    """The directory :func:`resolve_model_path` would give, where it is on this machine already
    (nothing is built or made); None for a model not built yet or a hub id."""
    if model_cfg.bootstrap is not None:
        boot = model_cfg.bootstrap
        seed = boot.seed if boot.seed is not None else seed
        directory = shipped_model(boot, env_cfg, seed) or bootstrap_dir(boot, env_cfg, seed)
    elif model_cfg.path == "smollm2":
        directory = smollm2_dir()
    else:
        directory = Path(os.path.expanduser(str(model_cfg.path)))
    return directory if (directory / "config.json").is_file() else None
