"""Where a run's models come from: a path given in the recipe, or a tiny model built here.

:func:`resolve_model_path` is the one entry: a role's ``path``, or, with a ``bootstrap`` section,
the directory of a tiny model built by SFT on a scripted policy's trajectories and cached by
content hash (:func:`build_bootstrap_model`).

This is how the CPU quickstart gets a teacher and a student with no download: a byte-level BPE
tokenizer is trained on the environment's own text (seeded with the words its actions are made
of, the environment's ``tokenizer_words``), then

- the teacher is a tiny Qwen3 fine-tuned on the environment expert's trajectories, and
- the student is a tiny Qwen3 fine-tuned on uniformly random *valid* actions: it has learnt the
  answer format, not the task (the role a small pretrained instruct model plays in a real run).

Both share the one tokenizer, so the teacher can score the student's tokens. Built models live
under ``bootstrap.cache_dir/<hash>/`` and are reused by every later run with the same settings.

For ActFirst (``docs/actfirst.md``) three options shape the SFT rows:

- ``think: plan`` puts a ``<think> ... </think>`` block before each action: a state summary (the
  environment's ``state_line``, by default the observation's last line) and a plan naming the
  move (:func:`plan_text`), so a full response
  is many times longer than its action, as a reasoning model's is.
- ``action_only_prob: p`` also trains a share ``p`` of the turns in ActFirst's layouts, each as
  its own row whose context holds the executed actions and observations only: the two
  action-only prompts (:func:`opd.chat.action_only_prompt_ids`; with the reference
  next observation, the one the move led to, or without) and, with ``think``, the standard
  prompt answered with the full response (where ActFirst's full requests are made).
- ``history: state_grounded`` trains every response after its state-grounded context (past
  turns show their action only), one packed row per episode with each response a branch: the
  view in which a ``state_grounded`` teacher scores, and ActFirst's student is evaluated;
  ``history: both`` trains each episode in both layouts (two rows), for a teacher that is at
  home in either view (``bench/fidelity.py --study view`` compares the views with one teacher).

Their defaults leave the targets, and the cache keys of models built before them, unchanged.
So does ``init``'s: with ``init: smollm2`` (or a model directory) the SFT starts from a pretrained
model, optionally cut to its first ``init_layers`` blocks (:func:`initial_model`), instead of a
tiny Qwen3 from scratch.

``dagger_episodes: N`` (with ``init``) is a round of DAgger: the init model plays the N train games
after the expert's (at ``dagger_temperature``), and each turn it played becomes a row whose
context is its own episode and whose target is the env's expert action in the state it reached
(:func:`dagger_rows`). Imitating only the expert's episodes, a policy never sees the states its
own mistakes lead to, and loops in them; these rows show it what to do there.

A build reports its stages (the tokenizer's corpus, the scripted episodes, the SFT steps with
their loss) through ``log`` (:class:`StageProgress`): a progress bar when ``log`` is a rich
console's ``log`` on a terminal, otherwise a line at every tenth of a stage (at most one every
:data:`PROGRESS_MIN_INTERVAL_S`), and a closing line per stage either way.

Example:
    >>> path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, log=print)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import OmegaConf

from environments.base import TextEnv
from opd.chat import ChatFormat, action_only_prompt_ids, render_context, standard_prompt_ids, student_sequence
from opd.envs import EnvFactory
from opd.losses import sft as sft_loss
from opd.models import (load_model, load_tokenizer, save_directory_atomically, save_model, smollm2_model_dir,
                        smollm2_tokenizer_dir, tiny_qwen3, train_chat_tokenizer)
from opd.supervision.pivot import hint_text
from opd.supervision.teacher_view import packed_row
from opd.training.trainer import lr_multiplier, student_logprobs_at, token_logprobs
from opd.trajectory import TokenBatch, Trajectory, Turn

StateOf = Callable[[str], str]  # an observation's state line (TextEnv.state_line)

TOKENIZER_CORPUS_EPISODES = 300
CACHE_VERSION = 2  # bump when the recipe of a bootstrapped model, or its environment's text, changes
# The bootstrap's SFT runs on this many threads whatever the machine: ATen splits a reduction among
# the threads it has, so the same recipe built with 7 threads and with 1 differed (2.6e-7 after 60
# steps, then apart), which is how one recipe's teacher scored 75%, 87% and 92% on three machines.
BOOTSTRAP_THREADS = 2


def build_environment() -> dict[str, str]:
    """What else decides a bootstrapped model's weights bit for bit, part of its cache key: the
    torch release and the CPU kernels it picks (``AVX2``, ``AVX512``...; oneDNN and MKL round
    differently on each). The thread count is pinned (:data:`BOOTSTRAP_THREADS`)."""
    return {"torch": torch.__version__.split("+")[0], "cpu": torch.backends.cpu.get_cpu_capability(),
            "threads": str(BOOTSTRAP_THREADS)}


@contextlib.contextmanager
def fixed_threads(n: int):
    """torch's intra-op threads set to ``n`` inside, put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
CHAT_WORDS = ("user", "assistant", "system", "Invalid action")  # in every environment's tokenizer corpus
# Before environments named their own words, every tokenizer's corpus was seeded with these; a
# tokenizer whose environment names them still is the same, and keeps its cache key.
LEGACY_TOKENIZER_WORDS = ("left", "down", "right", "up")
PROGRESS_LINES = 10  # without a terminal, a stage logs a line at every tenth of the way...
PROGRESS_MIN_INTERVAL_S = 5.0  # ...but not sooner than this after its previous line (its last line always)


class StageProgress:
    """How far one stage of a bootstrap build is (``what``: ``"SFT step"``), told through ``log``
    (also ``opd eval``'s and ``opd compare``'s episodes and states, with their own ``prefix``).

    When ``log`` is the ``log`` method of a rich ``Console`` on a terminal (the CLI's), a progress
    bar with the time left, removed when the stage ends; otherwise a line at every tenth of the
    stage (:data:`PROGRESS_LINES`), none sooner than :data:`PROGRESS_MIN_INTERVAL_S` after the
    previous one, so a fast stage stays quiet and a slow one is never silent for long. Either
    way :meth:`finish` logs one closing line.

    Example:
        >>> with StageProgress(print, "SFT step", total=100) as progress:  # doctest: +SKIP
        ...     for k in range(100):
        ...         progress.advance(k + 1, f"loss {loss:.4f}")
        ...     progress.finish(f"loss {loss:.4f}")
        bootstrap: SFT step 10/100, loss 3.1415 (12s, about 1m48s left)
        ...
    """

    def __init__(self, log: Callable[[str], None], what: str, total: int,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "bootstrap") -> None:
        self.log, self.what, self.total, self.clock, self.prefix = log, what, total, clock, prefix
        self.started = self.last_line = clock()
        self.tenths_logged = 0
        self.bar = None
        console = getattr(log, "__self__", None)  # a bound Console.log
        if total > 0 and type(console).__module__.startswith("rich.") and getattr(console, "is_terminal", False):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn(f"{prefix}: {what}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                console=console, transient=True)
            self.task = self.bar.add_task(what, total=total, status="")
            self.bar.start()

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop_bar()

    def _stop_bar(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def advance(self, done: int, status: str = "") -> None:
        """``done`` of ``total`` are done; ``status`` (e.g. ``"loss 2.8465"``) goes after the count."""
        if self.bar is not None:
            self.bar.update(self.task, completed=done, status=status)
            return
        tenths, now = done * PROGRESS_LINES // max(1, self.total), self.clock()
        if done >= self.total or tenths <= self.tenths_logged or now - self.last_line < PROGRESS_MIN_INTERVAL_S:
            return  # the last one is finish()'s
        self.tenths_logged, self.last_line = tenths, now
        elapsed = now - self.started
        left = elapsed / done * (self.total - done)
        self.log(f"{self.prefix}: {self.what} {done}/{self.total}{', ' + status if status else ''} "
                 f"({elapsed:.0f}s, about {left:.0f}s left)")

    def finish(self, status: str = "") -> None:
        """The stage's closing line: the total, ``status`` and the time it took."""
        self._stop_bar()
        self.log(f"{self.prefix}: {self.what} {self.total}/{self.total}{', ' + status if status else ''} "
                 f"in {self.clock() - self.started:.1f}s")


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


def resolve_model_path(model_cfg: Any, env_cfg: Any, seed: int, log: Callable[[str], None]) -> str:
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


def build_tokenizer(env_cfg: Any, vocab_size: int, cache_root: Path, corpus_episodes: int = TOKENIZER_CORPUS_EPISODES,
                    log: Callable[[str], None] | None = None):
    """The shared tokenizer for an environment, trained once on its text and cached; ``log``
    (if given) hears how far the corpus's episodes are."""
    factory = EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module)
    words = tuple(getattr(factory.env_class(), "tokenizer_words", ()))
    payload = {"v": CACHE_VERSION, "env": env_cfg.id, "kwargs": data_kwargs(env_cfg), "vocab": vocab_size}
    if corpus_episodes != TOKENIZER_CORPUS_EPISODES:  # the default stays out: earlier caches keep their key
        payload["corpus"] = corpus_episodes
    if words != LEGACY_TOKENIZER_WORDS:
        payload["words"] = list(words)
    key = _digest(payload)
    directory = cache_root / f"tokenizer-{key}"
    if (directory / "tokenizer.json").is_file():
        return load_tokenizer(str(directory))
    env = factory()
    tasks = env.unwrapped.task_ids(env_cfg.train_split)
    rng = random.Random(0)
    corpus = [*words, *CHAT_WORDS]
    n_episodes = min(corpus_episodes, len(tasks))
    with StageProgress(log or (lambda _: None), "tokenizer corpus episode", n_episodes) as progress:
        for i in range(n_episodes):
            for obs, action, _ in scripted_episode(env, tasks[i], _policy("random_valid", rng), seed=i):
                corpus += [obs, action]
            progress.advance(i + 1)
        env.close()
        tokenizer = train_chat_tokenizer(corpus, vocab_size=vocab_size)
        save_directory_atomically(directory, tokenizer.save_pretrained)
        progress.finish(f"BPE of {vocab_size} tokens trained (cached in {directory})")
    return load_tokenizer(str(directory))


def resolve_tokenizer(boot: Any, env_cfg: Any, cache_root: Path, log: Callable[[str], None] | None = None):
    """The tokenizer ``boot.tokenizer`` names: trained on the env's text (``""``), SmolLM2's
    (``"smollm2"``), or the one saved in a directory."""
    if not boot.tokenizer:
        return build_tokenizer(env_cfg, boot.tokenizer_vocab_size, cache_root, boot.corpus_episodes, log)
    if boot.tokenizer == "smollm2":
        return load_tokenizer(smollm2_tokenizer_dir(cache_root))
    return load_tokenizer(boot.tokenizer)


def plan_text(observation: str, action: str, state_of: StateOf = TextEnv.state_line) -> str:
    """The reasoning of a ``think: plan`` target: the state (``state_of(observation)``, the env's
    :meth:`~environments.base.TextEnv.state_line`; by default the last line, e.g. FrozenLake's
    ``Around you: ...``) and a plan naming the move.

    Example:
        >>> plan_text("A F\\nAround you: left wall, down F.", "down")
        'State: Around you: left wall, down F. Plan: down.'
    """
    return f"State: {state_of(observation)} Plan: {action}."


def env_state_of(env_cfg: Any) -> StateOf:
    """The ``state_line`` of the env ``env_cfg`` names (:meth:`TextEnv.state_line` for a non-TextEnv)."""
    env_class = EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module).env_class()
    return getattr(env_class, "state_line", TextEnv.state_line)


def _response_ids(obs: str, action: str, tokenizer, fmt: ChatFormat, think: str,
                  state_of: StateOf = TextEnv.state_line) -> tuple[list[int], int]:
    """The SFT target of one turn and where its action starts (after ``</think>`` with a plan)."""
    action_ids = tokenizer.encode(action, add_special_tokens=False) + [fmt.im_end_id]
    if not think:
        return action_ids, 0
    think_start = tokenizer.get_vocab().get("<think>")
    if think_start is None or fmt.think_end_id is None:
        raise ValueError("key 'bootstrap.think' is 'plan' but the tokenizer has no <think> / </think> tokens; "
                         "use the trained tokenizer (bootstrap.tokenizer: \"\") or one that has them.")
    block = [think_start, *tokenizer.encode(" " + plan_text(obs, action, state_of) + " ", add_special_tokens=False), fmt.think_end_id]
    return block + action_ids, len(block)


def _sft_row(steps: list[tuple[str, str, bool]], task: str, tokenizer, fmt: ChatFormat, think: str = "",
             history: str = "full", state_of: StateOf = TextEnv.state_line) -> dict[str, list]:
    """One SFT sequence; turns not to be trained on (exploration) get no loss.

    With ``history: state_grounded`` the row is packed as a state-grounded teacher scores an
    episode (:func:`opd.supervision.teacher_view.pack_trajectory`): past turns show their
    action only, and each turn's response is a branch after its own context.
    """
    traj = Trajectory(task=task)
    for k, (obs, action, _) in enumerate(steps[:-1]):
        prompt = standard_prompt_ids(fmt, tokenizer, obs, first=k == 0)
        response, start = _response_ids(obs, action, tokenizer, fmt, think, state_of)
        traj.turns.append(Turn(prompt_ids=prompt, response_ids=response, response_logprobs=[0.0] * len(response),
                               action_start=start, action_end=len(response) - 1, action_text=action))
    if history == "state_grounded":
        row, _ = packed_row(traj, fmt)
        row["loss_mask"] = [m if t < 0 or steps[t][2] else 0.0 for m, t in zip(row["loss_mask"], row["turn_index"])]
        return row
    row = student_sequence(traj, fmt)
    for (start, end), (_, _, train_on) in zip(row["response_positions"], steps):
        if not train_on:
            row["loss_mask"][start:end] = [0.0] * (end - start)
    return row


def _target_row(prompt: list[int], target: list[int], turn: int) -> dict[str, list]:
    """A row of one turn: ``prompt`` as context, the loss on ``target`` (turn ``turn``'s response)."""
    ids = prompt + target
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [0.0] * len(prompt) + [1.0] * len(target),
            "behaviour_logprobs": [0.0] * len(ids), "turn_index": [-1] * len(prompt) + [turn] * len(target)}


def _actfirst_rows(steps: list[tuple[str, str, bool]], tokenizer, fmt: ChatFormat, prob: float, think: str,
                   rng: random.Random, state_of: StateOf = TextEnv.state_line) -> list[dict[str, list]]:
    """Rows in ActFirst's layouts for a share ``prob`` of the turns of one episode.

    The context of turn k is state-grounded (``prompt_0 a_0 close ... ``: executed actions and
    observations only, as in every ActFirst prompt), its last message one of:

    - the action-only prompt with the next observation the move led to (inverse dynamics:
      right for exploratory moves too, since it names the move that explains the transition);
    - the action-only prompt without it (autonomous), for a move the policy chose (``train_on``);
    - with ``think``, the standard prompt, whose target is the full think-then-act response:
      ActFirst's full requests come in this state-grounded context, not after the student's
      own reasoning as in the SFT sequence.

    Action-only targets are the action and the end token.
    """
    formats = ("reference", "autonomous", "standard") if think else ("reference", "autonomous")
    rows = []
    history: list[int] = []
    for k, (obs, action, train_on) in enumerate(steps[:-1]):
        action_ids = tokenizer.encode(action, add_special_tokens=False)
        standard = standard_prompt_ids(fmt, tokenizer, obs, first=k == 0)
        if rng.random() < prob:
            layout = rng.choice(formats) if train_on else "reference"
            if layout == "standard":
                prompt, target = history + standard, _response_ids(obs, action, tokenizer, fmt, think, state_of)[0]
            else:
                reference_next = steps[k + 1][0] if layout == "reference" else None
                prompt = history + action_only_prompt_ids(fmt, tokenizer, obs, reference_next)
                target = action_ids + [fmt.im_end_id]
            rows.append(_target_row(prompt, target, k))
        history = history + standard + action_ids + [fmt.im_end_id, *fmt.newline_ids]
    return rows


def data_kwargs(env_cfg: Any) -> dict:
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
    kwargs = dict(_plain(env_cfg.kwargs))
    reward_only = getattr(EnvFactory(env_cfg.id, kwargs, env_cfg.module).env_class(), "reward_kwargs", frozenset())
    return {k: v for k, v in kwargs.items() if k not in reward_only}


def bootstrap_key(boot: Any, env_cfg: Any, seed: int) -> str:
    """The content hash that names a bootstrapped model's cache directory."""
    # Options at their defaults stay out of the key (an unset tokenizer, the default corpus, no
    # think block, no action-only turns), so models built before those options keep their key.
    settings = {k: v for k, v in _plain(boot).items() if k != "cache_dir" and not (k == "tokenizer" and not v)
                and not (k == "corpus_episodes" and v == TOKENIZER_CORPUS_EPISODES)
                and not (k == "think" and not v) and not (k == "action_only_prob" and not v)
                and not (k == "hint_prob" and not v) and not (k == "history" and v == "full")
                and not (k in ("init", "init_layers") and not v)
                and not (k in ("dagger_episodes", "dagger_temperature") and not boot.dagger_episodes)
                and k != "seed"}  # the seed is the argument
    if boot.action_only_prob:
        settings["actfirst_layouts"] = 2  # the standard prompt joined the layouts: new targets, new key
    if boot.tokenizer:
        settings["sft_head"] = "targets"  # see sft(): the same loss, rounded otherwise
    if boot.think and env_state_of(env_cfg) is not TextEnv.state_line:
        settings["state_line"] = 1  # the env's own state line (not the last one): new targets, new key
    key = {"v": CACHE_VERSION, "boot": settings, "env": env_cfg.id, "kwargs": data_kwargs(env_cfg),
           "split": env_cfg.train_split, "seed": seed, "build": build_environment()}
    data_version = getattr(EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module).env_class(),
                           "data_version", "")
    if data_version:  # unset for most envs, whose keys stay as they were
        key["data"] = data_version
    return _digest(key)


def build_bootstrap_model(boot: Any, env_cfg: Any, seed: int, log: Callable[[str], None] = print) -> str:
    """Return the directory of the model ``boot`` describes, building it on first use."""
    cache_root = Path(os.path.expanduser(boot.cache_dir))
    directory = cache_root / f"{boot.policy}-{bootstrap_key(boot, env_cfg, seed)}"
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


def _build(boot: Any, env_cfg: Any, seed: int, log: Callable[[str], None], cache_root: Path, directory: Path) -> None:
    """Build the model ``boot`` describes into ``directory`` (see :func:`build_bootstrap_model`)."""
    log(f"bootstrap: building the {boot.policy} model of {env_cfg.id} ({boot.n_episodes} episodes, "
        f"{boot.sft_steps} SFT steps; cached in {directory} for later runs)")
    tokenizer = resolve_tokenizer(boot, env_cfg, cache_root, log)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    env = EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module)()
    tasks = env.unwrapped.task_ids(env_cfg.train_split)
    rng = random.Random(seed)
    choose = _policy(boot.policy, rng)
    state_of = env_state_of(env_cfg)
    rows = []
    action_only_rng = random.Random(f"{seed}:action_only")  # its own stream: the episodes stay as before
    with StageProgress(log, f"{boot.policy} episode", boot.n_episodes) as progress:
        for i in range(boot.n_episodes):
            task = tasks[i % len(tasks)]
            steps = scripted_episode(env, task, choose, seed=i, explore_prob=boot.explore_prob, rng=rng)
            for layout in ("full", "state_grounded") if boot.history == "both" else (boot.history,):
                rows.append(_sft_row(steps, task, tokenizer, fmt, boot.think, layout, state_of))
            if boot.action_only_prob > 0:
                rows += _actfirst_rows(steps, tokenizer, fmt, boot.action_only_prob, boot.think, action_only_rng,
                                       state_of)
            if boot.hint_prob > 0:
                rows += hint_rows(steps, tokenizer, fmt, boot.hint_prob, random.Random(f"{seed}:hint:{i}"), boot.think,
                                  state_of)
            progress.advance(i + 1)
        env.close()
        progress.finish(f"{len(rows)} SFT sequences")
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


DAGGER_CHUNK = 16  # episodes played together (one batched generate a turn, their envs alive at once)


def dagger_rows(model, tasks: list[str], env_cfg: Any, tokenizer, fmt: ChatFormat, boot: Any, seed: int,
                log: Callable[[str], None]) -> list[dict[str, list]]:
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
    factory = EnvFactory(env_cfg.id, dict(_plain(env_cfg.kwargs)), env_cfg.module)
    state_of = env_state_of(env_cfg)
    rows: list[dict[str, list]] = []
    labelled = solved = 0
    with StageProgress(log, "DAgger episode", len(tasks)) as progress:
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


def expert_labelled_rows(traj: Trajectory, tokenizer, fmt: ChatFormat, think: str = "",
                         state_of: StateOf = TextEnv.state_line) -> list[dict[str, list]]:
    """One row per turn of ``traj`` whose state has an expert action: the context the policy
    acted in (its own earlier responses shown, as it saw them) and the expert's action as the
    target (with ``think``, after its plan). Turn t's state is the one the reset (t = 0) or
    step t - 1 returned."""
    rows = []
    observations = [traj.initial_observation, *(turn.observation for turn in traj.turns)]
    for t, info in enumerate(traj.state_infos()):
        label = str(info.get("expert_action") or "")
        if not label:
            continue
        context = render_context(traj, t, "full", fmt)
        target, _ = _response_ids(observations[t], label, tokenizer, fmt, think, state_of)
        rows.append(_target_row(context, target, t))
    return rows


def initial_model(boot: Any, tokenizer, seed: int):
    """The model the bootstrap's SFT starts from: a tiny Qwen3 shaped by ``boot.arch`` and seeded by
    ``seed``, or with ``boot.init`` a pretrained one (``"smollm2"``: SmolLM2-135M-Instruct, made
    offline; else a model directory), cut to its first ``boot.init_layers`` transformer blocks when
    that is set (the embeddings, the final norm and the LM head are kept). A pretrained start
    brings what a model trained from scratch here lacks, such as copying a name from the prompt."""
    if not boot.init:
        return tiny_qwen3(tokenizer, boot.arch, seed=seed)
    model = load_model(smollm2_model_dir() if boot.init == "smollm2" else os.path.expanduser(boot.init))
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(f"key 'bootstrap.init' names a model with {model.get_input_embeddings().num_embeddings} "
                         f"embeddings, fewer than the tokenizer's {len(tokenizer)} tokens; set 'bootstrap.tokenizer' "
                         "to that model's own tokenizer.")
    if boot.init_layers:
        blocks = model.model.layers
        if not 0 < boot.init_layers <= len(blocks):
            raise ValueError(f"key 'bootstrap.init_layers' is {boot.init_layers}; {boot.init} has {len(blocks)} "
                             "transformer blocks (0 keeps them all).")
        model.model.layers = blocks[:boot.init_layers]
        model.config.num_hidden_layers = boot.init_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:boot.init_layers]
    return model


SFT_BATCH_TOKENS = 4096  # padded tokens per forward of the bootstrap SFT


def sft(model, rows: list[dict], pad_id: int, boot: Any, seed: int, log: Callable[[str], None]) -> None:
    """Cross-entropy on response tokens, AdamW with linear warm-up (a twentieth of the steps) and
    cosine decay to 0: the trainer's schedule (:func:`opd.training.trainer.lr_multiplier`).

    With a real tokenizer (``boot.tokenizer``: SmolLM2's 49k vocabulary) the LM head runs only on
    the positions that predict a response token, as the trainer's does: a tiny model's head over
    49k ids at every position of a long prompt is most of its step (on SQL's episodes, about
    8 in 9 positions are prompt). A trained BPE's few hundred ids keep the full head, and so
    their models' weights bit for bit."""
    at_targets = bool(boot.tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=boot.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(boot.sft_steps // 20, boot.sft_steps, "cosine", min_lr_ratio=0.0))
    rng = random.Random(seed)
    with StageProgress(log, "SFT step", boot.sft_steps) as progress:
        for step in range(boot.sft_steps):
            # Whole episodes and single turns mix in a batch: forwards of similar lengths (the loss
            # normalised over the whole batch) give its gradient without padding turns to episodes.
            batch = TokenBatch.from_rows(rng.sample(rows, min(boot.batch_size, len(rows))), pad_id).with_totals()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.zeros(())
            for micro in batch.micro_batches(len(batch), SFT_BATCH_TOKENS):
                logprobs_BT = (student_logprobs_at(model, micro, micro.loss_mask_BT > 0)[0] if at_targets
                               else token_logprobs(model, micro))
                part, _ = sft_loss(micro.with_student(logprobs_BT), {})
                part.backward()
                loss += part.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.advance(step + 1, f"loss {loss.item():.4f}")
        progress.finish(f"loss {loss.item():.4f}" if boot.sft_steps else "")


def hint_rows(steps: list[tuple[str, str, bool]], tokenizer, fmt: ChatFormat, prob: float, rng: random.Random,
              think: str = "", state_of: StateOf = TextEnv.state_line) -> list[dict[str, list]]:
    """PivotOPD's hinted turns for a share ``prob`` of one episode's turns (after the first).

    A real instruct model reads a hint; a tiny one learns to here. The row is the episode up to
    turn ``k`` with the hint line (:func:`opd.supervision.pivot.hint_text`, naming an earlier
    turn's action as the gold one and turn ``k``'s as the one to play now) appended to turn
    ``k``'s observation; only turn ``k``'s response is trained on.
    """
    rows = []
    for k in range(1, len(steps) - 1):
        obs, action, train_on = steps[k]
        if not train_on or rng.random() >= prob:
            continue
        pivot = rng.randrange(k)
        hinted = [*steps[:k], (f"{obs}\n{hint_text(pivot, steps[pivot][1], action)}", action, True), ("", "", False)]
        row = _sft_row(hinted, "", tokenizer, fmt, think, state_of=state_of)
        start, end = row["response_positions"][k]
        row["loss_mask"] = [1.0 if start <= p < end else 0.0 for p in range(len(row["loss_mask"]))]
        rows.append(row)
    return rows
