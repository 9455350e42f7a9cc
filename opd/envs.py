"""The environment contract: text-in, text-out Gymnasium environments.

Every opd environment is a ``gymnasium.Env`` registered under a versioned id such
as ``opd/FrozenLakeText-v0`` and built with ``gymnasium.make`` (here: :func:`make_env`).

Contract:
    * ``reset(seed=None, options={"task": task_id}) -> (obs: str, info: dict)``.
      Without a task, the env picks one from the train split using the seed.
    * ``step(action: str) -> (obs: str, reward: float, terminated: bool, truncated: bool, info: dict)``.
    * ``info`` always has ``success: bool`` and ``valid_action: bool`` (after reset:
      False and True). Where available also ``admissible_actions: list[str]``,
      ``expert_action: str | None`` and ``task: str``.
    * ``env.unwrapped.task_ids(split)`` for split "train"/"eval" gives deterministic,
      disjoint (by content, not only by id) task lists; an unknown split raises ValueError.
    * A bad action is an observation saying so (plus a format penalty), never an exception.
    * Optional class attributes: ``tokenizer_words`` (the words actions are made of, seeded into
      a tokenizer trained on the env's text by :mod:`opd.bootstrap`), ``report_keys`` (the info
      keys of an episode's last step that the env reports as figures: a score, a value; kept in
      the trajectories and averaged by the held-out evaluation, :func:`report_keys`),
      ``reward_kwargs``, ``data_version``, ``max_turns`` (see :class:`environments.base.TextEnv`),
      a static ``state_line(observation)`` and a static ``transition_matches(observation,
      reference)`` (ActFirst's ``transition_check: env``).

Environments live in the top-level ``environments`` package, whose import registers
them all; a user's own environment is registered (``gymnasium.register``) by a module of theirs,
named in the recipe's ``env.module`` and imported first (:class:`EnvFactory`). :func:`check_env`
verifies a new one against this contract.

Example:
    >>> env = make_env("opd/FrozenLakeText-v0", max_turns=8)
    >>> obs, info = env.reset(seed=0, options={"task": task_ids(env, "eval")[0]})
    >>> obs, reward, terminated, truncated, info = env.step(expert_action(info) or "down")
    >>> check_env("opd/FrozenLakeText-v0")  # raises AssertionError on a violation
"""

from __future__ import annotations

import difflib

import copy
import importlib
import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np

from opd.schema import EnvConfig

ENVS_PACKAGE = "environments"  # importing it registers every opd environment
ENV_NAMESPACE = "opd/"
SPLITS = ("train", "eval")
_GARBAGE_ACTIONS = ("@@ not an action @@", "")


def ensure_registered() -> None:
    """Imports the environments package once so its ``gymnasium.register`` calls have run.

    Idempotent: Python caches the import in ``sys.modules``, so no flag of our own is kept.
    """
    importlib.import_module(ENVS_PACKAGE)


def registered_ids() -> list[str]:
    """Sorted ids of every registered ``opd/`` environment."""
    ensure_registered()
    return sorted(env_id for env_id in gymnasium.registry if env_id.startswith(ENV_NAMESPACE))


def _user_ids() -> list[str]:
    """Sorted ids registered outside opd and Gymnasium itself (a user's module, already imported)."""
    def from_gymnasium(entry_point: Any) -> bool:
        name = entry_point if isinstance(entry_point, str) else getattr(entry_point, "__module__", "") or ""
        return name.split(".")[0].split(":")[0] == "gymnasium"

    return sorted(env_id for env_id, spec in gymnasium.registry.items()
                  if not env_id.startswith(ENV_NAMESPACE) and not from_gymnasium(spec.entry_point))


class UnknownEnvironmentError(ValueError):
    """An environment id that nothing registered (:func:`unknown_environment` says more)."""


def unknown_environment(env_id: str, module: str = "") -> UnknownEnvironmentError:
    """The error for an unregistered ``env_id``: the registered ids, and how a user's own
    environment gets registered (``gymnasium.register`` in a module named in ``env.module``)."""
    ids = [*registered_ids(), *_user_ids()]
    known = ", ".join(ids)
    lower = {i.lower(): i for i in ids}
    close = difflib.get_close_matches(env_id.lower(), list(lower), n=1, cutoff=0.75)
    guess = f" did you mean {lower[close[0]]!r}?" if close else ""
    if module:
        how = (f"Module {module!r} (env.module) was imported but registered no {env_id!r}; check the id it "
               "passes to gymnasium.register")
    else:
        how = ("For an environment of your own, call gymnasium.register(id=..., entry_point=\"your_pkg.envs:YourEnv\") "
               "in a module of yours and name that module in the recipe's env.module, which is imported first "
               "(docs/environments.md, \"Your own environment\")")
    return UnknownEnvironmentError(f"unknown environment {env_id!r};{guess} registered: {known}. {how}.")


def make_env(env_id: str, **kwargs: Any) -> gymnasium.Env:
    """Makes a registered environment; ``kwargs`` go to its constructor.

    Raises:
        UnknownEnvironmentError: If ``env_id`` is not registered (a ValueError; the message lists the
            registered ids and says how to register one).
    """
    ensure_registered()
    if env_id not in gymnasium.registry:
        raise unknown_environment(env_id)
    # The passive checker would sample Text spaces and warn on free-form text; check_env replaces it.
    return gymnasium.make(env_id, disable_env_checker=True, **kwargs)


def env_class(env_id: str, module: str = "") -> Any:
    """The class (or factory) registered as ``env_id``, its module imported but no environment
    made: what a caller reads class attributes from (``tokenizer_words``, ``transition_matches``).

    Raises:
        UnknownEnvironmentError: If ``env_id`` is not registered, ``module`` imported.
        ImportError: If its engine is not installed.
    """
    if module:
        importlib.import_module(module)
    ensure_registered()
    if env_id not in gymnasium.registry:
        raise unknown_environment(env_id, module)
    entry_point = gymnasium.registry[env_id].entry_point
    if isinstance(entry_point, str):
        module_name, _, attr = entry_point.partition(":")
        entry_point = getattr(importlib.import_module(module_name), attr)
    return entry_point


def list_envs() -> list[tuple[str, str]]:
    """(id, one-line description) for every registered ``opd/`` env, and every env a user's
    module already imported registered (``opd envs --module M``), from its class docstring."""
    result = []
    for env_id in [*registered_ids(), *_user_ids()]:
        try:
            entry_point = env_class(env_id)
        except ImportError as exc:  # its engine is not installed: say so rather than fail the listing
            result.append((env_id, f"(unavailable: {exc}; run scripts/setup.sh)"))
            continue
        doc = inspect.getdoc(entry_point) or ""
        result.append((env_id, doc.strip().splitlines()[0] if doc.strip() else ""))
    return result


def task_ids(env: gymnasium.Env, split: str) -> list[str]:
    """Task ids of ``split`` ("train" or "eval") for a made (possibly wrapped) env."""
    return env.unwrapped.task_ids(split)


def expert_action(info: Mapping[str, Any]) -> str | None:
    """The env's expert action for the current state, or None if it offers none."""
    return info.get("expert_action")


def report_keys(env_factory: Callable[[], gymnasium.Env]) -> tuple[str, ...]:
    """The info keys the environment a factory makes reports as figures at an episode's end (its
    class's ``report_keys``); ``()`` for a factory that cannot name its class (a plain callable)."""
    env_class_of = getattr(env_factory, "env_class", None)
    return tuple(getattr(env_class_of(), "report_keys", ())) if env_class_of is not None else ()


@dataclass(frozen=True)
class EnvFactory:
    """A picklable recipe for an environment, so it can be sent to a Ray actor.

    Attributes:
        env_id: Registered id, e.g. ``"opd/FrozenLakeText-v0"``.
        kwargs: Constructor kwargs; copied so later edits to the caller's dict don't leak in.
        module: Imported before the env is made (an env registered by the user's own package).

    Example:
        >>> factory = EnvFactory("opd/FrozenLakeText-v0", {"max_turns": 8})
        >>> env = factory()
    """

    env_id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    module: str = ""  # imported first: registers an env that lives outside the environments package

    def __post_init__(self) -> None:
        object.__setattr__(self, "kwargs", dict(self.kwargs))

    def __call__(self) -> gymnasium.Env:
        if self.module:
            importlib.import_module(self.module)
        try:
            return make_env(self.env_id, **self.kwargs)
        except UnknownEnvironmentError:
            raise unknown_environment(self.env_id, self.module) from None

    def env_class(self) -> Any:
        """The environment's registered class, without making one (:func:`env_class`); for a
        mixed run's (``env.mix``) one with its members' class attributes together
        (:func:`opd.mixture.mixed_class`)."""
        from opd.mixture import MIX_ID, mixed_class

        if self.env_id == MIX_ID:
            return mixed_class(self.kwargs.get("envs", []))
        return env_class(self.env_id, self.module)

    @classmethod
    def of(cls, env_cfg: EnvConfig, **kwargs: Any) -> "EnvFactory":
        """The factory of a recipe's ``env`` section (:class:`opd.schema.EnvConfig`), its kwargs as
        plain containers; ``kwargs`` override the section's (``max_turns=4``; for a mixed run's,
        ``env.mix``, each member's)."""
        from omegaconf import OmegaConf

        from opd.mixture import MIX_ID, member_specs

        if list(getattr(env_cfg, "mix", None) or []):
            members = [{**m, "kwargs": {**m["kwargs"], **kwargs}} for m in member_specs(env_cfg)]
            return cls(MIX_ID, {"envs": members})

        section = env_cfg.kwargs
        plain = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)
        return cls(env_cfg.id, {**plain, **kwargs}, env_cfg.module)


# ----- contract checker -----
def _require(condition: bool, message: str) -> None:
    # Not `assert`: the checker must still check under `python -O`.
    if not condition:
        raise AssertionError(message)


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _check_info(info: Any, where: str) -> None:
    _require(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
    for key in ("success", "valid_action"):
        _require(key in info, f"{where}: info lacks {key!r} (keys: {sorted(info)}); every info must carry it")
        _require(_is_bool(info[key]), f"{where}: info[{key!r}] must be a bool, got {info[key]!r}")


def _checked_step(env: gymnasium.Env, action: str, where: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    try:
        result = env.step(action)
    except Exception as exc:
        raise AssertionError(
            f"{where}: step({action!r}) raised {exc!r}; a bad action must yield an observation, not an exception"
        ) from exc
    _require(
        isinstance(result, tuple) and len(result) == 5,
        f"{where}: step({action!r}) must return (obs, reward, terminated, truncated, info), got {result!r}",
    )
    obs, reward, terminated, truncated, info = result
    _require(isinstance(obs, str), f"{where}: step obs must be str, got {type(obs).__name__}")
    _require(
        isinstance(reward, numbers.Real) and not _is_bool(reward),
        f"{where}: reward must be a float, got {reward!r}",
    )
    _require(_is_bool(terminated), f"{where}: terminated must be a bool, got {terminated!r}")
    _require(_is_bool(truncated), f"{where}: truncated must be a bool, got {truncated!r}")
    _check_info(info, f"{where} step({action!r})")
    return obs, float(reward), bool(terminated), bool(truncated), info


def _checked_reset(env: gymnasium.Env, where: str, **reset_kwargs: Any) -> tuple[str, dict[str, Any]]:
    result = env.reset(**reset_kwargs)
    _require(
        isinstance(result, tuple) and len(result) == 2,
        f"{where}: reset() must return (obs, info), got {result!r}",
    )
    obs, info = result
    _require(isinstance(obs, str), f"{where}: reset obs must be str, got {type(obs).__name__}")
    _check_info(info, f"{where} reset")
    _require(not info["success"], f"{where}: reset info success must be False")
    _require(bool(info["valid_action"]), f"{where}: reset info valid_action must be True")
    task = reset_kwargs.get("options", {}).get("task")
    if task is not None and "task" in info:
        _require(info["task"] == task, f"{where}: reset to task {task!r} but info['task'] is {info['task']!r}")
    return obs, info


def _fresh_env_maker(env_or_id: gymnasium.Env | str) -> tuple[str, Callable[[], gymnasium.Env]]:
    if isinstance(env_or_id, str):
        return env_or_id, lambda: make_env(env_or_id)
    if not isinstance(env_or_id, gymnasium.Env):
        raise TypeError(f"check_env takes an env id or a gymnasium.Env, got {type(env_or_id).__name__}")
    spec = env_or_id.spec
    if spec is not None:
        return spec.id, lambda: gymnasium.make(spec)
    # Built directly (no spec): copy the given instance; reset(seed=...) clears its episode state.
    template = copy.deepcopy(env_or_id)
    return type(env_or_id.unwrapped).__name__, lambda: copy.deepcopy(template)


def _rollout(env: gymnasium.Env, where: str, seed: int, task: str, n_steps: int) -> list[tuple[Any, ...]]:
    # Alternates the expert action (when offered) with admissible actions in turn, so that
    # both progress towards the goal and odd moves (walls, ...) are exercised.
    options = {"task": task}
    _, info = _checked_reset(env, where, seed=seed, options=options)
    trace: list[tuple[Any, ...]] = []
    for i in range(n_steps):
        admissible = info.get("admissible_actions") or []
        action = expert_action(info)
        if admissible and (i % 2 == 1 or action is None):
            action = admissible[i % len(admissible)]
        offered = action is not None  # the env itself proposed it, so it must count as valid
        action = action if offered else _GARBAGE_ACTIONS[0]
        obs, reward, terminated, truncated, info = _checked_step(env, action, where)
        if offered:
            _require(info["valid_action"], f"{where}: offered action {action!r} was marked invalid")
        trace.append((action, obs, reward, terminated, truncated, bool(info["success"])))
        if terminated or truncated:
            _, info = _checked_reset(env, where, seed=seed, options=options)
    return trace


def check_env(env_or_id: gymnasium.Env | str, n_steps: int = 20, seed: int = 0) -> None:
    """Checks an environment against the opd contract; raises AssertionError on a violation.

    Checks reset/step types and info keys, that garbage actions ("@@ not an action @@",
    "") give an observation with ``valid_action=False`` instead of raising, that the
    "train"/"eval" splits are non-empty, disjoint and deterministic, and that two fresh
    envs with the same seed, task and actions produce identical trajectories.

    Args:
        env_or_id: A registered id, or an env (fresh copies come from ``env.spec``).
        n_steps: Steps in the determinism rollout.
        seed: Seed for every reset.
    """
    name, make_fresh = _fresh_env_maker(env_or_id)
    first, second = make_fresh(), make_fresh()
    try:
        _checked_reset(first, name, seed=seed)

        splits = {}
        for split in SPLITS:
            ids = getattr(first.unwrapped, "task_ids", None)
            _require(callable(ids), f"{name}: env.unwrapped lacks task_ids(split)")
            splits[split] = ids(split)
            _require(
                isinstance(splits[split], list) and splits[split] and all(isinstance(t, str) for t in splits[split]),
                f"{name}: task_ids({split!r}) must be a non-empty list of str, got {splits[split]!r:.200}",
            )
            _require(
                splits[split] == second.unwrapped.task_ids(split),
                f"{name}: task_ids({split!r}) differs between two envs made with the same kwargs",
            )
        overlap = set(splits["train"]) & set(splits["eval"])
        _require(not overlap, f"{name}: train and eval share task ids, e.g. {sorted(overlap)[:3]}")
        try:
            first.unwrapped.task_ids("no-such-split")
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: task_ids('no-such-split') must raise ValueError")

        for action in _GARBAGE_ACTIONS:
            _checked_reset(first, name, seed=seed, options={"task": splits["eval"][0]})
            _, _, _, _, info = _checked_step(first, action, name)
            _require(not info["valid_action"], f"{name}: garbage action {action!r} must set info['valid_action'] False")

        runs = [_rollout(env, name, seed, splits["train"][0], n_steps) for env in (first, second)]
        for step, (a, b) in enumerate(zip(*runs, strict=True)):
            _require(a == b, f"{name}: same seed/task/actions diverged at step {step}: {a!r} != {b!r}")
        obs_a, info_a = _checked_reset(first, name, seed=seed)
        obs_b, info_b = _checked_reset(second, name, seed=seed)
        _require(
            obs_a == obs_b and info_a.get("task") == info_b.get("task"),
            f"{name}: reset(seed={seed}) without a task picked different tasks in two fresh envs",
        )
    finally:
        first.close()
        second.close()
