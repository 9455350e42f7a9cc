"""ALFWorld as an opd text environment, played on the official engine.

The engine is ALFWorld's TextWorld stack: TextWorld's ``PddlEnv`` on the official ``alfred.pddl``
domain and ``alfred.twl2`` grammar, wrapped by ALFWorld's ``AlfredDemangler`` (THOR ids ->
"cabinet 3"). Observations, admissible commands, "Nothing happens." for a command that does not
apply, and the win check are all the engine's; a test checks them, and the expert's actions,
against ALFWorld's own wrapper stack with ``AlfredExpert(PLANNER)``.

Where this departs from ``AlfredTWEnv`` (ALFWorld's own batch env), and why:
    * The expert is the PDDL planner, the same plan ``AlfredExpert(PLANNER)`` exposes (TextWorld's
      ``policy_commands``), but it is recomputed only when the agent leaves the plan: a planner call
      costs about as much as the rest of a step, and a plan's tail stays optimal while the agent
      follows it. Commands that change nothing ("Nothing happens.") keep the plan.
    * Pure, slow steps of the engine are memoised in the process (:func:`_memoize_engine_parsing`):
      Fast Downward's PDDL->SAS translation (run twice on ``load`` and twice again on every
      ``reset``), the parse of the domain and grammar (every ``load``) and of each grammar string
      (every step). A repeat reset of a game then costs about a quarter of the first, and steps
      run about a third faster. What the engine computes is unchanged.
    * A command outside the admissible list is answered "Nothing happens." without a call into the
      engine, which would reply the same and change nothing.
    * The reset observation appends one line saying how to answer; commands are lower-cased and
      whitespace-normalised, and ReAct's "put X in/on Y" is accepted for the grammar's "move X to Y".

Example:
    >>> env = ALFWorldTextEnv(n_train_tasks=12, n_eval_tasks=6)
    >>> obs, info = env.reset(seed=0, options={"task": "alfgen-pick_heat_then_place-eval-00003"})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import sys
from typing import Any

import numpy as np

from environments.alfworld_env.games import GENERATOR_VERSION, GeneratedGames, OfficialGames
from environments.alfworld_env.search import SearchExpert, receptacles_in
from environments.base import TextEnv

ACTION_HELP = (
    "Reply with one command per turn, using the names you see: go to {recep}, open {recep}, close {recep}, "
    "take {obj} from {recep}, move {obj} to {recep}, heat/cool/clean {obj} with {recep}, use {lamp}, "
    "examine {thing}, look, inventory. Example: go to cabinet 1"
)
NOTHING_HAPPENS = "Nothing happens."  # the engine's reply to a command that is not admissible
_PUT_RE = re.compile(r"put (.+?) (?:in/on|in|on|into|onto) (.+)")
EXPERTS = ("planner", "search")  # the ``expert`` kwarg's values besides True (planner) and False (none)


def normalize_command(action: Any) -> str:
    """The command the engine is asked for: lower-case, single spaces, no trailing '.'.

    "put X in/on Y" (ReAct's ALFWorld prompts) becomes the grammar's "move X to Y". A non-string
    becomes "" (which no game admits).

    >>> normalize_command("  Take Apple 1 from  CounterTop 3. ")
    'take apple 1 from countertop 3'
    >>> normalize_command("put apple 1 in/on sinkbasin 1")
    'move apple 1 to sinkbasin 1'
    """
    if not isinstance(action, str):
        return ""
    text = " ".join(action.lower().split()).rstrip(".").strip()
    match = _PUT_RE.fullmatch(text)
    return f"move {match.group(1)} to {match.group(2)}" if match else text


def _memoize_engine_parsing() -> None:
    """Memoises three pure, slow steps of the TextWorld PDDL engine process-wide (idempotent).

    * ``fast_downward.pddl2sas``: PDDL -> SAS translation (it also overwrites ``sys.argv``, which
      the memo restores).
    * ``textworld.envs.pddl.logic.GameLogic``: parsing a game's domain and grammar.
    * ``textworld.envs.pddl.textgen._parse_and_convert``: parsing one grammar string; the engine
      re-parses every command template and rule on every step. Callers mutate the parsed symbols,
      so each call gets a deep copy of the cached parse.

    The engine looks all three up as module attributes at call time, so replacing the attributes
    is the hook; what it computes is unchanged (a test compares a trajectory with the original).
    """
    import fast_downward
    from textworld.envs.pddl import logic, textgen

    if getattr(fast_downward.pddl2sas, "opd_memoized", False):
        return
    translate, parse_logic, parse_symbols = fast_downward.pddl2sas, logic.GameLogic, textgen._parse_and_convert

    @functools.lru_cache(maxsize=16)
    def memoized_translate(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        argv = sys.argv
        try:
            return translate(domain, problem, verbose=verbose, optimize=optimize)
        finally:
            sys.argv = argv

    @functools.lru_cache(maxsize=16)
    def memoized_logic(domain: str, grammar: str):
        # Shared by engines: PddlState only adds the domain's types to it, the same ones every time.
        return parse_logic(domain=domain, grammar=grammar)

    @functools.lru_cache(maxsize=4096)
    def parsed_symbols(text: str, rule_name: str):
        return parse_symbols(text, rule_name=rule_name)

    def memoized_symbols(text: str, rule_name: str, trace: bool = False):
        if trace:  # TW_CSG_TRACE debugging output comes from the parser itself
            return parse_symbols(text, rule_name=rule_name, trace=True)
        return copy.deepcopy(parsed_symbols(text, rule_name))

    memoized_translate.opd_memoized = True
    fast_downward.pddl2sas = memoized_translate
    logic.GameLogic = memoized_logic
    textgen._parse_and_convert = memoized_symbols


class _Engine:
    """ALFWorld's TextWorld engine for one game at a time: PddlEnv + AlfredDemangler."""

    def __init__(self) -> None:
        try:
            import textworld
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
            from textworld.envs import PddlEnv
        except ImportError as exc:
            raise ImportError(
                "ALFWorld needs the 'alfworld' package (with TextWorld's PDDL support): pip install alfworld==0.4.2"
            ) from exc
        _memoize_engine_parsing()
        infos = textworld.EnvInfos(won=True, admissible_commands=True)
        self._env = AlfredDemangler(PddlEnv(infos), shuffle=False)
        self.game_file: str | None = None

    def reset(self, game_file: str, plan: bool) -> tuple[str, list[str], bool, list[str]]:
        """(observation, admissible commands, won, plan or [] unless ``plan``) at the start of ``game_file``."""
        if game_file != self.game_file:
            self.game_file = None  # stays None if load fails half-way
            self._env.load(game_file)
            self.game_file = game_file
        self._env.request_infos.policy_commands = plan
        return self._unpack(self._env.reset())

    def step(self, command: str, replan: bool) -> tuple[str, list[str], bool, list[str]]:
        """(observation, admissible commands, won, plan or [] unless ``replan``) after ``command``."""
        self._env.request_infos.policy_commands = replan
        state, _, _ = self._env.step(command)
        return self._unpack(state)

    def _unpack(self, state) -> tuple[str, list[str], bool, list[str]]:
        plan = state.get("policy_commands") if self._env.request_infos.policy_commands else None
        return state.feedback, list(state.admissible_commands), bool(state.won), list(plan or [])


class ALFWorldTextEnv(TextEnv):
    """ALFWorld household tasks as text: find, clean, heat, cool and place objects (official ALFWorld engine).

    Tasks are procedurally generated games for the six ALFWorld task types (ids like
    ``"alfgen-pick_heat_then_place-train-00017"``; see ``generator``), or, with ``game_files_dir``,
    the official ALFWorld games (ids are trial paths such as
    ``"valid_unseen/pick_and_place_simple-Pencil-None-Dresser-330/trial_T20190909_071128_012892"``).
    Splits: "train", "eval" (rooms never seen in train; official: valid_unseen) and "eval_seen"
    (new tasks in train rooms; official: valid_seen).

    Reward is 1.0 on the step that satisfies the goal (which terminates the episode), else 0.0,
    minus ``invalid_action_penalty`` for a command the game does not admit.

    Args:
        max_turns: Turn budget (ALFWorld's usual 50); reaching it without success truncates.
        n_train_tasks: Generated train tasks (default 3600, like ALFWorld's 3553 train games).
        n_eval_tasks: Generated tasks in each of "eval" and "eval_seen" (default 120: 20 per type).
        split_seed: Seed of the task generator (not of episodes).
        cache_dir: Where generated games are written; default ``$OPD_ALFWORLD_CACHE`` or
            ``~/.cache/opd/envs/alfworld``.
        game_files_dir: ALFWorld's downloaded ``json_2.1.1`` directory (or one containing it); when
            given, its games replace the generated ones and the ``n_*``/``split_seed`` args must be unset.
        expert: Who gives ``info["expert_action"]``: ``"planner"`` (or True), Fast Downward's plan,
            which knows what closed receptacles hold (a planner call on reset and whenever the agent
            leaves the plan); ``"search"``, :class:`~environments.alfworld_env.search.SearchExpert`,
            which knows only what the agent has seen and searches for the object, the expert a
            model can imitate from its context; False gives None.
        show_admissible: Append "Admissible commands: ..." to every observation.
        vary_train_rooms: Furnish each generated train room anew: receptacle types leave or join it
            at random (eval rooms keep their floor plans' furniture), so that a model trained on the
            train games must read which receptacles a room has rather than remember its floor plan.
        invalid_action_penalty: Subtracted from the reward of a command the game does not admit.
        render_mode: None or "ansi"; ``render()`` returns the last observation either way.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    data_version = f"generator-v{GENERATOR_VERSION}"  # the generated games' version (see games.py)

    def __init__(
        self,
        *,
        max_turns: int = 50,
        n_train_tasks: int | None = None,
        n_eval_tasks: int | None = None,
        split_seed: int | None = None,
        cache_dir: str | None = None,
        game_files_dir: str | None = None,
        expert: bool | str = True,
        show_admissible: bool = False,
        vary_train_rooms: bool = False,
        invalid_action_penalty: float = 0.0,
        render_mode: str | None = None,
    ) -> None:
        _check_int("max_turns", max_turns, minimum=1)
        if expert not in (True, False, *EXPERTS):
            raise ValueError(f"expert={expert!r} is not supported; use one of {', '.join(map(repr, EXPERTS))}, "
                             "True (the planner) or False (no expert)")
        if not isinstance(invalid_action_penalty, (int, float)) or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        super().__init__(max_turns=max_turns, render_mode=render_mode, max_observation_chars=16384,
                         max_action_chars=256)
        if game_files_dir is not None:
            given = {k: v for k, v in (("n_train_tasks", n_train_tasks), ("n_eval_tasks", n_eval_tasks),
                                       ("split_seed", split_seed), ("cache_dir", cache_dir),
                                       ("vary_train_rooms", vary_train_rooms or None)) if v is not None}
            if given:
                raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())} only applies to generated "
                                 f"games; with game_files_dir the official games and splits are used as they are")
            self.games: GeneratedGames | OfficialGames = OfficialGames(game_files_dir)
        else:
            n_train = 3600 if n_train_tasks is None else n_train_tasks
            n_eval = 120 if n_eval_tasks is None else n_eval_tasks
            _check_int("n_train_tasks", n_train, minimum=1)
            _check_int("n_eval_tasks", n_eval, minimum=1)
            _check_int("split_seed", 0 if split_seed is None else split_seed, minimum=0)
            self.games = GeneratedGames({"train": n_train, "eval": n_eval, "eval_seen": n_eval},
                                        split_seed=split_seed or 0, cache_dir=cache_dir,
                                        vary_train_rooms=vary_train_rooms)
        self.expert_kind = ("planner" if expert is True else expert) if expert else None
        self.show_admissible = bool(show_admissible)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self._engine: _Engine | None = None  # built on first reset: the engine imports take seconds
        self._admissible: list[str] = []
        self._plan: list[str] = []
        self._search: SearchExpert | None = None
        self._holders: dict[str, set[str]] | None = None  # object type -> receptacle types (common sense)

    @property
    def expert(self) -> bool:
        """Whether ``info`` carries an expert action (the other envs' attribute)."""
        return self.expert_kind is not None

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids of every task in ``split`` ("train", "eval" or "eval_seen"), same for same kwargs."""
        return self.games.task_ids(split)

    # ----- episode -----
    def _start_episode(self, task: str) -> str:
        """Loads ``task``'s game (and, with ``expert``, the planner's plan for it)."""
        game_file = self.games.game_file(task)
        if self._engine is None:
            self._engine = _Engine()
        planner = self.expert_kind == "planner"
        intro, self._admissible, won, self._plan = self._engine.reset(game_file, plan=planner)
        if planner and (won or not self._plan):
            raise RuntimeError(f"the planner finds no plan for task {task!r} ({game_file}); the game is unsolvable")
        self._search = self._search_expert(game_file, intro) if self.expert_kind == "search" else None
        return self._observe(f"{intro.strip()}\n\n{ACTION_HELP}")

    def _search_expert(self, game_file: str, intro: str) -> SearchExpert:
        """The search expert of this game: its goal from ``traj_data.json``, its rooms from the intro."""
        if self._holders is None:
            from environments.alfworld_env.generator import _LAMP, _LAMP_SURFACES, _catalog

            self._holders = {**_catalog()["holders"], _LAMP: set(_LAMP_SURFACES)}
        with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
            traj = json.load(f)
        params = traj["pddl_params"]
        return SearchExpert(traj["task_type"], params["object_target"], params["parent_target"],
                            params.get("toggle_target", ""), receptacles_in(intro), self._holders)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Plays one command; one the game does not admit is "Nothing happens.", never an exception."""
        self._begin_turn()
        command = normalize_command(action)
        valid = command in self._admissible
        if valid:
            on_plan = bool(self._plan) and command == self._plan[0]
            replan = self.expert_kind == "planner" and not on_plan
            feedback, self._admissible, won, plan = self._engine.step(command, replan=replan)
            self._plan = plan if replan else self._plan[1:]
            if self._search is not None:
                self._search.observe(command, feedback.strip(), self._admissible)
            reward = 1.0 if won else 0.0
        else:
            # Not sent to the engine: PddlEnv would answer the same and change nothing.
            feedback, won, reward = NOTHING_HAPPENS, False, 0.0 - self.invalid_action_penalty  # not -0.0
        if won:
            self._plan = []
        obs = self._observe(feedback.strip())
        truncated = self._end_turn(obs, terminated=won)
        return obs, reward, won, truncated, self._info(success=won, valid_action=valid)

    def _observe(self, text: str) -> str:
        if not self.show_admissible:
            return text
        return f"{text}\nAdmissible commands: {', '.join(self._admissible)}"

    def _state_info(self) -> dict[str, Any]:
        return {
            "admissible_actions": list(self._admissible),
            "expert_action": (self._search.action(self._admissible) if self._search is not None and not self._done
                              else self._plan[0] if self._plan else None),
            "game_file": self._engine.game_file if self._engine else None,  # the game.tw-pddl being played
        }


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
