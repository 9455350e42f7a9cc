"""Reference trajectories for ActFirst: built once per recipe, stored as a ``datasets`` dataset
(JSON lines where ``datasets`` is not installed).

A reference is one episode on a training task: the actions taken and the observation each one
led to. ActFirst's inverse-dynamics prompt shows the student the reference *next observation*,
and the transition check compares the student's new observation with it.

Sources (``actfirst.reference_source``):

- ``expert``: the environment's expert (``info["expert_action"]``), played in this process.
- ``teacher``: the teacher's own greedy rollouts (think-then-act) on the train split.
- ``dataset``: a user's file (``actfirst.reference_dataset``): JSON lines (``.jsonl``/``.json``),
  Parquet (``.parquet``) or a directory written by ``Dataset.save_to_disk``.

Dataset format (the same for the built ones and a user's): one row per episode,

=================  ===========  ==================================================================
column             type         meaning
=================  ===========  ==================================================================
``task``           string       the task id (from ``env.unwrapped.task_ids(train_split)``)
``actions``        list[str]    the executed actions, in order
``observations``   list[str]    ``observations[k]``: what ``env.step(actions[k])`` returned
``success``        bool         optional (default true): did the episode succeed
=================  ===========  ==================================================================

Only successful references are kept unless ``actfirst.keep_failed_references``; with several
rows per task the first kept one is used. Built references live in ``actfirst.references_dir``
or, if it is empty, in ``<cache root>/references/<content hash>`` where the cache root is the
parent of the teacher's (else the student's) ``bootstrap.cache_dir``, else ``~/.cache/opd``.
The hash covers the environment, its kwargs and split, the source, the seed, the filter and
the teacher (or the user's file and its modification time). A directory appears whole or not
at all (:func:`opd.models.save_directory_atomically`); ``opd_references.json`` beside the
data records what built it.

Example:
    >>> path = build_references(cfg, log=print)  # doctest: +SKIP
    >>> refs = load_references(cfg, log=print)  # doctest: +SKIP
    >>> refs["fl4-train-00001"].observations[0]  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from opd.schema import ConfigError, OPDConfig

REFERENCES_VERSION = 1
COLUMNS = ("task", "actions", "observations", "success")
META_FILE = "opd_references.json"
LINES_FILE = "references.jsonl"  # the stored references where `datasets` is not installed


@dataclass(frozen=True)
class Reference:
    """One reference episode.

    Attributes:
        task: the task id.
        actions: the executed actions, ``actions[k]`` at turn k.
        observations: ``observations[k]`` is what the environment returned for ``actions[k]``
            (o_ref(k+1) in the paper's numbering, the reset observation being o(0)).
        success: whether the episode succeeded.
    """

    task: str
    actions: tuple[str, ...]
    observations: tuple[str, ...]
    success: bool = True

    def __post_init__(self) -> None:
        if len(self.actions) != len(self.observations):
            raise ValueError(f"reference for task {self.task!r}: {len(self.actions)} actions but "
                             f"{len(self.observations)} observations; each action needs the observation it led to")


# ----- sources ------------------------------------------------------------------------------
def expert_reference(env, task: str, seed: int) -> Reference:
    """Play ``task`` with the environment's expert (``info["expert_action"]``) until it ends,
    or until the expert offers no action (a failed reference)."""
    _, info = env.reset(seed=seed, options={"task": task})
    actions, observations = [], []
    while True:
        action = info.get("expert_action")
        if not action:
            return Reference(task, tuple(actions), tuple(observations), False)
        obs, _, terminated, truncated, info = env.step(action)
        actions.append(action)
        observations.append(obs)
        if terminated or truncated:
            return Reference(task, tuple(actions), tuple(observations), bool(info.get("success", False)))


def trajectory_reference(traj) -> Reference:
    """A reference from a played :class:`opd.trajectory.Trajectory` (e.g. the teacher's)."""
    return Reference(traj.task, tuple(t.action_text for t in traj.turns), tuple(t.observation for t in traj.turns),
                     bool(traj.success))


def dataset_references(path: str) -> list[Reference]:
    """A user's references from JSON lines, Parquet or a ``save_to_disk`` directory.

    Raises:
        ConfigError: naming ``actfirst.reference_dataset`` for a missing file, an unknown
            format or a missing column.
    """
    location = Path(os.path.expanduser(path))
    key = "actfirst.reference_dataset"
    if not location.exists():
        raise ConfigError(f"key '{key}': {location} does not exist (see docs/actfirst.md for the format).")
    if location.is_dir():
        import datasets

        records = datasets.load_from_disk(str(location)).to_list()
    elif location.suffix in (".jsonl", ".json"):
        lines = [line for line in location.read_text().splitlines() if line.strip()]
        try:
            records = [json.loads(line) for line in lines]
        except json.JSONDecodeError as exc:
            raise ConfigError(f"key '{key}': {location} is not JSON lines: {exc}") from None
    elif location.suffix == ".parquet":
        import pyarrow.parquet

        records = pyarrow.parquet.read_table(str(location)).to_pylist()
    else:
        raise ConfigError(f"key '{key}': {location} is neither .jsonl/.json, .parquet nor a dataset directory.")
    out = []
    for n, record in enumerate(records):
        missing = [c for c in ("task", "actions", "observations") if c not in record]
        if missing:
            raise ConfigError(f"key '{key}': {location} row {n} lacks the column(s) {missing}; it has {sorted(record)}. "
                              "Expected task (str), actions (list of str), observations (list of str), success (bool, optional).")
        success = record.get("success")
        try:
            out.append(Reference(str(record["task"]), tuple(record["actions"]), tuple(record["observations"]),
                                 True if success is None else bool(success)))
        except ValueError as exc:
            raise ConfigError(f"key '{key}': {location}: {exc}") from None
    return out


# ----- storage ------------------------------------------------------------------------------
def to_dataset(references: list[Reference]):
    """The references as a ``datasets.Dataset`` with :data:`COLUMNS`."""
    import datasets

    features = datasets.Features({
        "task": datasets.Value("string"),
        "actions": datasets.Sequence(datasets.Value("string")),
        "observations": datasets.Sequence(datasets.Value("string")),
        "success": datasets.Value("bool"),
    })
    return datasets.Dataset.from_dict({
        "task": [r.task for r in references],
        "actions": [list(r.actions) for r in references],
        "observations": [list(r.observations) for r in references],
        "success": [r.success for r in references],
    }, features=features)


def save_references(directory: Path, references: list[Reference], meta: dict[str, Any]) -> None:
    """Write ``references`` (and ``meta``) to ``directory`` atomically: a ``datasets`` dataset,
    or, where ``datasets`` is not installed (a bare machine, :mod:`opd.optional`), the same
    columns as JSON lines in ``references.jsonl``."""
    from opd.models import save_directory_atomically
    from opd.optional import optional_module

    datasets = optional_module("datasets", "the references' datasets format (they are stored as JSON lines)")

    def write_lines(tmp: Path) -> None:
        lines = (json.dumps({"task": r.task, "actions": list(r.actions), "observations": list(r.observations),
                             "success": r.success}) for r in references)
        (tmp / LINES_FILE).write_text("".join(line + "\n" for line in lines))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))

    def write(tmp: Path) -> None:
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # build_references logs its own progress lines
        try:
            to_dataset(references).save_to_disk(str(tmp))
        finally:
            if bars:
                datasets.enable_progress_bars()
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))

    directory.parent.mkdir(parents=True, exist_ok=True)
    save_directory_atomically(directory, write if datasets is not None else write_lines)


def read_references(directory: Path, tasks: list[str] | None = None) -> dict[str, Reference]:
    """task -> reference from a stored directory (the first row of each task), optionally only
    for ``tasks`` (the dataset is memory-mapped: picking a few rows is cheap)."""
    if (Path(directory) / LINES_FILE).is_file():  # written without datasets (save_references)
        lines = (Path(directory) / LINES_FILE).read_text().splitlines()
        found: dict[str, Reference] = {}
        for record in (json.loads(line) for line in lines if line.strip()):
            if (tasks is None or record["task"] in tasks) and record["task"] not in found:
                found[record["task"]] = Reference(record["task"], tuple(record["actions"]),
                                                  tuple(record["observations"]), bool(record["success"]))
        return found
    import datasets

    data = datasets.load_from_disk(str(directory))
    wanted = None if tasks is None else set(tasks)
    rows: dict[str, int] = {}
    for index, task in enumerate(data["task"]):
        if (wanted is None or task in wanted) and task not in rows:
            rows[task] = index
    picked = data.select(sorted(rows.values()))
    return {task: Reference(task, tuple(actions), tuple(observations), bool(success))
            for task, actions, observations, success in zip(picked["task"], picked["actions"], picked["observations"],
                                                            picked["success"])}


# ----- where, and building ------------------------------------------------------------------
def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _cache_root(cfg: OPDConfig) -> Path:
    for role in (cfg.teacher, cfg.student):
        if role.bootstrap is not None:
            return Path(os.path.expanduser(role.bootstrap.cache_dir)).parent
    return Path(os.path.expanduser("~/.cache/opd"))


def references_key(cfg: OPDConfig) -> dict[str, Any]:
    """What the stored references depend on (hashed into their directory name)."""
    af = cfg.actfirst
    payload: dict[str, Any] = {"v": REFERENCES_VERSION, "env": cfg.env.id, "kwargs": _plain(cfg.env.kwargs),
                               "module": cfg.env.module, "split": cfg.env.train_split, "source": af.reference_source,
                               "keep_failed": bool(af.keep_failed_references), "seed": int(cfg.run.seed)}
    if af.reference_source == "teacher":
        teacher = _plain(cfg.teacher)
        if teacher.get("bootstrap"):
            teacher["bootstrap"].pop("cache_dir", None)  # where a model is cached is not what it is
        payload["teacher"] = teacher
        payload["max_new_tokens"] = int(cfg.rollout.max_new_tokens)
        payload["system_prompt"] = cfg.rollout.system_prompt
    if af.reference_source == "dataset":
        location = Path(os.path.expanduser(af.reference_dataset)).resolve()
        payload["dataset"] = str(location)
        payload["mtime"] = location.stat().st_mtime if location.exists() else None
    return payload


def references_dir(cfg: OPDConfig) -> Path:
    """The directory that holds (or will hold) the recipe's references."""
    if cfg.actfirst.references_dir:
        return Path(os.path.expanduser(cfg.actfirst.references_dir))
    digest = hashlib.sha256(json.dumps(references_key(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]
    return _cache_root(cfg) / "references" / digest


def build_references(cfg: OPDConfig, log: Callable[[str], None] = print,
                     teacher_play: Callable[[list[str]], list] | None = None, chunk: int = 64) -> Path:
    """Build the recipe's references (if not stored yet) and return their directory.

    Args:
        cfg: the run config (``env``, ``actfirst``, ``teacher``, ``run.seed``).
        log: where progress lines go (the CLI passes ``console.log``).
        teacher_play: ``tasks -> trajectories``, the teacher's greedy episodes: required for
            ``reference_source: teacher`` (a run passes its teacher worker; ``opd references
            build`` one in its own process, :func:`opd.runtime.workers.local_teacher_player`).
        chunk: tasks per progress update (and per teacher call).
    """
    from opd.envs import EnvFactory

    directory = references_dir(cfg)
    if (directory / META_FILE).is_file():
        _check_meta(cfg, directory)
        log(f"references: already stored in {directory}")
        return directory
    af = cfg.actfirst
    if af.reference_source == "dataset":
        built = dataset_references(af.reference_dataset)
    else:
        factory = EnvFactory.of(cfg.env)
        env = factory()
        tasks = env.unwrapped.task_ids(cfg.env.train_split)
        play = None
        if af.reference_source == "teacher":
            if teacher_play is None:
                raise ValueError("reference_source 'teacher' needs a teacher_play: tasks -> trajectories")
            play = teacher_play
        from opd.progress import Progress

        built = []
        progress = Progress(log, "episode", len(tasks), prefix=f"references ({af.reference_source})")
        try:
            for start in range(0, len(tasks), chunk):
                part = tasks[start : start + chunk]
                if play is None:
                    built += [expert_reference(env, task, cfg.run.seed) for task in part]
                else:
                    built += [trajectory_reference(traj) for traj in play(part)]
                progress.advance(len(built), f"{sum(r.success for r in built)} successful")
        finally:
            progress.close()
            env.close()
        progress.finish(f"{sum(r.success for r in built)} successful")
    kept = built if af.keep_failed_references else [r for r in built if r.success]
    if not kept:
        raise ConfigError(f"key 'actfirst.reference_source' ({af.reference_source}): none of {len(built)} reference "
                          "episodes succeeded; set actfirst.keep_failed_references: true to keep them anyway.")
    save_references(directory, kept, {**references_key(cfg), "episodes": len(built), "kept": len(kept)})
    log(f"references: kept {len(kept)} of {len(built)} episodes in {directory}")
    return directory


def _check_meta(cfg: OPDConfig, directory: Path) -> None:
    """A user-chosen ``actfirst.references_dir`` must hold references of this recipe's settings."""
    if not cfg.actfirst.references_dir:
        return  # the hashed directory name is the check
    stored = json.loads((directory / META_FILE).read_text())
    expected = json.loads(json.dumps(references_key(cfg), sort_keys=True, default=str))
    differ = sorted(k for k in expected if stored.get(k) != expected[k])
    if differ:
        raise ConfigError(f"key 'actfirst.references_dir': {directory} holds references built with other settings "
                          f"({', '.join(differ)} differ); point it elsewhere, or leave it empty for a keyed cache.")


def ensure_references(cfg: OPDConfig, log: Callable[[str], None] = print,
                      teacher_play: Callable[[list[str]], list] | None = None) -> Path:
    """The references' directory, built on first use (and logged as such)."""
    directory = references_dir(cfg)
    if (directory / META_FILE).is_file():
        _check_meta(cfg, directory)
        return directory
    log(f"references: none stored for this recipe yet; building them ({cfg.actfirst.reference_source}) "
        f"into {directory} (next time `opd references build` can do this ahead)")
    return build_references(cfg, log, teacher_play)


def load_references(cfg: OPDConfig, log: Callable[[str], None] = print, tasks: list[str] | None = None,
                    teacher_play: Callable[[list[str]], list] | None = None) -> dict[str, Reference]:
    """task -> :class:`Reference` for ``tasks`` (all if ``None``), building them on first use."""
    return read_references(ensure_references(cfg, log, teacher_play), tasks)
