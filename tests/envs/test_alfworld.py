"""ALFWorld on the real engine (alfworld 0.4.2 + TextWorld PddlEnv + Fast Downward), no mocks.

Games are generated into a per-module temporary cache. The official game files cannot be
downloaded here, so the official-data path is tested on a directory built in the official
``json_2.1.1`` layout from generated games (plus decoys the official loader must skip).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("alfworld", reason="ALFWorld tests need `pip install alfworld==0.4.2`")

from environments.alfworld_env import ALFWorldTextEnv  # noqa: E402
from environments.alfworld_env.env import ACTION_HELP, NOTHING_HAPPENS, normalize_command  # noqa: E402
from environments.alfworld_env.games import GeneratedGames, OfficialGames  # noqa: E402
from environments.alfworld_env.generator import TASK_TYPES, render_problem, sample_task, split_scenes  # noqa: E402
from environments.alfworld_env.search import SearchExpert, receptacles_in  # noqa: E402
from opd.envs import check_env, expert_action, make_env  # noqa: E402

ENV_ID = "opd/ALFWorldText-v0"
SMALL = {"n_train_tasks": 12, "n_eval_tasks": 6}
EVAL_HEAT = "alfgen-pick_heat_then_place-eval-00003"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("alfworld-cache"))


@pytest.fixture(scope="module")
def env(cache_dir) -> ALFWorldTextEnv:
    # One engine for the module: each new game costs about a second to load, a repeat far less.
    return ALFWorldTextEnv(max_turns=30, cache_dir=cache_dir, **SMALL)


def play_expert(env: ALFWorldTextEnv, task: str) -> tuple[list[str], str, float, dict]:
    obs, info = env.reset(seed=0, options={"task": task})
    actions = []
    while True:
        actions.append(expert_action(info))
        obs, reward, terminated, truncated, info = env.step(actions[-1])
        if terminated or truncated:
            return actions, obs, reward, info


# ----- contract -----
def test_check_env(cache_dir) -> None:
    # One task per split keeps it to two games (each new game costs about a second to load).
    check_env(make_env(ENV_ID, max_turns=5, cache_dir=cache_dir, n_train_tasks=1, n_eval_tasks=1), n_steps=7)


def test_expert_solves_one_eval_task_of_each_type(env) -> None:
    for task in env.task_ids("eval"):  # 6 tasks: one per type
        obs, info = env.reset(seed=0, options={"task": task})
        plan_length = None
        for n_steps in range(1, 31):
            action = expert_action(info)
            assert action in info["admissible_actions"], (task, action)
            obs, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                plan_length = n_steps
                break
        outcome = (terminated, truncated, reward, info["success"], info["valid_action"])
        assert outcome == (True, False, 1.0, True, True), task
        assert 3 <= plan_length <= 12 and expert_action(info) is None, task


def test_search_expert_solves_every_type_knowing_only_what_it_has_seen(cache_dir) -> None:
    # The imitable expert: every object it takes was named in an observation before, every
    # command is admissible, no planner call (the planner's expert walks to hidden objects).
    env = ALFWorldTextEnv(max_turns=50, cache_dir=cache_dir, expert="search", show_admissible=True,
                          n_train_tasks=12, n_eval_tasks=12)
    for task in env.task_ids("eval"):  # 12 tasks: two per type
        obs, info = env.reset(seed=0, options={"task": task})
        assert env._plan == []  # no planner call
        shown, order, took = obs, receptacles_in(obs), False
        searched: list[int] = []  # where it looked before its first pick-up: in the order the reset lists
        for _ in range(50):
            action = expert_action(info)
            assert action in info["admissible_actions"], (task, action)
            if not took and action.startswith(("go to ", "open ")):
                searched.append(order.index(action.removeprefix("go to ").removeprefix("open ")))
            took = took or action.startswith("take ")
            if action.startswith("take "):
                thing = action.split(" from ")[0][len("take "):]
                assert re.search(rf"\ba {re.escape(thing)}\b", shown), (task, thing)  # "you see a soapbar 1, ..."
            obs, reward, terminated, truncated, info = env.step(action)
            shown += "\n" + obs.split("\nAdmissible commands:")[0]
            if terminated or truncated:
                break
        assert (terminated, reward, info["success"]) == (True, 1.0, True), task
        assert expert_action(info) is None and searched == sorted(searched), (task, searched)
    assert ALFWorldTextEnv(expert=False, **SMALL).expert_kind is None


def test_search_expert_reaches_beside_receptacles_and_remembers_what_full_hands_cannot_take() -> None:
    # Engine facts the expert relies on: a receptacle at the agent's spot has no "go to" (its
    # contents are takeable, a closed one is opened from here), and nothing is takeable while
    # the agent holds something, which must not make it forget the second of two objects.
    intro = "Looking quickly around you, you see a cabinet 2, a cabinet 1, a sofa 1, and a shelf 1.\n"
    expert = SearchExpert("pick_two_obj_and_place", "Book", "Shelf", "", receptacles_in(intro),
                          {"Book": {"Cabinet", "Sofa"}})
    assert expert.receptacles == ["cabinet 2", "cabinet 1", "sofa 1", "shelf 1"]
    here = ["go to cabinet 1", "go to sofa 1", "go to shelf 1", "open cabinet 2", "open cabinet 1"]
    assert expert.action(["go to cabinet 2", *here[:3]]) == "go to cabinet 2"
    expert.observe("go to cabinet 2", "You arrive at cabinet 2. The cabinet 2 is closed.",
                   ["go to sofa 1", "go to shelf 1", "open cabinet 2", "open cabinet 1"])
    assert expert.action(["go to sofa 1", "go to shelf 1", "open cabinet 2", "open cabinet 1"]) == "open cabinet 2"
    expert.observe("open cabinet 2", "You open the cabinet 2. The cabinet 2 is open. In it, you see nothing.",
                   ["go to sofa 1", "go to shelf 1", "close cabinet 2", "open cabinet 1"])
    # cabinet 1 shares the spot: opened from here, not gone to
    assert expert.action(["go to sofa 1", "go to shelf 1", "close cabinet 2", "open cabinet 1"]) == "open cabinet 1"
    expert.observe("open cabinet 1", "You open the cabinet 1. ...",
                   ["go to sofa 1", "go to shelf 1", "take book 1 from cabinet 1", "take book 2 from cabinet 1"])
    assert expert.seen == {"book 1": "cabinet 1", "book 2": "cabinet 1"}
    assert expert.action(["go to sofa 1", "take book 1 from cabinet 1", "take book 2 from cabinet 1"]) \
        == "take book 1 from cabinet 1"
    expert.observe("take book 1 from cabinet 1", "You pick up the book 1 from the cabinet 1.", ["go to shelf 1"])
    assert expert.seen == {"book 2": "cabinet 1"}  # full hands: book 2 is not takeable, and not forgotten
    assert expert.action(["go to sofa 1", "go to shelf 1"]) == "go to shelf 1"
    expert.observe("go to shelf 1", "You arrive at shelf 1.", ["go to cabinet 1", "move book 1 to shelf 1"])
    assert expert.action(["go to cabinet 1", "move book 1 to shelf 1"]) == "move book 1 to shelf 1"
    expert.observe("move book 1 to shelf 1", "You move the book 1 to the shelf 1.",
                   ["go to cabinet 1", "take book 1 from shelf 1"])
    assert expert.delivered == {"book 1"}
    # the delivered book is takeable at the shelf, but the expert goes back for the other one
    assert expert.action(["go to cabinet 1", "take book 1 from shelf 1"]) == "go to cabinet 1"
    assert expert.action(["look"]) is None  # not admissible: None, never an invalid command


def test_reset_observation_and_info(env) -> None:
    obs, info = env.reset(seed=0, options={"task": EVAL_HEAT})
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
    assert "\n\nYour task is to: heat some apple and put it in sinkbasin.\n\n" in obs and obs.endswith(ACTION_HELP)
    assert (info["success"], info["valid_action"], info["task"], info["turn"]) == (False, True, EVAL_HEAT, 0)
    assert info["expert_action"] in info["admissible_actions"] and "look" in info["admissible_actions"]
    assert info["game_file"] == env.games.game_file(EVAL_HEAT)
    assert json.loads(json.dumps(info)) == info  # JSON-safe
    assert env.render() == obs


def test_same_seed_multi_step_trajectory_is_identical_and_expert_replans(cache_dir) -> None:
    def run() -> list[tuple]:
        env = ALFWorldTextEnv(max_turns=30, cache_dir=cache_dir, **SMALL)
        obs, info = env.reset(seed=3, options={"task": "alfgen-pick_two_obj_and_place-eval-00005"})
        trace = [(obs, info["expert_action"])]
        # Two detours (an off-plan move and an examine) before following the expert to the end.
        for i in range(30):
            action = info["admissible_actions"][i % 3] if i in (1, 4) else info["expert_action"]
            obs, reward, terminated, truncated, info = env.step(action)
            trace.append((action, obs, reward, terminated, truncated, info["expert_action"], info["valid_action"]))
            if terminated or truncated:
                break
        return trace

    first, second = run(), run()
    assert first == second
    assert first[-1][2:5] == (1.0, True, False)  # the replanned expert still solves it after the detours
    assert all(step[-1] for step in first[1:])


def test_bad_actions_are_observations(env, cache_dir) -> None:
    env.reset(seed=0, options={"task": EVAL_HEAT})
    for bad in ("fly to the moon", "", "take unicorn 1 from countertop 1", 42, None):
        obs, reward, terminated, truncated, info = env.step(bad)
        assert (obs, reward, terminated, truncated, info["valid_action"]) == (NOTHING_HAPPENS, 0.0, False, False, False)
    assert info["turn"] == 5 and info["expert_action"] is not None

    penalised = ALFWorldTextEnv(cache_dir=cache_dir, invalid_action_penalty=0.1, **SMALL)
    penalised.reset(options={"task": EVAL_HEAT})
    assert penalised.step("dance")[1] == -0.1


def test_command_normalisation_and_put_alias(env) -> None:
    assert normalize_command("  Take Apple 1 from  CounterTop 3. ") == "take apple 1 from countertop 3"
    assert normalize_command("put apple 1 in/on sinkbasin 1") == "move apple 1 to sinkbasin 1"
    assert normalize_command(7) == ""
    actions, *_ = play_expert(env, EVAL_HEAT)  # warm the game, then replay with loose spelling
    obs, info = env.reset(options={"task": EVAL_HEAT})
    for action in actions[:-1]:
        obs, reward, terminated, truncated, info = env.step(f"  {action.upper()}.")
        assert info["valid_action"], action
    verb, rest = actions[-1].split(" ", 1)
    assert verb == "move"
    obj, recep = rest.split(" to ")
    obs, reward, terminated, truncated, info = env.step(f"put {obj} in/on {recep}")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert obs == f"You move the {obj} to the {recep}."


def test_truncation_show_admissible_no_expert_and_step_after_end(cache_dir) -> None:
    env = ALFWorldTextEnv(max_turns=2, show_admissible=True, expert=False, cache_dir=cache_dir, **SMALL)
    obs, info = env.reset(options={"task": EVAL_HEAT})
    assert obs.endswith("Admissible commands: " + ", ".join(info["admissible_actions"]))
    assert info["expert_action"] is None
    flags = [env.step("look")[2:4] for _ in range(2)]
    assert flags == [(False, False), (False, True)]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("look")


_OFFICIAL_STACK = """
import json, sys
import textworld
from textworld.envs import PddlEnv
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredExpertType, AlfredInfos
infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
env = AlfredExpert(AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False)), expert_type=AlfredExpertType.PLANNER)
env.load(sys.argv[1])
state = env.reset()
trace = [[state.feedback, state.admissible_commands, state["extra.expert_plan"][0]]]
while not state["won"] and len(trace) < 30:
    state, score, done = env.step(state["extra.expert_plan"][0])
    trace.append([state.feedback, state.admissible_commands, (state["extra.expert_plan"] or [None])[0], score])
print(json.dumps(trace))
"""


def test_matches_alfworlds_own_stack_with_the_planner_expert(env) -> None:
    # ALFWorld's wrappers with AlfredExpert(PLANNER), replanning every step, in a fresh process
    # without this module's memoised parsing: same observations, commands, expert actions and reward.
    game_file = env.games.game_file(EVAL_HEAT)
    result = subprocess.run([sys.executable, "-c", _OFFICIAL_STACK, game_file], capture_output=True, text=True,
                            check=True, timeout=120)
    official = json.loads(result.stdout.strip().splitlines()[-1])
    obs, info = env.reset(seed=0, options={"task": EVAL_HEAT})
    assert obs == f"{official[0][0].strip()}\n\n{ACTION_HELP}"
    assert (info["admissible_actions"], info["expert_action"]) == (official[0][1], official[0][2])
    for feedback, admissible, expert, score in official[1:]:
        obs, reward, terminated, truncated, info = env.step(info["expert_action"])
        ours = (obs, info["admissible_actions"], info["expert_action"], reward)
        assert ours == (feedback.strip(), admissible, expert, score)
    assert terminated and info["success"]


# ----- tasks, splits and the cache -----
def test_splits_sizes_disjoint_and_deterministic(cache_dir) -> None:
    env = ALFWorldTextEnv(cache_dir=cache_dir)
    train, eval_, seen = env.task_ids("train"), env.task_ids("eval"), env.task_ids("eval_seen")
    assert (len(train), len(eval_), len(seen)) == (3600, 120, 120)
    assert train[17] == "alfgen-pick_two_obj_and_place-train-00017" and eval_[3] == EVAL_HEAT
    assert train == ALFWorldTextEnv(cache_dir=cache_dir).task_ids("train")
    assert not set(train) & set(eval_) and not set(seen) & set(train)
    # Disjoint by content: eval rooms are floor plans train never uses.
    eval_tasks = [sample_task("eval", i) for i in range(120)]
    train_scenes = {sample_task("train", i).scene for i in range(600)}
    assert not train_scenes & {t.scene for t in eval_tasks}
    assert {t.task_type for t in eval_tasks} == set(TASK_TYPES.values())
    assert {t.task_type for t in eval_tasks[:6]} == set(TASK_TYPES.values())
    seen_tasks = [sample_task("eval_seen", i) for i in range(60)]
    assert {t.scene for t in seen_tasks} <= set(split_scenes("train"))  # seen rooms, new tasks
    assert not {render_problem(t) for t in seen_tasks} & {render_problem(sample_task("train", i)) for i in range(60)}
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.task_ids("test")


def test_generation_is_a_pure_function_of_split_index_and_seed() -> None:
    task = sample_task("eval", 3)
    assert task == sample_task("eval", 3)
    assert (task.task_type, task.scene, task.object_target, task.parent_target) == (
        "pick_heat_then_place_in_recep", 4, "Apple", "SinkBasin")
    assert task.description == "heat some apple and put it in sinkbasin"
    assert sample_task("eval", 3, split_seed=1) != task
    look = sample_task("eval", 1)
    assert look.toggle_target == "DeskLamp" and any(o.type == "DeskLamp" for o in look.objects)
    pick_two = sample_task("eval", 5)
    assert sum(o.type == pick_two.object_target for o in pick_two.objects) >= 2
    for t in (task, look, pick_two):  # the goal never holds at the start
        parents = {r.id for r in t.receptacles if r.type == t.parent_target}
        assert not any(o.type == t.object_target and o.receptacle in parents for o in t.objects)


def test_varied_train_rooms_change_furniture_only_in_train_and_stay_solvable(cache_dir) -> None:
    def furniture(task) -> set[str]:
        return {r.type for r in task.receptacles}

    plan_furniture = {}  # a floor plan's receptacle types are the same in every plain game
    for i in range(600):
        task = sample_task("train", i)
        plan_furniture.setdefault(task.scene, furniture(task))
    varied = [sample_task("train", i, vary_rooms=True) for i in range(60)]
    assert varied == [sample_task("train", i, vary_rooms=True) for i in range(60)]  # still a pure function
    assert {t.scene for t in varied} <= set(split_scenes("train"))
    compared = [v for v in varied if v.scene in plan_furniture]
    changed = [v for v in compared if furniture(v) != plan_furniture[v.scene]]
    assert len(compared) >= 50 and len(changed) >= 0.8 * len(compared), (len(compared), len(changed))
    for task in varied:  # the task's needs are still in the room
        assert task.parent_target in furniture(task) or task.task_type == "look_at_obj_in_light"
        assert {r.id for r in task.receptacles} >= {o.receptacle for o in task.objects}
    # Only the train split varies, and its games live in their own cache directory.
    games = GeneratedGames({"train": 6, "eval": 6}, split_seed=0, cache_dir=cache_dir, vary_train_rooms=True)
    assert games.root.endswith("seed0-varied")
    with open(games.game_file(EVAL_HEAT)) as f:
        assert json.load(f)["pddl_problem"] == render_problem(sample_task("eval", 3))
    env = ALFWorldTextEnv(max_turns=30, cache_dir=cache_dir, expert="search", vary_train_rooms=True, **SMALL)
    for task in env.task_ids("train")[:6]:  # one of each type, on the real engine
        *_, reward, info = play_expert(env, task)
        assert (reward, info["success"]) == (1.0, True), task
    with pytest.raises(ValueError, match="vary_train_rooms=True only applies to generated games"):
        ALFWorldTextEnv(game_files_dir=cache_dir, vary_train_rooms=True)


def test_cache_is_written_once_and_atomically(tmp_path, monkeypatch) -> None:
    import environments.alfworld_env.games as games_module

    games = GeneratedGames({"train": 6, "eval": 6}, split_seed=0, cache_dir=str(tmp_path))
    path = games.game_file(EVAL_HEAT)
    assert path.startswith(str(tmp_path)) and path.endswith(f"/eval/{EVAL_HEAT}/game.tw-pddl")
    directory = os.path.dirname(path)
    assert sorted(os.listdir(directory)) == ["game.tw-pddl", "traj_data.json"]  # no temporary files left
    game = json.load(open(path))
    assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable"} and game["solvable"]
    assert "UNKNOWN GOAL" not in game["grammar"] and "heat some apple and put it in sinkbasin" in game["grammar"]
    traj = json.load(open(os.path.join(directory, "traj_data.json")))
    assert traj["task_type"] == "pick_heat_then_place_in_recep" and traj["pddl_params"]["object_target"] == "Apple"
    mtime = os.stat(path).st_mtime_ns
    monkeypatch.setattr(games_module, "sample_task", lambda *a, **k: pytest.fail("regenerated a cached game"))
    assert games.game_file(EVAL_HEAT) == path and os.stat(path).st_mtime_ns == mtime
    monkeypatch.setenv("OPD_ALFWORLD_CACHE", str(tmp_path / "from-env"))
    assert GeneratedGames({"eval": 1}, 0, None).root.startswith(str(tmp_path / "from-env"))


# ----- the official game files -----
def _official_tree(root, cache_dir) -> dict[str, str]:
    """A json_2.1.1 tree in the official layout, built from generated games (the real one is a download)."""
    games = GeneratedGames({"eval": 6}, split_seed=0, cache_dir=cache_dir)
    # Games other tests already loaded: the engine's memo makes them cheap to load again from the new paths.
    picks = {"train": "alfgen-pick_clean_then_place-eval-00002", "valid_seen": "alfgen-pick_and_place-eval-00000",
             "valid_unseen": EVAL_HEAT}
    ids = {}
    for split_dir, task_id in picks.items():
        source = os.path.dirname(games.game_file(task_id))
        traj = json.load(open(os.path.join(source, "traj_data.json")))
        p = traj["pddl_params"]
        trial = (f"{traj['task_type']}-{p['object_target']}-None-{p['parent_target']}-{traj['scene']['scene_num']}"
                 "/trial_T20190909_000000_000000")
        shutil.copytree(source, os.path.join(root, "json_2.1.1", split_dir, trial))
        ids[split_dir] = f"{split_dir}/{trial}"
    # Decoys the official loader skips: an unsolvable game and a movable-receptacle task.
    unsolvable = os.path.join(root, "json_2.1.1", "train", "pick_and_place_simple-Box-None-Sofa-219", "trial_T1")
    shutil.copytree(os.path.join(root, "json_2.1.1", ids["train"]), unsolvable)
    game = json.load(open(os.path.join(unsolvable, "game.tw-pddl")))
    json.dump({**game, "solvable": False}, open(os.path.join(unsolvable, "game.tw-pddl"), "w"))
    movable = os.path.join(root, "json_2.1.1", "train", "pick_and_place_with_movable_recep-Apple-Bowl-Fridge-1", "t")
    shutil.copytree(os.path.join(root, "json_2.1.1", ids["train"]), movable)
    return ids


def test_official_game_files_load_in_the_same_env(tmp_path, cache_dir, env) -> None:
    ids = _official_tree(tmp_path, cache_dir)
    official = make_env(ENV_ID, game_files_dir=str(tmp_path), max_turns=30)  # the dir holding json_2.1.1
    assert official.unwrapped.task_ids("train") == [ids["train"]]
    assert official.unwrapped.task_ids("eval") == [ids["valid_unseen"]]
    assert official.unwrapped.task_ids("eval_seen") == [ids["valid_seen"]]
    assert OfficialGames(str(tmp_path / "json_2.1.1")).root == str(tmp_path / "json_2.1.1")

    obs, info = official.reset(seed=0, options={"task": ids["valid_unseen"]})
    generated_obs, _ = env.reset(seed=0, options={"task": EVAL_HEAT})
    assert obs == generated_obs and info["task"] == ids["valid_unseen"]
    while True:
        obs, reward, terminated, truncated, info = official.step(info["expert_action"])
        if terminated or truncated:
            break
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    obs, info = official.reset(seed=0)  # no task: a train game
    assert info["task"] == ids["train"] and "Your task is to: " in obs


def test_official_dir_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="json_2.1.1 directory"):
        ALFWorldTextEnv(game_files_dir=str(tmp_path))
    with pytest.raises(ValueError, match="n_train_tasks=5 only applies to generated games"):
        ALFWorldTextEnv(game_files_dir=str(tmp_path), n_train_tasks=5)


# ----- errors -----
@pytest.mark.parametrize("task", ["alfgen-pick_and_place-test-00000", "alfgen-pick_and_place-eval-00006",
                                  "alfgen-look_at_obj_in_light-eval-00000", "nonsense", 3])
def test_bad_task_id_raises_naming_it(task, cache_dir) -> None:
    with pytest.raises(ValueError, match=repr(task)):
        ALFWorldTextEnv(cache_dir=cache_dir, **SMALL).reset(options={"task": task})


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_turns": 0}, "max_turns=0"),
    ({"n_eval_tasks": 0}, "n_eval_tasks=0"),
    ({"invalid_action_penalty": -1}, "invalid_action_penalty=-1"),
    ({"render_mode": "human"}, "render_mode='human'"),
    ({"expert": "oracle"}, "expert='oracle'"),
])
def test_bad_kwarg_raises_naming_it(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        ALFWorldTextEnv(**kwargs)
