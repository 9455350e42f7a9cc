"""TextWorldExpress (Jansen & Côté, 2022) as an opd text environment, on the official Scala engine.

Eight procedurally generated game families (cooking, TextWorld Commonsense tidying, coin
collecting, map reading, arithmetic, sorting, Simon says, pecking order), each game built from a
seed. The engine's own seed folds are the splits: train seeds 0-999, dev ("eval") 10000-10999 and
test 20000-20999 per game; ``train_seen`` (0-899) and ``eval_seen`` (900-999) cut the train
fold, for held-out games over the objects seen in training. Task ids read ``twx-<game>-<seed>``, e.g. ``"twx-coin-10003"``.
Steps take well under a millisecond.

Where this departs from the package's ``TextWorldExpressEnv`` wrapper, and why:
    * The gold path of the exploring games (twc, coin) is drawn with an unseeded random walk, so
      it differs from one generation to the next. It is generated once per (game, parameters,
      seed) and cached as JSON under ``cache_dir``, which makes the expert reproducible.
    * ``admissible_actions`` are the engine's valid actions, sorted (the engine lists them in
      hash order).
    * Reward is the change in the engine's normalised score (0-1); the task ends on the engine's
      success or failure flag, not on a step limit of its own (``max_turns`` truncates instead).

Example:
    >>> env = TextWorldExpressTextEnv(game_names=["coin"], cache_dir="/tmp/twx-cache")
    >>> obs, info = env.reset(options={"task": "twx-coin-10000"})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import gymnasium

from environments.base import TextEnv, check_split
from environments.scienceworld_env import (
    GoldPathFollower,
    default_cache_dir,
    launch_jvm,
    normalize_command,
    shutdown_jvm,
    write_json_atomic,
)

GAME_NAMES: tuple[str, ...] = ("cookingworld", "twc", "coin", "mapreader", "arithmetic", "sorting", "simonsays",
                               "peckingorder")
SPLITS: tuple[str, ...] = ("train", "eval", "test", "train_seen", "eval_seen")
# The engine's seed folds (identical for every game); tests check them against the engine.
SPLIT_SEEDS: dict[str, range] = {"train": range(0, 1000), "eval": range(10000, 11000), "test": range(20000, 21000),
                                  # The engine's dev and test folds name objects its train fold never
                                  # does (simonsays: other fruit and gestures), which a model trained
                                  # from scratch cannot name. These two cut the train fold instead:
                                  # held-out games over the vocabulary seen in training.
                                  "train_seen": range(0, 900), "eval_seen": range(900, 1000)}
_ENGINE_FOLD = {"train": "train", "eval": "dev", "test": "test"}
FREE_COMMANDS: frozenset[str] = frozenset({"look around", "inventory", "task"})
_INVALID_PREFIX = "Unknown action"
_TASK_RE = re.compile(r"twx-([a-z]+)-(\d+)")


class TextWorldExpressTextEnv(TextEnv):
    """TextWorldExpress: eight fast generated text-game families, cooking to arithmetic (official Scala engine, gold-path expert).

    One JVM per env instance, started at the first ``reset`` and stopped by ``close``.

    Args:
        max_turns: Turn budget; reaching it without the game ending truncates (cookingworld gold
            paths reach about 90 turns).
        game_names: Games to include (default all of ``GAME_NAMES``).
        game_params: Per-game generation parameters in the engine's syntax, e.g.
            ``{"coin": "numLocations=5,includeDoors=1"}``; a game not named uses its defaults.
        expert: Offer ``info["expert_action"]`` (the next gold-path action).
        invalid_action_penalty: Subtracted from the reward of a command the engine does not know.
        cache_dir: Where gold paths are cached; default ``default_cache_dir("textworld_express")``.
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    report_keys = ("score",)  # the engine's score at the episode's end (eval/<who>_score)

    def __init__(
        self,
        *,
        max_turns: int = 100,
        game_names: list[str] | tuple[str, ...] | None = None,
        game_params: dict[str, str] | None = None,
        expert: bool = True,
        invalid_action_penalty: float = 0.0,
        cache_dir: str | os.PathLike | None = None,
        render_mode: str | None = None,
    ) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer >= 1")
        names = list(GAME_NAMES) if game_names is None else list(game_names)
        if not names or any(n not in GAME_NAMES for n in names):
            raise ValueError(f"game_names={game_names!r}: unknown or empty; choose from {', '.join(GAME_NAMES)}")
        params = dict(game_params or {})
        if any(n not in GAME_NAMES or not isinstance(v, str) for n, v in params.items()):
            raise ValueError(f"game_params={game_params!r} must map game names ({', '.join(GAME_NAMES)}) to "
                             "strings such as 'numLocations=5,includeDoors=1'")
        if isinstance(invalid_action_penalty, bool) or not isinstance(invalid_action_penalty, (int, float)) \
                or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        super().__init__(max_turns=max_turns, render_mode=render_mode, max_observation_chars=100_000,
                         max_action_chars=1_000)
        self.game_names = tuple(n for n in GAME_NAMES if n in names)  # canonical order
        self.game_params = params
        self.expert = bool(expert)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.cache_dir = (Path(cache_dir).expanduser() if cache_dir is not None
                          else default_cache_dir("textworld_express"))
        self._gateway: Any = None
        self._server: Any = None  # the engine's PythonInterface
        self._loaded: tuple[str, str] | None = None  # (game, params) the engine has loaded
        self._response: dict[str, Any] = {}
        self._gold = GoldPathFollower([])

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids ``twx-<game>-<seed>`` of ``split`` ("train", "eval" = the engine's dev fold, "test")."""
        check_split(split, SPLITS)
        return [f"twx-{game}-{seed}" for game in self.game_names for seed in SPLIT_SEEDS[split]]

    def parse_task_id(self, task_id: Any) -> tuple[str, int, str]:
        """(game, seed, split) of ``task_id``; ValueError if malformed or not among this env's games."""
        match = _TASK_RE.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None or match.group(1) not in self.game_names:
            raise ValueError(f"malformed task id {task_id!r}; expected 'twx-<game>-<seed>', e.g. 'twx-coin-17', "
                             f"with a game among {', '.join(self.game_names)}")
        game, seed = match.group(1), int(match.group(2))
        split = next((s for s, seeds in SPLIT_SEEDS.items() if seed in seeds), None)
        if split is None:
            raise ValueError(f"task id {task_id!r} has seed {seed} outside every split "
                             f"({', '.join(f'{s}: {r.start}-{r.stop - 1}' for s, r in SPLIT_SEEDS.items())})")
        return game, seed, split

    # ----- episode -----
    def _draw_train_task(self) -> str:
        """A game uniformly, then one of its train seeds."""
        game = self.game_names[int(self.np_random.integers(len(self.game_names)))]
        seeds = SPLIT_SEEDS["train"]
        return f"twx-{game}-{seeds[int(self.np_random.integers(len(seeds)))]}"

    def _start_episode(self, task: str) -> str:
        """Generates ``task``'s game (its gold path from the cache or the engine) and shows its start."""
        game, game_seed, split = self.parse_task_id(task)
        server = self._engine(game)
        gold: list[str] = []
        if self.expert:
            path = self._gold_path_file(game, game_seed)
            if path.exists():
                self._response = self._generate(game_seed, split, gold=False)
                gold = list(json.loads(path.read_text())["gold"])
            else:
                self._response = self._generate(game_seed, split, gold=True)
                gold = [str(a) for a in server.getGoldActionSequence()]
                write_json_atomic(path, {"game": game, "params": self.game_params.get(game, ""), "seed": game_seed,
                                         "gold": gold})
        else:
            self._response = self._generate(game_seed, split, gold=False)
        self._gold = GoldPathFollower(gold)
        return (
            f"{server.getTaskDescription().strip()}\n"
            "Answer with one action per turn, e.g. \"look around\", \"move north\", \"open door to north\", "
            "\"take coin\" or \"inventory\".\n\n"
            f"{self._response['observation'].strip()}"
        )

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Sends one command; an unknown one costs a turn and the penalty, never raises."""
        self._begin_turn()
        command = normalize_command(action)
        before = self._response
        if command:
            self._response = json.loads(self._server.stepJSON(command))
            reply = self._response["observation"].strip()
        else:
            reply = _INVALID_PREFIX + ": I'm not sure what you mean."
        valid = bool(command) and not reply.startswith(_INVALID_PREFIX)
        self._gold.update(command, world_unchanged=not valid or command.lower() in FREE_COMMANDS)
        reward = float(self._response["score"]) - float(before["score"])
        success = bool(self._response["tasksuccess"])
        terminated = success or bool(self._response["taskfailure"])
        if terminated:
            self._gold = GoldPathFollower([])  # the episode is over: nothing left to suggest
        if valid:
            obs = reply
        else:
            reward -= self.invalid_action_penalty
            obs = (f"Invalid action {str(action)[:80]!r}: {reply} "
                   "Answer with one action, e.g. \"look around\" or \"inventory\".")
        truncated = self._end_turn(obs, terminated=terminated)
        return obs, reward, terminated, truncated, self._info(success=success, valid_action=valid)

    def _has_episode(self) -> bool:
        # close() and a copy drop the JVM with the episode in it.
        return self._server is not None and super()._has_episode()

    def close(self) -> None:
        """Stops the JVM (idempotent); the next reset starts a new one."""
        gateway, self._gateway, self._server, self._loaded, self._done = self._gateway, None, None, None, True
        if gateway is not None:
            shutdown_jvm(gateway)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) starts its own JVM on its first reset.
        state = self.__dict__.copy()
        state.update(_gateway=None, _server=None, _loaded=None, _done=True)
        return state

    # ----- engine -----
    def _engine(self, game: str) -> Any:
        if self._server is None:
            from textworld_express.constants import BASEPATH, JAR_PATH

            self._gateway = launch_jvm(JAR_PATH, BASEPATH, [], engine="TextWorldExpress")
            self._server = self._gateway.jvm.textworldexpress.runtime.PythonInterface()
        wanted = (game, self.game_params.get(game, ""))
        if self._loaded != wanted:
            error = self._server.load(*wanted)
            if error:
                raise ValueError(f"TextWorldExpress could not load game {game!r} with params {wanted[1]!r}: {error}")
            self._loaded = wanted
        return self._server

    def _generate(self, game_seed: int, split: str, *, gold: bool) -> dict[str, Any]:
        return json.loads(self._server.generateNewGameJSON(game_seed, _ENGINE_FOLD[split], gold))

    def _gold_path_file(self, game: str, game_seed: int) -> Path:
        import textworld_express

        params = re.sub(r"[^A-Za-z0-9=.-]+", "+", self.game_params.get(game, "")) or "default"
        return (self.cache_dir / f"gold-v{textworld_express.__version__}" / game / params / f"{game_seed}.json")

    def _state_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "score": float(self._response["score"]),
            "admissible_actions": sorted(str(a) for a in self._response["validActions"]),
        }
        if self.expert:
            info["expert_action"] = self._gold.next_action
        return info


if "opd/TextWorldExpressText-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/TextWorldExpressText-v0",
                       entry_point="environments.textworld_express_env:TextWorldExpressTextEnv")
