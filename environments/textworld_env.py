"""TextWorld (Côté et al., 2018) as an opd text environment: generated games, played by the official engine.

Each task is a game made by TextWorld's own generator (what ``tw-make custom`` runs) from a seed
fixed by ``(split_seed, split, index)``: a house of ``nb_rooms`` rooms, ``nb_objects`` objects and
one quest of ``quest_length`` steps ("take the keycard from the counter, unlock the gate with it,
...").  The compiled game is played by the Inform 7 / Z-machine engine (Jericho) through
``textworld.start``, so the parser, the feedback text and the score are TextWorld's.

Where this departs from playing with ``textworld.gym``, and why:
    * Games are generated lazily, the first time a task is reset (about 1 s each in-process, 4 s
      for the first, which loads the knowledge base), and cached under ``cache_dir``; a game is
      written to a temp folder and renamed into place, so readers never see a partial game.
    * The feedback is cleaned: the ASCII-art banner, the ``>`` prompt with its status bar and the
      "Would you like to RESTART..." epilogue are removed, and runs of blank lines collapsed.
    * ``valid_action`` is True when the game carried the command out (it was admissible, or the
      engine reported an action for it); "You can't go that way." is an observation with
      ``valid_action=False``.
    * Reward is the change in score divided by the game's maximum score (one quest: 1 on winning).

Example:
    >>> env = TextWorldTextEnv(n_train_games=4, n_eval_games=2, cache_dir="/tmp/tw-cache")
    >>> obs, info = env.reset(options={"task": "tw-r5-o10-q5-eval-00000"})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from environments.base import TextEnv, check_split
from environments.scienceworld_env import default_cache_dir, normalize_command

SPLITS: tuple[str, ...] = ("train", "eval")
_MAX_GENERATION_ATTEMPTS = 20  # a seed whose map admits no quest of the asked length is redrawn


def clean_feedback(text: str) -> str:
    """Drops the game's prompt line with its status bar and the end-of-game menu; tidies blank lines.

    Example:
        >>> clean_feedback("\\nYou open gate.\\n\\n\\n>      -= Attic =-0/3")
        'You open gate.'
    """
    text = re.sub(r"\n>[^\n]*\s*\Z", "", "\n" + text.rstrip())
    text = text.split("Would you like to RESTART")[0]
    text = "\n".join(line.strip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


class TextWorldTextEnv(TextEnv):
    """TextWorld: generated text-adventure games with one quest each (official generator and Z-machine engine, walkthrough expert).

    Args:
        max_turns: Turn budget; reaching it without winning truncates.
        nb_rooms: Rooms per game (``tw-make custom --world-size``).
        nb_objects: Minimum objects per game (``--nb-objects``).
        quest_length: Actions the quest needs (``--quest-length``).
        n_train_games: Number of train games.
        n_eval_games: Number of eval games.
        split_seed: Seed of the game seeds (not of episodes).
        invalid_action_penalty: Subtracted from the reward of a command the game did not carry out.
        cache_dir: Where games are cached; default ``default_cache_dir("textworld")``.
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    report_keys = ("score",)  # the engine's score at the episode's end (eval/<who>_score)

    def __init__(
        self,
        *,
        max_turns: int = 50,
        nb_rooms: int = 5,
        nb_objects: int = 10,
        quest_length: int = 5,
        n_train_games: int = 1000,
        n_eval_games: int = 100,
        split_seed: int = 0,
        invalid_action_penalty: float = 0.0,
        cache_dir: str | os.PathLike | None = None,
        render_mode: str | None = None,
    ) -> None:
        for name, value, minimum in (("max_turns", max_turns, 1), ("nb_rooms", nb_rooms, 1),
                                     ("nb_objects", nb_objects, 1), ("quest_length", quest_length, 1),
                                     ("n_train_games", n_train_games, 1), ("n_eval_games", n_eval_games, 1),
                                     ("split_seed", split_seed, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
        if isinstance(invalid_action_penalty, bool) or not isinstance(invalid_action_penalty, (int, float)) \
                or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        super().__init__(max_turns=int(max_turns), render_mode=render_mode, max_observation_chars=100_000,
                         max_action_chars=1_000)
        self.nb_rooms, self.nb_objects, self.quest_length = int(nb_rooms), int(nb_objects), int(quest_length)
        self.n_games = {"train": int(n_train_games), "eval": int(n_eval_games)}
        self.split_seed = int(split_seed)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir("textworld")
        self._prefix = f"tw-r{self.nb_rooms}-o{self.nb_objects}-q{self.quest_length}"
        self._task_re = re.compile(re.escape(self._prefix) + r"-(train|eval)-(\d{5})")
        self._game: Any = None  # the running textworld environment
        self._state: Any = None  # its last GameState

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids ``tw-r<rooms>-o<objects>-q<length>-<split>-<index>`` of ``split`` ("train" or "eval")."""
        check_split(split, SPLITS)
        return [f"{self._prefix}-{split}-{i:05d}" for i in range(self.n_games[split])]

    def parse_task_id(self, task_id: Any) -> tuple[str, int]:
        """(split, index) of ``task_id``; ValueError if malformed, of other game settings, or out of range."""
        match = self._task_re.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None:
            raise ValueError(f"malformed task id {task_id!r}; expected e.g. '{self._prefix}-train-00017' "
                             f"(nb_rooms={self.nb_rooms}, nb_objects={self.nb_objects}, quest_length={self.quest_length})")
        split, index = match.group(1), int(match.group(2))
        if index >= self.n_games[split]:
            raise ValueError(f"task id {task_id!r} is out of range; split {split!r} has {self.n_games[split]} games")
        return split, index

    def game_seed(self, task_id: str, attempt: int = 0) -> int:
        """The generator seed of ``task_id``: a pure function of split_seed, split, index and attempt.

        Train and eval draw from different ``SeedSequence`` streams, so no game seed is shared.
        """
        split, index = self.parse_task_id(task_id)
        return int(np.random.SeedSequence([self.split_seed, SPLITS.index(split), index, attempt]).generate_state(1)[0])

    def game_file(self, task_id: str) -> Path:
        """Path of the compiled game (``game.z8``, beside ``game.json``), generating it on first use."""
        import textworld

        split, index = self.parse_task_id(task_id)
        directory = (self.cache_dir / f"games-textworld-{textworld.__version__}" /
                     f"{self._prefix}-seed{self.split_seed}" / f"{split}-{index:05d}")
        if not (directory / "game.z8").exists():
            self._generate(task_id, directory)
        return directory / "game.z8"

    def _generate(self, task_id: str, directory: Path) -> None:
        import textworld
        from textworld.generator import QuestGenerationError

        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=directory.name + ".tmp"))
        try:
            for attempt in range(_MAX_GENERATION_ATTEMPTS):
                options = textworld.GameOptions()
                options.seeds = self.game_seed(task_id, attempt)
                options.nb_rooms, options.nb_objects, options.quest_length = \
                    self.nb_rooms, self.nb_objects, self.quest_length
                options.path = str(staging / "game.z8")
                options.file_ext = ".z8"
                try:
                    textworld.make(options)
                    break
                except QuestGenerationError:
                    continue
            else:
                raise ValueError(f"TextWorld could not generate a quest of length {self.quest_length} with "
                                 f"{self.nb_rooms} rooms and {self.nb_objects} objects for {task_id!r} in "
                                 f"{_MAX_GENERATION_ATTEMPTS} seeds; raise nb_rooms/nb_objects or shorten the quest")
            try:
                os.rename(staging, directory)
            except OSError:
                if not (directory / "game.z8").exists():  # not a concurrent writer that finished first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # ----- episode -----
    def _start_episode(self, task: str) -> str:
        """Starts ``task``'s game (generating it on first use) and shows its introduction."""
        import textworld

        path = self.game_file(task)
        self._close_game()
        infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, objective=True,
                                   max_score=True, score=True, won=True, lost=True, moves=True)
        with warnings.catch_warnings():
            # Jericho cannot read a TextWorld game's score itself; TextWorld's own state tracking does.
            warnings.filterwarnings("ignore", message=".*is not fully supported", category=UserWarning)
            self._game = textworld.start(str(path), infos)
            self._state = self._game.reset()
        intro = self._state.feedback
        start = intro.find(self._state["objective"][:60])
        return (
            "You are playing a text adventure game. Answer with one command per turn, e.g. \"go north\", "
            "\"open door\", \"take key from table\", \"unlock chest with key\", \"look\" or \"inventory\".\n\n"
            + clean_feedback(intro[start:] if start >= 0 else intro)
        )

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Sends one command; one the game does not carry out costs a turn and the penalty, never raises."""
        self._begin_turn()
        command = normalize_command(action)
        before = self._state
        if command:
            self._state, _, _ = self._game.step(command)
            feedback = clean_feedback(self._state.feedback)
            valid = self._state["moves"] > before["moves"] or command.lower() in before["admissible_commands"]
        else:
            feedback, valid = "I beg your pardon?", False
        reward = (self._state["score"] - before["score"]) / max(1, self._state["max_score"])
        success, lost = bool(self._state["won"]), bool(self._state["lost"])
        terminated = success or lost
        if valid:
            obs = feedback
        else:
            reward -= self.invalid_action_penalty
            obs = (f"Invalid action {str(action)[:80]!r}: {feedback} "
                   "Answer with one command, e.g. \"look\", \"go east\" or \"take key\".")
        truncated = self._end_turn(obs, terminated=terminated)
        return obs, float(reward), terminated, truncated, self._info(success=success, valid_action=valid)

    def _has_episode(self) -> bool:
        # close() and a copy drop the running game with the episode in it.
        return self._game is not None

    def close(self) -> None:
        """Closes the running game (idempotent)."""
        self._close_game()
        self._done = True

    def _close_game(self) -> None:
        game, self._game = self._game, None
        if game is not None:
            game.close()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) holds no running game; its next reset starts one.
        state = self.__dict__.copy()
        state.update(_game=None, _state=None, _done=True)
        return state

    def _state_info(self) -> dict[str, Any]:
        policy = self._state["policy_commands"]
        return {
            "score": int(self._state["score"]),
            "max_score": int(self._state["max_score"]),
            "admissible_actions": [str(c) for c in self._state["admissible_commands"]],
            # TextWorld re-plans the walkthrough from the current state after every command.
            "expert_action": str(policy[0]) if policy and not self._state["won"] else None,
        }


if "opd/TextWorldText-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/TextWorldText-v0", entry_point="environments.textworld_env:TextWorldTextEnv")
