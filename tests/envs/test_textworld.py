"""TextWorld on the real generator and engine: contract, generated splits, walkthrough expert, cache.

Games take 1-4 s each to generate, so the module shares one cache of a handful of games
(2 train, 3 eval) in a temp dir.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("textworld", reason="TextWorld tests need the envs extra (`pip install -e .[envs]`, scripts/setup.sh does it)")

from environments.textworld_env import TextWorldTextEnv, clean_feedback
from opd.envs import check_env, make_env

ENV_ID = "opd/TextWorldText-v0"
SMALL = {"n_train_games": 2, "n_eval_games": 3}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tw-cache")


@pytest.fixture(scope="module")
def env(cache_dir):
    env = TextWorldTextEnv(cache_dir=str(cache_dir), **SMALL)
    yield env
    env.close()


# ----- contract -----
def test_check_env_passes(cache_dir) -> None:
    check_env(make_env(ENV_ID, cache_dir=str(cache_dir), **SMALL))


# ----- splits -----
def test_splits_sized_disjoint_and_deterministic() -> None:
    env = TextWorldTextEnv()  # ids and seeds need no game generated
    train, eval_ = env.task_ids("train"), env.task_ids("eval")
    assert (len(train), len(eval_)) == (1000, 100)
    assert train[17] == "tw-r5-o10-q5-train-00017" and eval_ == TextWorldTextEnv().task_ids("eval")
    seeds = {split: {env.game_seed(t) for t in env.task_ids(split)} for split in ("train", "eval")}
    assert len(seeds["train"]) == 1000 and len(seeds["eval"]) == 100 and not seeds["train"] & seeds["eval"]
    assert TextWorldTextEnv(split_seed=1).game_seed(eval_[0]) != env.game_seed(eval_[0])
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.task_ids("test")


def test_generation_is_deterministic_and_cached(env, tmp_path) -> None:
    task = env.task_ids("eval")[0]
    path = env.game_file(task)
    other = TextWorldTextEnv(cache_dir=str(tmp_path), **SMALL).game_file(task)
    assert path != other and path.read_bytes() == other.read_bytes()  # same seed, same compiled game
    game = json.loads(path.with_suffix(".json").read_text())
    assert game["metadata"]["walkthrough"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["game.json", "game.ni", "game.z8"]
    assert not list(path.parent.parent.glob("*.tmp*"))  # the staging folder was renamed away
    mtime = path.stat().st_mtime_ns
    assert env.game_file(task).stat().st_mtime_ns == mtime  # reused, not regenerated


# ----- expert -----
@pytest.mark.parametrize("index", range(3))
def test_walkthrough_expert_solves_eval_game(env, index) -> None:
    task = env.task_ids("eval")[index]
    walkthrough = json.loads(env.game_file(task).with_suffix(".json").read_text())["metadata"]["walkthrough"]
    obs, info = env.reset(options={"task": task})
    rewards = []
    for turn in range(1, 51):
        obs, reward, terminated, truncated, info = env.step(info["expert_action"])
        rewards.append(reward)
        if terminated or truncated:
            break
    assert (terminated, truncated, info["success"], info["score"], info["expert_action"]) == (True, False, True, 1, None)
    assert turn == len(walkthrough) and sum(rewards) == 1.0 and rewards[-1] == 1.0
    assert "*** The End ***" in obs and "RESTART" not in obs


def test_expert_replans_after_a_detour(env) -> None:
    _, info = env.reset(options={"task": env.task_ids("eval")[1]})  # starts beside an open exit west
    first = info["expert_action"]
    detour = next(a for a in info["admissible_actions"] if a.startswith("go ") and a != first)
    _, _, _, _, info = env.step(detour)
    assert info["valid_action"] and info["expert_action"] == "go " + {"north": "south", "south": "north",
                                                                      "east": "west", "west": "east"}[detour[3:]]
    turns = 1
    while not info["success"]:
        info = env.step(info["expert_action"])[4]
        turns += 1
    assert turns <= 1 + 1 + 10  # detour, way back, then the quest


# ----- observations and bad actions -----
def test_reset_observation_states_format_objective_and_room(env) -> None:
    task = env.task_ids("eval")[1]
    obs, info = env.reset(options={"task": task})
    assert obs.startswith("You are playing a text adventure game. Answer with one command per turn")
    assert "$$" not in obs and "\n>" not in obs  # banner and prompt stripped
    assert "-= " in obs  # the room title
    assert (info["success"], info["valid_action"], info["task"], info["turn"], info["score"], info["max_score"]) == \
        (False, True, task, 0, 0, 1)
    assert info["expert_action"] in info["admissible_actions"] and info["admissible_actions"] == sorted(info["admissible_actions"])
    json.dumps(info)


@pytest.mark.parametrize("action", ["dance", "", "   ", None, "@@ not an action @@", "take the moon"])
def test_bad_action_is_an_observation(env, action) -> None:
    _, info0 = env.reset(options={"task": env.task_ids("eval")[0]})
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith("Invalid action")
    assert (reward, terminated, truncated, info["valid_action"], info["turn"]) == (0.0, False, False, False, 1)
    assert info["expert_action"] == info0["expert_action"]


def test_blocked_move_is_not_valid_and_abbreviations_are(env) -> None:
    env.reset(options={"task": env.task_ids("eval")[0]})  # the west door of the sauna is closed
    obs, _, _, _, info = env.step("go west")
    assert obs.startswith("Invalid action 'go west': You have to open the door first.") and not info["valid_action"]
    obs, _, _, _, info = env.step("x door")  # not admissible as typed, but the parser carries it out
    assert info["valid_action"] and not obs.startswith("Invalid")


def test_invalid_action_penalty(cache_dir) -> None:
    env = TextWorldTextEnv(cache_dir=str(cache_dir), invalid_action_penalty=0.5, **SMALL)
    env.reset(options={"task": env.task_ids("eval")[0]})
    assert env.step("dance")[1] == -0.5 and env.step("look")[1] == 0.0


def test_clean_feedback() -> None:
    raw = ("\nYou eat it.\n\n\n\nYour score has just gone up by one point.\n\n\n"
           "                     *** The End ***\n\nYou scored 1 out of a possible 1, in 6 turns.\n\n\n"
           "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?\n>      -= Attic =-0/5")
    assert clean_feedback(raw) == ("You eat it.\n\nYour score has just gone up by one point.\n\n*** The End ***\n\n"
                                   "You scored 1 out of a possible 1, in 6 turns.")


# ----- determinism, budget, errors -----
def test_same_actions_give_the_same_trajectory(env) -> None:
    actions = ["look", "dance", "go north", "inventory", "examine door", "open door", "go west", "go east", "look"]

    def trajectory(task):
        obs, info = env.reset(options={"task": task})
        out = [(obs, info["expert_action"])]
        for action in actions:
            obs, reward, terminated, truncated, info = env.step(action)
            out.append((obs, reward, info["valid_action"], info["expert_action"], tuple(info["admissible_actions"])))
            if terminated or truncated:
                break
        return out

    first = trajectory(env.task_ids("eval")[0])
    trajectory(env.task_ids("eval")[2])
    assert trajectory(env.task_ids("eval")[0]) == first


def test_reset_without_task_is_seed_deterministic(env) -> None:
    tasks = [env.reset(seed=s)[1]["task"] for s in range(4)]
    assert tasks == [env.reset(seed=s)[1]["task"] for s in range(4)]
    assert set(tasks) <= set(env.task_ids("train"))


def test_truncation_at_max_turns(cache_dir) -> None:
    env = TextWorldTextEnv(cache_dir=str(cache_dir), max_turns=2, **SMALL)
    env.reset(options={"task": env.task_ids("eval")[0]})
    assert [env.step("look")[2:4] for _ in range(2)] == [(False, False), (False, True)]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("look")


@pytest.mark.parametrize("task", ["tw-r5-o10-q5-eval-00003", "tw-r4-o10-q5-eval-00000", "tw-r5-o10-q5-test-00000",
                                  "nonsense", 3])
def test_bad_task_id_raises_naming_it(env, task) -> None:
    with pytest.raises(ValueError, match=repr(task)):
        env.reset(options={"task": task})


@pytest.mark.parametrize(("kwargs", "name"), [({"max_turns": 0}, "max_turns=0"), ({"nb_rooms": 0}, "nb_rooms=0"),
                                              ({"invalid_action_penalty": -1}, "invalid_action_penalty=-1")])
def test_bad_kwarg_raises_naming_it(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        TextWorldTextEnv(**kwargs)
