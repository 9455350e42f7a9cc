"""ScienceWorld on the real engine: contract, official splits, gold-path expert, score and reward.

Every test but ``check_env`` shares one env (one JVM) and one gold-path cache; the tasks are ones
whose gold path is quick to generate (about 1 s each).
"""

from __future__ import annotations

import json
import pickle

import pytest

pytest.importorskip("scienceworld", reason="ScienceWorld tests need the envs extra (`pip install -e .[envs]`, scripts/setup.sh does it) and Java 17")

from environments.scienceworld_env import (
    TASK_MAX_VARIATIONS,
    ScienceWorldTextEnv,
    normalize_command,
    split_variations,
)
from opd.envs import check_env, make_env

ENV_ID = "opd/ScienceWorldText-v0"
FAST_TASKS = ["find-animal", "lifespan-longest-lived", "use-thermometer", "power-component"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sw-cache")


@pytest.fixture(scope="module")
def env(cache_dir):
    env = ScienceWorldTextEnv(task_names=FAST_TASKS, cache_dir=str(cache_dir))
    yield env
    env.close()


def run_expert(env, task):
    obs, info = env.reset(options={"task": task})
    start_score, rewards = info["score"], []
    terminated = truncated = False
    while not (terminated or truncated):
        obs, reward, terminated, truncated, info = env.step(info["expert_action"])
        rewards.append(reward)
    return start_score, rewards, terminated, truncated, info


# ----- contract -----
def test_check_env_passes(cache_dir) -> None:
    check_env(make_env(ENV_ID, task_names=["lifespan-longest-lived"], cache_dir=str(cache_dir)), n_steps=12)


# ----- splits -----
def test_splits_are_the_official_variations() -> None:
    env = ScienceWorldTextEnv()
    sizes = {split: len(env.task_ids(split)) for split in ("train", "eval", "test")}
    assert sizes == {"train": 3592, "eval": 1796, "test": 1819}
    assert sum(TASK_MAX_VARIATIONS.values()) == 7207 == sum(sizes.values())
    ids = [set(env.task_ids(split)) for split in ("train", "eval", "test")]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert env.task_ids("eval") == ScienceWorldTextEnv().task_ids("eval")
    assert env.task_ids("train")[:2] == ["sw-boil-0", "sw-boil-1"] and env.task_ids("eval")[0] == "sw-boil-14"
    assert split_variations(30) == {"train": list(range(14)), "eval": list(range(14, 21)), "test": list(range(21, 30))}
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        env.task_ids("dev")


def test_split_table_matches_the_engine(env) -> None:
    server = env._engine()
    assert list(server.getTaskNames()) == sorted(TASK_MAX_VARIATIONS)
    assert {n: server.getTaskMaxVariations(n) for n in TASK_MAX_VARIATIONS} == TASK_MAX_VARIATIONS
    # getSets depends on the loaded task: check each distinct size class once.
    for name in ("identify-life-stages-2", "identify-life-stages-1", "lifespan-longest-lived"):
        server.load(name, 0, "", False)
        engine = {"train": list(server.getVariationsTrain()), "eval": list(server.getVariationsDev()),
                  "test": list(server.getVariationsTest())}
        assert split_variations(TASK_MAX_VARIATIONS[name]) == engine, name


# ----- expert, score, reward -----
@pytest.mark.parametrize("task", ["sw-find-animal-150", "sw-lifespan-longest-lived-62", "sw-use-thermometer-270",
                                  "sw-power-component-10"])
def test_expert_solves_eval_task(env, task) -> None:
    assert task in env.task_ids("eval")
    start_score, rewards, terminated, truncated, info = run_expert(env, task)
    assert (terminated, truncated, info["success"], info["score"], info["expert_action"]) == (True, False, True, 100, None)
    assert sum(rewards) == pytest.approx((100 - start_score) / 100)  # reward = score delta / 100


def test_reset_observation_states_task_and_format(env) -> None:
    obs, info = env.reset(options={"task": "sw-find-animal-150"})
    assert obs.startswith("Your task is to find a(n) animal. First, focus on the thing.")
    assert 'Answer with one action per turn, e.g. "look around"' in obs and "focus on OBJ" in obs
    assert "This room is called the kitchen." in obs
    assert info == {"success": False, "valid_action": True, "task": "sw-find-animal-150", "turn": 0, "score": 8,
                    "expert_action": "open door to outside"}
    json.dumps(info)


def test_wrong_focus_fails_the_task_with_score_minus_100(env) -> None:
    env.reset(options={"task": "sw-find-animal-150"})
    obs, reward, terminated, truncated, info = env.step("focus on air")
    assert obs == "You focus on the air."
    assert (reward, terminated, truncated, info["success"], info["score"]) == (-1.08, True, False, False, -100)


# ----- bad actions -----
@pytest.mark.parametrize("action", ["fly to the moon", "", "   ", "@@ not an action @@", None, "focus on unicorn",
                                    "look around\nplease " + "x" * 5000])
def test_bad_action_is_an_observation(env, action) -> None:
    env.reset(options={"task": "sw-lifespan-longest-lived-62"})
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith("Invalid action") and "No known action matches that input." in obs
    assert (reward, terminated, truncated, info["valid_action"], info["turn"]) == (0.0, False, False, False, 1)
    assert info["expert_action"] == "open door to kitchen"  # nothing happened, so the gold path still holds


def test_invalid_action_penalty(env) -> None:
    env.invalid_action_penalty = 0.25
    try:
        env.reset(options={"task": "sw-lifespan-longest-lived-62"})
        assert env.step("fly")[1] == -0.25
        assert env.step("look around")[1] == 0.0
    finally:
        env.invalid_action_penalty = 0.0


def test_commands_are_normalised(env) -> None:
    assert normalize_command("  Look   around. ") == "Look around"
    env.reset(options={"task": "sw-find-animal-150"})
    obs, _, _, _, info = env.step("  OPEN door to OUTSIDE. ")
    assert (obs, info["valid_action"], info["expert_action"]) == ("The door is now open.", True, "go to outside")


# ----- the expert follows the agent -----
def test_expert_waits_through_free_and_invalid_commands_and_leaves_on_deviation(env) -> None:
    _, info = env.reset(options={"task": "sw-find-animal-150"})
    for command in ("look around", "inventory", "xyzzy", "open door to outside"):
        _, _, _, _, info = env.step(command)
    assert info["expert_action"] == "go to outside"
    _, _, _, _, info = env.step("open door to hallway")  # changes the world: the gold path no longer applies
    assert info["valid_action"] and info["expert_action"] is None


def test_ambiguous_command_asks_which_one_and_a_number_answers(env) -> None:
    env.reset(options={"task": "sw-power-component-10"})  # starts in the art studio with three wood cups
    obs, _, _, _, info = env.step("pick up wood cup")
    assert obs.startswith("Ambiguous request: Please enter the number") and "0:\tpick up wood cup" in obs
    assert info["valid_action"]
    obs, _, _, _, info = env.step("0")
    assert obs == "You move the wood cup to the inventory." and info["valid_action"]
    assert info["expert_action"] is None


# ----- determinism -----
def test_same_actions_give_the_same_trajectory_after_other_tasks(env) -> None:
    actions = ["look around", "pick up wood cup", "1", "open door to hallway", "go to hallway", "look around",
               "open door to kitchen", "go to kitchen", "look around", "use thermometer on wood cup"]

    def trajectory():
        obs, info = env.reset(options={"task": "sw-power-component-10"})
        steps = [(obs, info["score"])]
        for action in actions:
            obs, reward, terminated, truncated, info = env.step(action)
            steps.append((obs, reward, terminated, info["valid_action"], info["score"]))
        return steps

    first = trajectory()
    run_expert(env, "sw-use-thermometer-270")  # other objects and simulation in the same JVM in between
    assert trajectory() == first
    assert first[2][0].startswith("Ambiguous request") and first[3][0] == "You move the wood cup to the inventory."


def test_reset_without_task_is_seed_deterministic(env) -> None:
    env.expert = False  # no gold paths needed: keeps the loads fast
    try:
        tasks = [env.reset(seed=s)[1]["task"] for s in range(4)]
        assert tasks == [env.reset(seed=s)[1]["task"] for s in range(4)]
        assert set(tasks) <= set(env.task_ids("train")) and len(set(tasks)) > 1
    finally:
        env.expert = True


# ----- gold-path cache -----
def test_gold_path_is_cached_and_reused(env, cache_dir) -> None:
    env.reset(options={"task": "sw-find-animal-151"})
    (path,) = cache_dir.glob("gold-v*/full/find-animal-151.json")
    record = json.loads(path.read_text())
    assert record["task"] == "find-animal" and record["variation"] == 151 and record["gold"][0] == "open door to outside"
    path.write_text(json.dumps({**record, "gold": ["look around"] + record["gold"]}))
    _, info = env.reset(options={"task": "sw-find-animal-151"})
    assert info["expert_action"] == "look around"  # read from the file, not generated again


def test_admissible_actions_option(env) -> None:
    env.admissible_actions = True
    try:
        _, info = env.reset(options={"task": "sw-lifespan-longest-lived-62"})
        admissible = info["admissible_actions"]
        assert len(admissible) > 100 and {"look around", "open door", "look at sink"} <= set(admissible)
        for action in [a for a in admissible if not a.startswith("focus")][::50][:6]:  # focus may end the task
            assert env.step(action)[4]["valid_action"], action
    finally:
        env.admissible_actions = False


# ----- budget, errors, copies -----
def test_truncation_at_max_turns(env) -> None:
    env.max_turns = 2
    try:
        env.reset(options={"task": "sw-find-animal-150"})
        flags = [env.step("look around")[2:4] for _ in range(2)]
        assert flags == [(False, False), (False, True)]
        with pytest.raises(RuntimeError, match="call reset"):
            env.step("look around")
    finally:
        env.max_turns = 200


@pytest.mark.parametrize("task", ["sw-boil-14", "sw-find-animal-300", "sw-find-animal", "find-animal-3", 7])
def test_bad_task_id_raises_naming_it(env, task) -> None:
    with pytest.raises(ValueError, match=repr(task)):
        env.reset(options={"task": task})


@pytest.mark.parametrize(("kwargs", "name"), [({"max_turns": 0}, "max_turns=0"),
                                              ({"task_names": ["boiling"]}, "task_names=\\['boiling'\\]"),
                                              ({"simplifications": "easy,fast"}, "simplifications='easy,fast'"),
                                              ({"render_mode": "human"}, "render_mode='human'")])
def test_bad_kwarg_raises_naming_it(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        ScienceWorldTextEnv(**kwargs)


def test_pickled_copy_holds_no_jvm(env) -> None:
    env.reset(options={"task": "sw-find-animal-150"})
    clone = pickle.loads(pickle.dumps(env))
    assert clone._gateway is None and clone.task_names == env.task_names
    with pytest.raises(RuntimeError, match="call reset"):
        clone.step("look around")
