"""The FrozenLake text environment (environments/frozenlake.py): its observations, splits, expert,
holes, invalid actions, truncation and argument checks, and the contract (check_env)."""

from __future__ import annotations

from collections import deque

import pytest

from environments.frozenlake import ACTIONS, INSTRUCTION, FrozenLakeTextEnv, expert_policy
from opd.envs import check_env, expert_action, make_env, task_ids

ENV_ID = "opd/FrozenLakeText-v0"
SMALL = {"n_train_tasks": 50, "n_eval_tasks": 10}
INVALID_TEMPLATE = "Invalid action '{}'. Answer with one of: left, down, right, up.\n"


def bfs_distance(desc: tuple[str, ...], start: tuple[int, int]) -> int | None:
    """Independent forward BFS (not the env's) from start to G avoiding H."""
    n = len(desc)
    seen, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in seen and desc[nr][nc] != "H":
                seen[(nr, nc)] = seen[(r, c)] + 1
                queue.append((nr, nc))
    return None


def grid_text(desc: tuple[str, ...], agent: tuple[int, int]) -> str:
    rows = [[("A" if (r, c) == agent else ch) for c, ch in enumerate(row)] for r, row in enumerate(desc)]
    n = len(desc)
    near = []
    for move, (dr, dc) in (("left", (0, -1)), ("down", (1, 0)), ("right", (0, 1)), ("up", (-1, 0))):
        r, c = agent[0] + dr, agent[1] + dc
        near.append(f"{move} {desc[r][c] if 0 <= r < n and 0 <= c < n else 'wall'}")
    return "\n".join(" ".join(row) for row in rows) + "\nAround you: " + ", ".join(near) + "."


def test_surroundings_line_names_walls_and_cells() -> None:
    env = FrozenLakeTextEnv(**SMALL)
    obs, _ = env.reset(options={"task": "fl4-eval-00000"})
    m = env.task_map("fl4-eval-00000")
    assert obs.endswith(f"\nAround you: left wall, down {m[1][0]}, right {m[0][1]}, up wall.")
    plain = FrozenLakeTextEnv(describe_surroundings=False, **SMALL)
    assert "Around you" not in plain.reset(options={"task": "fl4-eval-00000"})[0]


def find_task(env: FrozenLakeTextEnv, predicate) -> str:
    for task in env.task_ids("train"):
        if predicate(env.task_map(task)):
            return task
    raise LookupError("no train task matches the predicate")


# ----- contract checker -----
def test_check_env_passes_on_frozenlake() -> None:
    check_env(ENV_ID)
    check_env(make_env(ENV_ID, **SMALL))  # instance path: fresh copies from env.spec
    check_env(make_env(ENV_ID, hole_restarts=True, describe_position=True, **SMALL))


# ----- splits -----
def test_default_splits_sized_disjoint_by_content_and_deterministic() -> None:
    a, b = FrozenLakeTextEnv(), FrozenLakeTextEnv()
    train, eval_ = a.task_ids("train"), a.task_ids("eval")
    assert (len(train), len(eval_)) == (2000, 200)
    assert train == b.task_ids("train") and eval_ == b.task_ids("eval")
    assert train[17] == "fl4-train-00017" and eval_[3] == "fl4-eval-00003"
    train_maps = {a.task_map(t) for t in train}
    eval_maps = {a.task_map(t) for t in eval_}
    assert len(train_maps) == 2000 and len(eval_maps) == 200  # no duplicates within a split
    assert not train_maps & eval_maps
    assert [a.task_map(t) for t in eval_] == [b.task_map(t) for t in eval_]
    assert all(bfs_distance(m, (0, 0)) is not None for m in train_maps | eval_maps)


def test_custom_split_sizes() -> None:
    env = FrozenLakeTextEnv(**SMALL)
    assert len(env.task_ids("train")) == 50 and len(env.task_ids("eval")) == 10
    # The first eval maps do not depend on how many train tasks are requested.
    assert env.task_map("fl4-eval-00003") == FrozenLakeTextEnv().task_map("fl4-eval-00003")
    assert FrozenLakeTextEnv(split_seed=1, **SMALL).task_map("fl4-eval-00000") != env.task_map("fl4-eval-00000")


# ----- episodes -----
def test_expert_solves_eval_tasks_by_shortest_path() -> None:
    env = FrozenLakeTextEnv(max_turns=100, n_train_tasks=50, n_eval_tasks=50)
    for task in env.task_ids("eval"):
        obs, info = env.reset(seed=0, options={"task": task})
        shortest = bfs_distance(env.task_map(task), (0, 0))
        for n_moves in range(1, 101):
            obs, reward, terminated, truncated, info = env.step(expert_policy(obs, info))
            if terminated or truncated:
                break
        assert (terminated, truncated, reward, info["success"]) == (True, False, 1.0, True), task
        assert n_moves == shortest, task
        assert obs.startswith("You reached the goal!\n") and expert_action(info) is None


def test_hole_terminates_with_zero_reward() -> None:
    env = FrozenLakeTextEnv(**SMALL)
    task = find_task(env, lambda m: m[1][0] == "H")
    env.reset(seed=0, options={"task": task})
    obs, reward, terminated, truncated, info = env.step("down")
    assert (reward, terminated, truncated, info["success"], info["valid_action"]) == (0.0, True, False, False, True)
    assert obs == "You fell into a hole.\n" + grid_text(env.task_map(task), (1, 0))


def test_hole_restarts_sends_the_agent_back_to_the_start() -> None:
    env = FrozenLakeTextEnv(hole_restarts=True, max_turns=4, **SMALL)
    task = find_task(env, lambda m: m[1][0] == "H")
    env.reset(seed=0, options={"task": task})
    obs, reward, terminated, truncated, info = env.step("down")  # into the hole at (1, 0)
    assert (reward, terminated, truncated, info["success"], info["valid_action"]) == (0.0, False, False, False, True)
    assert obs == "You fell into a hole and went back to the start.\n" + grid_text(env.task_map(task), (0, 0))
    assert env.agent_cell == (0, 0) and info["expert_action"] == expert_action(env.reset(seed=0, options={"task": task})[1])
    env.reset(seed=0, options={"task": task})
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step("down")
        assert not terminated and env.agent_cell == (0, 0)
    obs, reward, terminated, truncated, info = env.step("down")
    assert (terminated, truncated) == (False, True)  # only the turn budget ends it


def test_position_line_counts_from_one() -> None:
    env = FrozenLakeTextEnv(describe_position=True, **SMALL)
    task = find_task(env, lambda m: m[0][1] != "H" and m[1][1] != "H")
    obs, _ = env.reset(seed=0, options={"task": task})
    assert obs == INSTRUCTION + grid_text(env.task_map(task), (0, 0)).replace(
        "\nAround you", "\nPosition: row 1, column 1.\nAround you")
    env.step("right")
    obs, *_ = env.step("down")
    assert "\nPosition: row 2, column 2.\nAround you: " in obs


def test_invalid_action_message_penalty_and_no_move() -> None:
    env = FrozenLakeTextEnv(**SMALL)
    env.reset(seed=0, options={"task": "fl4-eval-00000"})
    bad = "I think I should go diagonally to the bottom right corner now"
    obs, reward, terminated, truncated, info = env.step(bad)
    assert obs == INVALID_TEMPLATE.format(bad[:40]) + grid_text(env.task_map("fl4-eval-00000"), (0, 0))
    assert (reward, terminated, truncated, info["valid_action"], info["turn"]) == (-0.1, False, False, False, 1)
    assert env.agent_cell == (0, 0)
    obs, *_ = env.step("")
    assert obs.startswith(INVALID_TEMPLATE.format(""))


def test_action_parsing_and_wall_bump() -> None:
    env = FrozenLakeTextEnv(**SMALL)
    task = find_task(env, lambda m: m[0][1] != "H")
    env.reset(seed=0, options={"task": task})
    obs, _, _, _, info = env.step("  LEFT. ")
    assert obs == "You bumped into the wall.\n" + grid_text(env.task_map(task), (0, 0))
    assert info["valid_action"] and info["admissible_actions"] == list(ACTIONS)
    obs, _, _, _, info = env.step("Right.")
    assert obs == grid_text(env.task_map(task), (0, 1)) and env.agent_cell == (0, 1)


def test_truncation_at_max_turns() -> None:
    env = FrozenLakeTextEnv(max_turns=3, **SMALL)
    env.reset(seed=0, options={"task": "fl4-eval-00001"})
    flags = [env.step("up")[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("up")


def test_reset_obs_and_single_agent_marker() -> None:
    env = make_env(ENV_ID, **SMALL)
    obs, info = env.reset(seed=5, options={"task": "fl4-eval-00003"})
    grid = obs.removeprefix(INSTRUCTION)
    assert obs.startswith(INSTRUCTION) and grid.split("Around")[0].count("A") == 1 and grid.split("\n")[0].startswith("A ")
    assert grid == grid_text(env.unwrapped.task_map("fl4-eval-00003"), (0, 0)) == env.render().removeprefix(INSTRUCTION)
    assert (info["success"], info["valid_action"], info["task"], info["turn"]) == (False, True, "fl4-eval-00003", 0)
    assert info["expert_action"] in ACTIONS
    # Another instance with the same kwargs accepts the id and shows the same map.
    assert make_env(ENV_ID, **SMALL).reset(options={"task": "fl4-eval-00003"})[0] == obs


def test_reset_without_task_is_seed_deterministic() -> None:
    a, b = FrozenLakeTextEnv(**SMALL), FrozenLakeTextEnv(**SMALL)
    tasks = [a.reset(seed=s)[1]["task"] for s in range(6)]
    assert tasks == [b.reset(seed=s)[1]["task"] for s in range(6)]
    assert set(tasks) <= set(a.task_ids("train")) and len(set(tasks)) > 1


# ----- errors -----
@pytest.mark.parametrize("task", ["fl4-test-00001", "fl4-eval-00010", "fl5-eval-00000", "nonsense", 3])
def test_bad_task_id_raises_naming_it(task) -> None:
    env = FrozenLakeTextEnv(**SMALL)
    with pytest.raises(ValueError, match=repr(task)):
        env.reset(options={"task": task})


def test_unknown_split_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="unknown split 'test'.*'train', 'eval'"):
        FrozenLakeTextEnv(**SMALL).task_ids("test")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"map_size": 1}, "map_size=1"),
        ({"frozen_prob": 0.0}, "frozen_prob=0.0"),
        ({"frozen_prob": 1.5}, "frozen_prob=1.5"),
        ({"max_turns": 0}, "max_turns=0"),
        ({"invalid_action_penalty": -1.0}, "invalid_action_penalty=-1.0"),
    ],
)
def test_bad_kwarg_raises_naming_it(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        FrozenLakeTextEnv(**kwargs)


def test_too_few_distinct_maps_raises() -> None:
    with pytest.raises(ValueError, match="too few distinct solvable 2x2 maps"):
        FrozenLakeTextEnv(map_size=2).task_ids("train")
