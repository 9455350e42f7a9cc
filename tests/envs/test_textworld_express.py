"""TextWorldExpress on the real engine: contract, the engine's seed folds, gold-path expert, cache.

Every test but ``check_env`` shares one env (one JVM); steps take about 1 ms.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("textworld_express", reason="TextWorldExpress tests need the envs extra (`pip install -e .[envs]`, scripts/setup.sh does it) and Java 17")

from environments.textworld_express_env import GAME_NAMES, SPLIT_SEEDS, TextWorldExpressTextEnv
from opd.envs import check_env, make_env

ENV_ID = "opd/TextWorldExpressText-v0"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("twx-cache")


@pytest.fixture(scope="module")
def env(cache_dir):
    env = TextWorldExpressTextEnv(cache_dir=str(cache_dir))
    yield env
    env.close()


def run_expert(env, task):
    obs, info = env.reset(options={"task": task})
    rewards, terminated, truncated = [], False, False
    while not (terminated or truncated):
        obs, reward, terminated, truncated, info = env.step(info["expert_action"])
        rewards.append(reward)
    return obs, rewards, terminated, truncated, info


# ----- contract -----
def test_check_env_passes(cache_dir) -> None:
    check_env(make_env(ENV_ID, cache_dir=str(cache_dir)), n_steps=30)


# ----- splits -----
def test_splits_are_the_engine_seed_folds(env) -> None:
    sizes = {split: len(env.task_ids(split)) for split in ("train", "eval", "test")}
    assert sizes == {"train": 8000, "eval": 8000, "test": 8000}
    ids = [set(env.task_ids(split)) for split in ("train", "eval", "test")]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert env.task_ids("eval")[:2] == ["twx-cookingworld-10000", "twx-cookingworld-10001"]
    server = env._engine("coin")
    for game in GAME_NAMES:
        server.load(game, "")
        assert list(server.getSeedsTrain()) == list(SPLIT_SEEDS["train"]), game
        assert list(server.getSeedsDev()) == list(SPLIT_SEEDS["eval"]), game
        assert list(server.getSeedsTest()) == list(SPLIT_SEEDS["test"]), game
    env._loaded = None  # the loop above changed the engine's game behind the env's back
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        env.task_ids("dev")


def test_seen_splits_cut_the_train_fold_and_keep_its_vocabulary() -> None:
    env = TextWorldExpressTextEnv(game_names=["simonsays"])
    try:
        train_seen, eval_seen = env.task_ids("train_seen"), env.task_ids("eval_seen")
        assert (len(train_seen), len(eval_seen)) == (900, 100)
        assert not set(train_seen) & set(eval_seen) and set(train_seen) | set(eval_seen) == set(env.task_ids("train"))

        def objects(tasks):  # what the gold path names after its verb
            seen = set()
            for task in tasks:
                info = env.reset(options={"task": task})[1]
                while info["expert_action"] is not None:
                    seen.add(info["expert_action"].split(" ", 1)[1])
                    info = env.step(info["expert_action"])[4]
            return seen

        trained = objects(train_seen[:60])
        assert objects(eval_seen[:20]) <= trained  # held-out games, trained vocabulary
        assert not objects(env.task_ids("eval")[:20]) & trained  # the engine's dev fold: unseen objects
    finally:
        env.close()


# ----- expert -----
@pytest.mark.parametrize("game", GAME_NAMES)
def test_expert_solves_eval_games(env, game) -> None:
    for seed in (10000, 10001, 10002):
        obs, rewards, terminated, truncated, info = run_expert(env, f"twx-{game}-{seed}")
        assert (terminated, truncated, info["success"], info["score"], info["expert_action"]) == \
            (True, False, True, 1.0, None), (game, seed)
        assert sum(rewards) == pytest.approx(1.0)  # reward = change in the normalised score


def test_gold_path_is_cached_so_the_expert_is_reproducible(env, cache_dir) -> None:
    _, first = env.reset(options={"task": "twx-coin-10005"})
    (path,) = cache_dir.glob("gold-v*/coin/default/10005.json")
    gold = json.loads(path.read_text())["gold"]
    assert gold[0] == first["expert_action"]
    path.write_text(json.dumps({"gold": ["inventory"] + gold}))
    assert env.reset(options={"task": "twx-coin-10005"})[1]["expert_action"] == "inventory"


def test_expert_waits_through_free_commands_and_leaves_on_deviation(env) -> None:
    _, info = env.reset(options={"task": "twx-arithmetic-10000"})
    gold = info["expert_action"]
    for command in ("inventory", "xyzzy", "look around"):
        _, _, _, _, info = env.step(command)
    assert info["expert_action"] == "take math problem" and gold == "look around"
    detour = next(a for a in info["admissible_actions"] if a.startswith("take ") and a != "take math problem")
    _, _, _, _, info = env.step(detour)
    assert info["valid_action"] and info["expert_action"] is None


# ----- observations and bad actions -----
def test_reset_observation_states_task_and_format(env) -> None:
    obs, info = env.reset(options={"task": "twx-coin-10000"})
    assert obs.startswith("Your task is to search the environment and find the coin.") and "Answer with one action per turn" in obs
    assert (info["success"], info["valid_action"], info["task"], info["turn"], info["score"]) == \
        (False, True, "twx-coin-10000", 0, 0.0)
    assert "move north" in info["admissible_actions"] and info["admissible_actions"] == sorted(info["admissible_actions"])
    json.dumps(info)


@pytest.mark.parametrize("action", ["fly", "", "   ", None, "@@ not an action @@"])
def test_bad_action_is_an_observation(env, action) -> None:
    _, info0 = env.reset(options={"task": "twx-mapreader-10000"})
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith("Invalid action") and "Unknown action" in obs
    assert (reward, terminated, truncated, info["valid_action"]) == (0.0, False, False, False)
    assert info["expert_action"] == info0["expert_action"]


def test_simon_says_wrong_action_fails_the_game(env) -> None:
    _, info = env.reset(options={"task": "twx-simonsays-10000"})
    wrong = next(a for a in info["admissible_actions"] if a != info["expert_action"])
    _, reward, terminated, truncated, info = env.step(wrong)
    assert (terminated, truncated, info["success"], info["valid_action"]) == (True, False, False, True)


# ----- determinism, params, budget, errors -----
def test_same_actions_give_the_same_trajectory(env) -> None:
    def trajectory():
        obs, info = env.reset(options={"task": "twx-cookingworld-10003"})
        out = [obs]
        for i in range(25):
            action = info["admissible_actions"][(7 * i) % len(info["admissible_actions"])]
            obs, reward, terminated, truncated, info = env.step(action)
            out.append((obs, reward, terminated, info["expert_action"], tuple(info["admissible_actions"])))
            if terminated:
                break
        return out

    first = trajectory()
    run_expert(env, "twx-twc-10004")
    assert trajectory() == first


def test_game_params_change_the_game(cache_dir) -> None:
    env = TextWorldExpressTextEnv(game_names=["coin"], game_params={"coin": "numLocations=2,includeDoors=0"},
                                  cache_dir=str(cache_dir), max_turns=3)
    try:
        obs, info = env.reset(options={"task": "twx-coin-10000"})
        assert "door" not in " ".join(info["admissible_actions"])
        assert [env.step("inventory")[2:4] for _ in range(3)] == [(False, False), (False, False), (False, True)]
        with pytest.raises(ValueError, match="twx-cookingworld-10000"):
            env.reset(options={"task": "twx-cookingworld-10000"})
    finally:
        env.close()


@pytest.mark.parametrize("task", ["twx-coin-5000", "twx-chess-1", "coin-10", 3])
def test_bad_task_id_raises_naming_it(env, task) -> None:
    with pytest.raises(ValueError, match=repr(task)):
        env.reset(options={"task": task})


@pytest.mark.parametrize(("kwargs", "name"), [({"max_turns": 0}, "max_turns=0"),
                                              ({"game_names": ["chess"]}, "game_names=\\['chess'\\]"),
                                              ({"game_params": {"coin": 5}}, "game_params=")])
def test_bad_kwarg_raises_naming_it(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        TextWorldExpressTextEnv(**kwargs)
