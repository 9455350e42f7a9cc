"""Several environments in one run, each graded by its own teacher (docs/teachers.md).

A recipe's ``env.mix`` lists environments by name; every task of the run is then named
``NAME::TASK``, so the name travels with each episode through the rollout workers, the teacher,
the trajectories on disk and the reports without any of them knowing about mixes:

- :class:`MixedEnv` is the environment a mixed run makes (registered as ``opd/Mix-v0``, built by
  :meth:`opd.envs.EnvFactory.of` from ``env.mix``): ``reset(options={"task": "lake::t3"})``
  resets its ``lake`` member on ``t3`` and every later ``step`` goes to that member. Its task
  lists interleave the members' (``a0, b0, a1, b1, ...``), so that the first
  ``run.eval_episodes`` held-out tasks hold every environment about equally.
- :func:`sample_mixed_tasks` draws a step's training tasks with each environment's ``share``
  (largest remainders), a pure function of (seed, step) as :func:`opd.algorithms.step.sample_tasks` is.
- :class:`TeacherRoutes` says which teacher grades an episode (its environment's ``teacher``)
  and which actor group holds that teacher (two names of one model share a group), and cuts a
  step's trajectories into runs of one group, in order, which the workers score apart and join.
- :func:`by_environment` groups episodes by their environment, for the step's figures apart
  (:func:`opd.algorithms.step.mix_metrics`: ``success/<env>``, ``kl/<teacher>``) and the
  held-out evaluation's (``eval/<env>/...``).
- :func:`teacher_resources` gives a teacher section's actors and their shares.

Example:
    >>> env_of("lake::t3"), inner_task("lake::t3"), env_of("t3")
    ('lake', 't3', '')
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import gymnasium

MIX_ID = "opd/Mix-v0"  # the registered id of MixedEnv; env.id of a recipe with env.mix
SEP = "::"  # between an environment's name and its own task id
DEFAULT_TEACHER = "teacher"  # the recipe's `teacher` section, as routes name it
NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def env_of(task: str) -> str:
    """The environment name a mixed run's task carries (``""`` for a task of a single environment)."""
    name, sep, _ = task.partition(SEP)
    return name if sep else ""


def inner_task(task: str) -> str:
    """The member environment's own task id of a mixed run's task (the task itself otherwise)."""
    name, sep, rest = task.partition(SEP)
    return rest if sep else task


def interleave(lists: Sequence[Sequence[str]]) -> list[str]:
    """``[[a0, a1, a2], [b0]]`` -> ``[a0, b0, a1, a2]``: round-robin over the lists."""
    out: list[str] = []
    for i in range(max((len(items) for items in lists), default=0)):
        out.extend(items[i] for items in lists if i < len(items))
    return out


def member_specs(env_cfg: Any) -> list[dict[str, Any]]:
    """A recipe's ``env.mix`` as the plain data :class:`MixedEnv` is made from: each entry's
    name, id, kwargs, module and ``splits`` (the recipe's split names mapped to the entry's own,
    where its ``train_split`` / ``eval_split`` name another)."""
    from omegaconf import OmegaConf

    out = []
    for entry in env_cfg.mix:
        kwargs = entry.kwargs
        plain = OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs)
        splits = {str(getattr(env_cfg, key)): str(getattr(entry, key)) for key in ("train_split", "eval_split")
                  if getattr(entry, key, "")}
        out.append({"name": str(entry.name), "id": str(entry.id), "kwargs": plain, "module": str(entry.module or ""),
                    **({"splits": splits} if splits else {})})
    return out


class MixedEnv(gymnasium.Env):
    """Several registered environments behind one: a task ``NAME::TASK`` resets member ``NAME`` on
    its ``TASK`` and the episode's steps go to it. Members are made when their first task comes
    (an environment process of a pool may never play some of them).

    Args:
        envs: ``[{"name", "id", "kwargs", "module", "splits"}]``, one per member (:func:`member_specs`).
    """

    metadata = {"render_modes": []}

    def __init__(self, envs: list[dict[str, Any]], render_mode: str | None = None) -> None:
        if not envs:
            raise ValueError("envs is empty: a mixed environment needs at least one member")
        names = [str(e["name"]) for e in envs]
        if len(set(names)) != len(names):
            raise ValueError(f"member names repeat: {names}")
        self.members = {str(e["name"]): dict(e) for e in envs}
        self._made: dict[str, gymnasium.Env] = {}
        self._current: gymnasium.Env | None = None
        self.observation_space = gymnasium.spaces.Text(max_length=1 << 20)
        self.action_space = gymnasium.spaces.Text(max_length=1 << 20)

    def member(self, name: str) -> gymnasium.Env:
        """Member ``name``, made on first use."""
        if name not in self.members:
            raise ValueError(f"task names environment {name!r}, which is not in the mix ({', '.join(self.members)}); "
                             f"a mixed run's tasks are NAME{SEP}TASK")
        if name not in self._made:
            from opd.envs import EnvFactory

            spec = self.members[name]
            self._made[name] = EnvFactory(spec["id"], spec.get("kwargs") or {}, spec.get("module", ""))()
        return self._made[name]

    def task_ids(self, split: str) -> list[str]:
        """Every member's tasks of ``split`` (each member's own split of that name, its
        ``splits`` say), named ``NAME::TASK``, interleaved."""
        return interleave([self.member_task_ids(name, split) for name in self.members])

    def member_task_ids(self, name: str, split: str) -> list[str]:
        """Member ``name``'s tasks of ``split``, named ``NAME::TASK``."""
        own = self.members[name].get("splits", {}).get(split, split)
        return [f"{name}{SEP}{t}" for t in self.member(name).unwrapped.task_ids(own)]

    @property
    def max_turns(self) -> int | None:
        """The longest member turn budget (each episode keeps its own member's)."""
        turns = [getattr(self.member(n).unwrapped, "max_turns", None) for n in self.members]
        turns = [t for t in turns if isinstance(t, int)]
        return max(turns) if turns else None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        task = (options or {}).get("task")
        if task is None:  # no task: the first member's own choice (the contract's seeded train task)
            name, rest = next(iter(self.members)), None
        else:
            name, rest = env_of(str(task)), inner_task(str(task))
            if not name:
                raise ValueError(f"task {task!r} names no environment of the mix; expected NAME{SEP}TASK with NAME one "
                                 f"of {', '.join(self.members)}")
        self._current = self.member(name)
        obs, info = self._current.reset(seed=seed, options={**(options or {}), "task": rest} if rest is not None
                                        else options)
        if "task" in info:
            info = {**info, "task": f"{name}{SEP}{info['task']}"}
        return obs, info

    def step(self, action: str):
        if self._current is None:
            raise RuntimeError("step() before reset()")
        return self._current.step(action)

    def close(self) -> None:
        for env in self._made.values():
            env.close()
        self._made.clear()
        self._current = None


def mixed_class(members: list[dict[str, Any]]) -> type:
    """A subclass of :class:`MixedEnv` whose class attributes are its members' together (the words
    a tokenizer is seeded with, the figures reported, the data versions), for readers that take
    them from the class (:meth:`opd.envs.EnvFactory.env_class`) without making an environment."""
    from opd.envs import env_class

    classes = [env_class(m["id"], m.get("module", "")) for m in members]
    words: list[str] = []
    report: list[str] = []
    reward: set[str] = set()
    for cls in classes:
        words += [w for w in getattr(cls, "tokenizer_words", ()) if w not in words]
        report += [k for k in getattr(cls, "report_keys", ()) if k not in report]
        reward |= set(getattr(cls, "reward_kwargs", frozenset()))
    versions = "+".join(f"{m['name']}:{getattr(c, 'data_version', '')}" for m, c in zip(members, classes))
    return type("MixedEnv", (MixedEnv,), {"tokenizer_words": tuple(words), "report_keys": tuple(report),
                                          "reward_kwargs": frozenset(reward), "data_version": versions})


# -- a step's tasks ----------------------------------------------------------------------------
def share_counts(shares: Sequence[float], n: int) -> list[int]:
    """``n`` split in proportion to ``shares`` (largest remainders, ties to the earlier).

    Example:
        >>> share_counts([1, 1, 1], 8)
        [3, 3, 2]
    """
    total = float(sum(shares))
    exact = [n * s / total for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def sample_mixed_tasks(tasks_by_env: dict[str, list[str]], shares: dict[str, float], n: int, seed: int, step: int,
                       group_size: int = 1) -> list[str]:
    """Step ``step``'s ``n`` training tasks: each environment's share of the ``n // group_size``
    groups (:func:`share_counts`), drawn from its tasks and kept together in the mix's order (so a
    step's trajectories come in one run per environment), each task ``group_size`` times in a row.
    A pure function of (seed, step)."""
    names = list(tasks_by_env)
    counts = share_counts([shares[name] for name in names], n // group_size)
    rng = random.Random(f"{seed}:{step}")
    out: list[str] = []
    for name, count in zip(names, counts):
        tasks = tasks_by_env[name]
        out += [task for _ in range(count) for task in [tasks[rng.randrange(len(tasks))]] * group_size]
    return out


@dataclass(frozen=True)
class TaskMix:
    """A mixed run's training tasks by environment and each environment's share of a step."""

    tasks: dict[str, list[str]]
    shares: dict[str, float]

    def sample(self, n: int, seed: int, step: int, group_size: int = 1) -> list[str]:
        """:func:`sample_mixed_tasks` of these tasks and shares."""
        return sample_mixed_tasks(self.tasks, self.shares, n, seed, step, group_size)


# -- routes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TeacherRoutes:
    """Who grades what: each environment's teacher (``""``: the one environment of a run without a
    mix) and each teacher's actor group (the first name among teachers of the same model).

    Attributes:
        env_teacher: environment name -> teacher name.
        teacher_group: teacher name -> group name.
    """

    env_teacher: dict[str, str]
    teacher_group: dict[str, str]

    @classmethod
    def single(cls) -> "TeacherRoutes":
        """One teacher for everything."""
        return cls({"": DEFAULT_TEACHER}, {DEFAULT_TEACHER: DEFAULT_TEACHER})

    @property
    def groups(self) -> list[str]:
        """The actor groups, in the order their first teacher is routed to."""
        return list(dict.fromkeys(self.teacher_group[t] for t in self.env_teacher.values()))

    def teacher_of(self, task: str) -> str:
        if list(self.env_teacher) == [""]:  # one environment: whatever its task ids hold
            return self.env_teacher[""]
        env = env_of(task)
        if env not in self.env_teacher:
            raise ValueError(f"task {task!r} belongs to no routed environment ({', '.join(self.env_teacher) or 'none'})")
        return self.env_teacher[env]

    def group_of(self, task: str) -> str:
        return self.teacher_group[self.teacher_of(task)]

    def runs(self, items: Sequence[Any], task: Callable[[Any], str] = lambda item: item.task) -> list[tuple[str, int, list]]:
        """``items`` cut in order into maximal runs of one actor group: ``(group, index of the
        run's first item, the run)``. Joining the runs' answers in order gives the answers in
        ``items``' order."""
        out: list[tuple[str, int, list]] = []
        for i, item in enumerate(items):
            group = self.group_of(task(item))
            if out and out[-1][0] == group:
                out[-1][2].append(item)
            else:
                out.append((group, i, [item]))
        return out or [(self.groups[0], 0, [])]


MODEL_KEYS = ("path", "engine", "dtype", "trust_remote_code", "allow_download", "prefix_cache_mb",
              "tensor_parallel_size", "bootstrap", "server")  # what makes two teacher sections one model


def same_model(cfg: Any, a: str, b: str) -> bool:
    """Whether teachers ``a`` and ``b`` of the recipe load one model: the same model keys and,
    for a model built by its ``bootstrap``, the same environment to build it on."""
    from omegaconf import OmegaConf

    sections = {DEFAULT_TEACHER: cfg.teacher, **dict(cfg.teachers)}

    def key(name: str) -> Any:
        section = OmegaConf.to_container(OmegaConf.structured(sections[name]), resolve=True)
        built_on = OmegaConf.to_container(OmegaConf.structured(teacher_env(cfg, name)), resolve=True) \
            if section.get("bootstrap") else None
        return [section.get(k) for k in MODEL_KEYS], built_on

    return key(a) == key(b)


def teacher_env(cfg: Any, name: str) -> Any:
    """The environment section teacher ``name`` is built on when its ``bootstrap`` builds it: the
    recipe's ``env``, or in a mix the first entry routed to it (its own splits, the limits the
    recipe's ``env`` gives)."""
    from omegaconf import OmegaConf

    from opd.schema import EnvConfig

    entry = next((e for e in cfg.env.mix if str(e.teacher) == name), None)
    if entry is None:
        return cfg.env
    plain = OmegaConf.to_container(OmegaConf.structured(cfg.env), resolve=True)
    plain.update(id=str(entry.id), kwargs=OmegaConf.to_container(entry.kwargs, resolve=True)
                 if OmegaConf.is_config(entry.kwargs) else dict(entry.kwargs), module=str(entry.module or ""), mix=[],
                 train_split=str(entry.train_split or cfg.env.train_split),
                 eval_split=str(entry.eval_split or cfg.env.eval_split))
    return OmegaConf.merge(OmegaConf.structured(EnvConfig), plain)


def teacher_sections(cfg: Any) -> dict[str, Any]:
    """The recipe's teachers by name, those some route uses: ``teacher`` (the recipe's teacher
    section) and the keys of ``teachers``."""
    used = set(routes_of(cfg, share_models=False).env_teacher.values())
    sections = {DEFAULT_TEACHER: cfg.teacher, **dict(cfg.teachers)}
    return {name: section for name, section in sections.items() if name in used}


def routes_of(cfg: Any, share_models: bool = True) -> TeacherRoutes:
    """The recipe's routes: each ``env.mix`` entry's teacher (everything to ``teacher`` without a
    mix). Teachers that load one model (:func:`same_model`) share the group of the first, unless
    ``share_models`` is false."""
    mix = list(cfg.env.mix)
    env_teacher = {str(e.name): str(e.teacher) for e in mix} if mix else {"": DEFAULT_TEACHER}
    group: dict[str, str] = {}
    for name in dict.fromkeys(env_teacher.values()):
        group[name] = next((g for g in dict.fromkeys(group.values()) if share_models and same_model(cfg, g, name)), name)
    return TeacherRoutes(env_teacher, group)


def teacher_resources(name: str, section: Any, resources: Any) -> tuple[int, float, float]:
    """Teacher ``name``'s actor count and each actor's CPU and GPU share: a named teacher's own
    ``replicas`` / ``cpus`` / ``gpus`` where it sets them (0, -1, -1 leave them to
    ``resources.teacher_*``), the recipe's ``teacher`` section's always from ``resources``."""
    if name == DEFAULT_TEACHER:
        return int(resources.teacher_replicas), float(resources.teacher_cpus), float(resources.teacher_gpus)
    return (int(section.replicas or resources.teacher_replicas),
            float(section.cpus if section.cpus >= 0 else resources.teacher_cpus),
            float(section.gpus if section.gpus >= 0 else resources.teacher_gpus))


# -- figures --------------------------------------------------------------------------------------
def by_environment(items: Sequence[Any], task: Callable[[Any], str] = lambda item: item.task) -> dict[str, list]:
    """``items`` grouped by their task's environment name, in first-seen order (one group ``""``
    when the run has no mix)."""
    out: dict[str, list] = {}
    for item in items:
        out.setdefault(env_of(task(item)), []).append(item)
    return out
