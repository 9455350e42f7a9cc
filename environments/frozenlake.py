"""FrozenLake as a text environment, stepped by gymnasium's own FrozenLake engine.

The agent reads the lake as a grid of letters and answers with one move word.
Transition dynamics are gymnasium's ``FrozenLakeEnv`` (non-slippery); this
module only adds text rendering, action parsing, deterministic task splits and
a BFS expert (the turn budget is ``environments.base.TextEnv``'s).

Example:
    >>> env = FrozenLakeTextEnv(n_train_tasks=50, n_eval_tasks=10)
    >>> obs, info = env.reset(seed=0, options={"task": "fl4-eval-00003"})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

from environments.base import TextEnv, check_split

# Index in this tuple == gymnasium FrozenLake action id (0 left, 1 down, 2 right, 3 up).
ACTIONS: tuple[str, ...] = ("left", "down", "right", "up")
SPLITS: tuple[str, ...] = ("train", "eval")
INSTRUCTION = "Reach G without stepping on H. Moves: left, down, right, up.\n"
_DELTAS: dict[str, tuple[int, int]] = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
# Tie-break among equally short paths; down/right first reads naturally since G is bottom-right.
_EXPERT_ORDER: tuple[str, ...] = ("down", "right", "left", "up")
_TASK_RE = re.compile(r"fl(\d+)-(train|eval)-(\d+)")


def parse_action(text: Any) -> str | None:
    """Returns the move named by ``text`` or None if it is not exactly one move word.

    Whitespace and case are ignored and one trailing '.' is allowed ("Down." -> "down").
    """
    if not isinstance(text, str):
        return None
    word = text.strip().lower()
    if word.endswith("."):
        word = word[:-1]
    return word if word in _DELTAS else None


def render_grid(desc: Sequence[str], agent: tuple[int, int]) -> str:
    """Renders map rows as space-separated letters with ``A`` on the agent's cell."""
    rows = []
    for r, row in enumerate(desc):
        cells = ["A" if (r, c) == agent else ch for c, ch in enumerate(row)]
        rows.append(" ".join(cells))
    return "\n".join(rows)


def surroundings(desc: Sequence[str], agent: tuple[int, int]) -> str:
    """One line naming what lies one move away, e.g. ``Around you: left wall, down H, right F, up wall.``

    Text agents are usually told what is next to them; it also lets a tiny model learn the
    task from a few thousand episodes, which keeps the CPU quickstart short.
    """
    n = len(desc)
    parts = []
    for move in ACTIONS:
        dr, dc = _DELTAS[move]
        r, c = agent[0] + dr, agent[1] + dc
        parts.append(f"{move} {desc[r][c] if 0 <= r < n and 0 <= c < n else 'wall'}")
    return "Around you: " + ", ".join(parts) + "."


def distances_to_goal(desc: Sequence[str]) -> dict[tuple[int, int], int]:
    """BFS distance (in moves) from every cell that can reach G without entering H.

    Moves are symmetric, so a BFS outward from G gives each cell's shortest path length.
    Cells absent from the result cannot reach G.
    """
    n_rows, n_cols = len(desc), len(desc[0])
    goal = next((r, c) for r in range(n_rows) for c in range(n_cols) if desc[r][c] == "G")
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _DELTAS.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n_rows and 0 <= nc < n_cols and (nr, nc) not in dist and desc[nr][nc] != "H":
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def best_action(desc: Sequence[str], cell: tuple[int, int], dist: dict[tuple[int, int], int]) -> str | None:
    """First move of a shortest H-avoiding path from ``cell`` to G, or None if none/terminal."""
    if desc[cell[0]][cell[1]] in "GH" or cell not in dist:
        return None
    for move in _EXPERT_ORDER:
        dr, dc = _DELTAS[move]
        if dist.get((cell[0] + dr, cell[1] + dc)) == dist[cell] - 1:
            return move
    return None  # unreachable: every non-goal cell in dist has a neighbour one step closer


def expert_policy(obs: str, info: dict[str, Any]) -> str:
    """Scripted expert: the env's BFS action (``"down"`` if it offers none)."""
    del obs  # the BFS answer is already in info; obs is accepted for a policy-shaped signature
    return info.get("expert_action") or "down"


class FrozenLakeTextEnv(TextEnv):
    """FrozenLake as text: reach the goal on a frozen lake without falling into a hole (gymnasium's FrozenLake engine).

    Observations and actions are strings. Tasks are maps produced deterministically
    from ``(split_seed, split, index)`` with ids like ``"fl4-train-00017"``; eval maps
    are drawn first and train excludes any eval map by content.

    Args:
        map_size: Side length of the square lake, >= 2.
        frozen_prob: Probability a generated cell is frozen, in (0, 1].
        max_turns: Turn budget; reaching it without a terminal cell truncates.
        n_train_tasks: Number of distinct train maps.
        n_eval_tasks: Number of distinct eval maps.
        invalid_action_penalty: Reward subtracted for an unparseable action.
        split_seed: Seed of the task generator (not of episodes).
        describe_surroundings: Append a line naming the cell (or wall) one move away in each
            direction.
        hole_restarts: A hole sends the agent back to the start instead of ending the episode
            (as in most text games, a mistake costs turns, not the episode): every episode then
            runs until the goal or ``max_turns``.
        describe_position: Add a line ``Position: row r, column c.`` (from 1, top left) after
            the grid: a move then shows as a change of one number, which a tiny model reads far
            more easily than the ``A`` moving in the grid (ActFirst's inverse dynamics).
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    tokenizer_words = ACTIONS

    def __init__(
        self,
        *,
        map_size: int = 4,
        frozen_prob: float = 0.8,
        max_turns: int = 8,
        n_train_tasks: int = 2000,
        n_eval_tasks: int = 200,
        invalid_action_penalty: float = 0.1,
        split_seed: int = 0,
        describe_surroundings: bool = True,
        hole_restarts: bool = False,
        describe_position: bool = False,
        render_mode: str | None = None,
    ) -> None:
        _check_int("map_size", map_size, minimum=2)
        if isinstance(frozen_prob, bool) or not isinstance(frozen_prob, (int, float)) or not 0.0 < frozen_prob <= 1.0:
            raise ValueError(f"frozen_prob={frozen_prob!r} must be in (0, 1]; 0.8 is FrozenLake's usual value")
        _check_int("max_turns", max_turns, minimum=1)
        _check_int("n_train_tasks", n_train_tasks, minimum=1)
        _check_int("n_eval_tasks", n_eval_tasks, minimum=1)
        _check_int("split_seed", split_seed, minimum=0)
        if not isinstance(invalid_action_penalty, (int, float)) or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        super().__init__(max_turns=max_turns, render_mode=render_mode,
                         max_observation_chars=256 + 2 * map_size * map_size, max_action_chars=256)
        self.map_size = map_size
        self.frozen_prob = float(frozen_prob)
        self.n_tasks = {"train": n_train_tasks, "eval": n_eval_tasks}
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.split_seed = split_seed
        self.describe_surroundings = bool(describe_surroundings)
        self.hole_restarts = bool(hole_restarts)
        self.describe_position = bool(describe_position)
        self._lake: FrozenLakeEnv | None = None
        self._desc: tuple[str, ...] = ()
        self._dist: dict[tuple[int, int], int] = {}

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids of every task in ``split`` ("train" or "eval"), same for same kwargs."""
        return [f"fl{self.map_size}-{split}-{i:05d}" for i in range(len(self._split_maps(split)))]

    def task_map(self, task_id: str) -> tuple[str, ...]:
        """Map rows (letters S/F/H/G) of ``task_id``."""
        split, index = self._parse_task_id(task_id)
        return self._split_maps(split)[index]

    def _parse_task_id(self, task_id: Any) -> tuple[str, int]:
        match = _TASK_RE.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None or int(match.group(1)) != self.map_size:
            raise ValueError(
                f"malformed task id {task_id!r}; expected e.g. 'fl{self.map_size}-train-00017' "
                f"(map_size={self.map_size})"
            )
        split, index = match.group(2), int(match.group(3))
        if index >= self.n_tasks[split]:
            raise ValueError(f"task id {task_id!r} is out of range; split {split!r} has {self.n_tasks[split]} tasks")
        return split, index

    def _split_maps(self, split: str) -> tuple[tuple[str, ...], ...]:
        check_split(split, SPLITS)
        return split_maps(self.map_size, self.frozen_prob, self.split_seed, self.n_tasks["train"], self.n_tasks["eval"], split)

    # ----- episode -----
    @property
    def agent_cell(self) -> tuple[int, int]:
        """(row, col) of the agent in the current episode."""
        if self._lake is None:
            raise RuntimeError("no episode yet; call reset() first")
        return divmod(int(self._lake.s), self.map_size)

    def _start_episode(self, task: str) -> str:
        """Puts the agent on S of ``task``'s map."""
        self._desc = self.task_map(task)
        self._dist = distances_to_goal(self._desc)
        if (0, 0) not in self._dist:
            raise RuntimeError(f"task {task!r} has no path from S to G; the map generator is broken")
        self._lake = FrozenLakeEnv(desc=list(self._desc), is_slippery=False)
        # Non-slippery moves ignore the engine RNG; seeding it anyway keeps every RNG reproducible.
        self._lake.reset(seed=int(self.np_random.integers(2**31)))
        return INSTRUCTION + self._grid()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Applies one text action; a bad action costs a turn and the penalty, never raises."""
        self._begin_turn()
        move = parse_action(action)
        terminated, success = False, False
        if move is None:
            reward = -self.invalid_action_penalty
            obs = f"Invalid action '{str(action)[:40]}'. Answer with one of: left, down, right, up.\n" + self._grid()
        else:
            before = int(self._lake.s)
            state, engine_reward, terminated, _, _ = self._lake.step(ACTIONS.index(move))
            reward = float(engine_reward)
            row, col = divmod(int(state), self.map_size)
            cell = self._desc[row][col]
            success = cell == "G"
            if cell == "G":
                prefix = "You reached the goal!\n"
            elif cell == "H" and self.hole_restarts:
                prefix = "You fell into a hole and went back to the start.\n"
                terminated = False
                self._lake.s = int(np.argmax(self._lake.initial_state_distrib))  # the engine's S
            elif cell == "H":
                prefix = "You fell into a hole.\n"
            elif int(state) == before:
                prefix = "You bumped into the wall.\n"
            else:
                prefix = ""
            obs = prefix + self._grid()
        truncated = self._end_turn(obs, terminated=terminated)
        return obs, reward, bool(terminated), truncated, self._info(success=success, valid_action=move is not None)

    def _grid(self) -> str:
        lines = [render_grid(self._desc, self.agent_cell)]
        if self.describe_position:
            row, col = self.agent_cell
            lines.append(f"Position: row {row + 1}, column {col + 1}.")
        if self.describe_surroundings:
            lines.append(surroundings(self._desc, self.agent_cell))
        return "\n".join(lines)

    def _state_info(self) -> dict[str, Any]:
        return {
            "admissible_actions": list(ACTIONS),
            # Still offered after truncation (useful as a label); None on G/H or if G is unreachable.
            "expert_action": best_action(self._desc, self.agent_cell, self._dist),
        }



@functools.lru_cache(maxsize=16)
def split_maps(map_size: int, frozen_prob: float, split_seed: int, n_train: int, n_eval: int,
               split: str) -> tuple[tuple[str, ...], ...]:
    """The maps of ``split``: a pure function of its arguments, cached because every env
    instance (one per episode in a rollout batch) asks for the same lists."""
    if split == "eval":
        return _sample_maps(map_size, frozen_prob, split_seed, split, n_eval, set())
    # Eval is drawn first so train can exclude eval maps by content, not just by id.
    exclude = {"".join(m) for m in split_maps(map_size, frozen_prob, split_seed, n_train, n_eval, "eval")}
    return _sample_maps(map_size, frozen_prob, split_seed, split, n_train, exclude)


def _sample_maps(n: int, frozen_prob: float, split_seed: int, split: str, count: int,
                 exclude: set[str]) -> tuple[tuple[str, ...], ...]:
    # Same distribution as gymnasium's generate_random_map (each cell frozen with
    # prob p, S/G fixed, resample until solvable), but drawn in numpy batches: at
    # p=0.8 most draws repeat a map already seen, and ~25k per-call draws take seconds.
    n_possible = 1 if frozen_prob == 1.0 else 2 ** (n * n - 2)
    max_draws = 64 * count + 4096
    if count + len(exclude) <= n_possible:
        rng = np.random.default_rng([split_seed, SPLITS.index(split)])
        seen, maps, drawn = set(exclude), [], 0
        while len(maps) < count and drawn < max_draws:
            boards = np.where(rng.random((4096, n, n)) < frozen_prob, ord("F"), ord("H")).astype(np.uint8)
            boards[:, 0, 0], boards[:, -1, -1] = ord("S"), ord("G")
            drawn += len(boards)
            for board in boards:
                key = board.tobytes().decode("ascii")
                if key in seen:
                    continue
                seen.add(key)
                desc = tuple(key[r * n : (r + 1) * n] for r in range(n))
                if (0, 0) in distances_to_goal(desc):
                    maps.append(desc)
                    if len(maps) == count:
                        break
        if len(maps) == count:
            return tuple(maps)
    raise ValueError(
        f"too few distinct solvable {n}x{n} maps for {count} {split} tasks (frozen_prob={frozen_prob}, "
        f"{len(exclude)} eval maps excluded); lower n_{split}_tasks or frozen_prob, or raise map_size"
    )

def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
