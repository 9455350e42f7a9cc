"""Where ALFWorld game files come from: the procedural generator (cached on disk) or the official data.

Both sources hand the engine the same thing, a directory in ALFWorld's layout holding
``traj_data.json`` and ``game.tw-pddl``, and both answer ``task_ids(split)`` and
``game_file(task_id)``.

* :class:`GeneratedGames` writes each game the first time it is asked for, under
  ``<cache_dir>/<version>/seed<split_seed>/<split>/<task_id>/``, each file written to a temporary
  name and renamed into place (atomic), so concurrent workers never read half a file.
* :class:`OfficialGames` reads a downloaded ``json_2.1.1`` tree (``alfworld-download``):
  ``train/``, ``valid_seen/`` and ``valid_unseen/``, each holding
  ``<task_type>-<Object>-<Mrecep>-<Parent>-<scene>/trial_*/{traj_data.json, game.tw-pddl}``.
  Like ALFWorld's own loader it keeps the six task types, skips movable-receptacle and sliced
  trials, and skips games whose ``game.tw-pddl`` says ``"solvable": false``.

Example:
    >>> games = GeneratedGames(n_tasks={"train": 12, "eval": 6}, split_seed=0, cache_dir="/tmp/alfgen")
    >>> games.task_ids("eval")[:2]
    ['alfgen-pick_and_place-eval-00000', 'alfgen-look_at_obj_in_light-eval-00001']
    >>> path = games.game_file("alfgen-pick_and_place-eval-00000")  # .../game.tw-pddl, written once
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import tempfile

from environments.alfworld_env.generator import TASK_TYPES, game_data, sample_task, traj_data
from environments.base import check_split

GENERATOR_VERSION = 1  # bump when generated content changes, so stale caches (games, and the CPU
# bootstrap's models, through ALFWorldTextEnv.data_version) are not reused
DEFAULT_CACHE_DIR = "~/.cache/opd/envs/alfworld"
CACHE_ENV_VAR = "OPD_ALFWORLD_CACHE"
GENERATED_SPLITS = ("train", "eval", "eval_seen")
# Official split directory of each opd split: "eval" is the unseen-rooms split, as in most papers.
OFFICIAL_SPLITS = {"train": "train", "eval": "valid_unseen", "eval_seen": "valid_seen"}
_TASK_RE = re.compile(r"alfgen-([a-z_]+)-(train|eval_seen|eval)-(\d{5})")


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` via a temporary file in the same directory and a rename."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class GeneratedGames:
    """Procedurally generated games, ``n_tasks[split]`` per split, materialised on first use.

    Args:
        n_tasks: Number of tasks per split, e.g. ``{"train": 3600, "eval": 120, "eval_seen": 120}``.
        split_seed: Seed of the generator (not of episodes).
        cache_dir: Root of the on-disk cache; None uses ``$OPD_ALFWORLD_CACHE`` or
            ``~/.cache/opd/envs/alfworld``.
        vary_train_rooms: Furnish each "train" room anew (``generator.sample_task``'s ``vary_rooms``);
            the eval splits keep their floor plans' furniture.
    """

    def __init__(self, n_tasks: dict[str, int], split_seed: int, cache_dir: str | None,
                 vary_train_rooms: bool = False) -> None:
        self.n_tasks = dict(n_tasks)
        self.split_seed = split_seed
        self.vary_train_rooms = bool(vary_train_rooms)
        root = cache_dir or os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
        # The domain and grammar are copied from the alfworld package into each game, so its version keys the cache.
        try:
            alfworld_version = importlib.metadata.version("alfworld")
        except importlib.metadata.PackageNotFoundError as exc:
            raise ImportError("ALFWorld needs the 'alfworld' package: pip install alfworld==0.4.2") from exc
        version = f"v{GENERATOR_VERSION}-alfworld{alfworld_version}"
        seed_dir = f"seed{split_seed}" + ("-varied" if self.vary_train_rooms else "")
        self.root = os.path.join(os.path.expanduser(root), version, seed_dir)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in GENERATED_SPLITS if s in self.n_tasks)

    def task_ids(self, split: str) -> list[str]:
        check_split(split, self.splits)
        slugs = list(TASK_TYPES)
        return [f"alfgen-{slugs[i % len(slugs)]}-{split}-{i:05d}" for i in range(self.n_tasks[split])]

    def parse_task_id(self, task_id: object) -> tuple[str, int]:
        """(split, index) of a generated task id; ValueError naming the id if it is not one."""
        match = _TASK_RE.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None:
            raise ValueError(f"malformed task id {task_id!r}; expected e.g. 'alfgen-pick_and_place-train-00017'")
        slug, split, index = match.group(1), match.group(2), int(match.group(3))
        if split not in self.splits or index >= self.n_tasks[split]:
            size = self.n_tasks.get(split, 0)
            raise ValueError(f"task id {task_id!r} is out of range; split {split!r} has {size} tasks")
        expected = list(TASK_TYPES)[index % len(TASK_TYPES)]
        if slug != expected:
            raise ValueError(f"task id {task_id!r} names type {slug!r}, but index {index} is a {expected!r} task")
        return split, index

    def game_file(self, task_id: str) -> str:
        """Path of the task's ``game.tw-pddl``, generating and caching it on first use."""
        split, index = self.parse_task_id(task_id)
        directory = os.path.join(self.root, split, task_id)
        path = os.path.join(directory, "game.tw-pddl")
        if not os.path.exists(path):
            task = sample_task(split, index, self.split_seed, vary_rooms=self.vary_train_rooms and split == "train")
            # Solvable by construction; the env still checks that the planner finds a plan at reset.
            game = {**game_data(task), "solvable": True}
            write_atomic(os.path.join(directory, "traj_data.json"), json.dumps(traj_data(task), indent=1))
            write_atomic(path, json.dumps(game))  # written last: its presence marks a complete game
        return path


class OfficialGames:
    """The official ALFWorld games from a downloaded ``json_2.1.1`` directory.

    Task ids are trial paths relative to ``json_2.1.1``, e.g.
    ``"valid_unseen/pick_and_place_simple-Pencil-None-Dresser-330/trial_T20190909_071128_012892"``.

    Args:
        game_files_dir: The ``json_2.1.1`` directory, or a directory containing it (such as
            ``$ALFWORLD_DATA``).
    """

    def __init__(self, game_files_dir: str) -> None:
        root = os.path.abspath(os.path.expanduser(game_files_dir))
        if os.path.isdir(os.path.join(root, "json_2.1.1")):
            root = os.path.join(root, "json_2.1.1")
        present = [s for s, d in OFFICIAL_SPLITS.items() if os.path.isdir(os.path.join(root, d))]
        if "train" not in present or "eval" not in present:
            raise ValueError(
                f"game_files_dir={game_files_dir!r} must be ALFWorld's json_2.1.1 directory (or contain it) with "
                "train/ and valid_unseen/ (valid_seen/ optional) holding trial directories with traj_data.json "
                "and game.tw-pddl; `alfworld-download` fetches it into $ALFWORLD_DATA"
            )
        self.root = root
        self.splits = tuple(present)

    def task_ids(self, split: str) -> list[str]:
        check_split(split, self.splits)
        ids = list(_scan_official_split(os.path.join(self.root, OFFICIAL_SPLITS[split])))
        if not ids:
            raise ValueError(f"no playable game under {os.path.join(self.root, OFFICIAL_SPLITS[split])!r}")
        return [f"{OFFICIAL_SPLITS[split]}/{trial}" for trial in ids]

    def game_file(self, task_id: str) -> str:
        prefix = task_id.split("/", 1)[0] if isinstance(task_id, str) else None
        path = os.path.join(self.root, task_id, "game.tw-pddl") if prefix in OFFICIAL_SPLITS.values() else ""
        if not path or not os.path.exists(path) or ".." in task_id.split("/"):
            raise ValueError(
                f"unknown task id {task_id!r}; official ids are trial paths under {self.root!r}, "
                "e.g. 'valid_unseen/pick_and_place_simple-Pencil-None-Dresser-330/trial_T20190909_071128_012892'"
            )
        return path


@functools.lru_cache(maxsize=8)
def _scan_official_split(split_dir: str) -> tuple[str, ...]:
    # Cached: each env instance asks for the same listing, and reading thousands of game files takes seconds.
    task_types = set(TASK_TYPES.values())
    trials = []
    for root, _, files in os.walk(split_dir):
        if "traj_data.json" not in files or "game.tw-pddl" not in files:
            continue
        rel = os.path.relpath(root, split_dir)
        if "movable" in rel or "Sliced" in rel or rel.split("-", 1)[0] not in task_types:
            continue
        with open(os.path.join(root, "game.tw-pddl")) as f:
            if not json.load(f).get("solvable", False):
                continue
        trials.append(rel.replace(os.sep, "/"))
    return tuple(sorted(trials))
