"""Tests of the environment contract (opd.envs): check_env catches what breaks it, and the
registry and factory helpers. FrozenLake's own tests: tests/envs/test_frozenlake.py."""

from __future__ import annotations

import pickle

import gymnasium
import pytest

from environments.frozenlake import INSTRUCTION
from opd.envs import EnvFactory, check_env, list_envs, make_env, task_ids

ENV_ID = "opd/FrozenLakeText-v0"
SMALL = {"n_train_tasks": 50, "n_eval_tasks": 10}


class _BrokenEnv(gymnasium.Env):
    """A tiny env that violates the contract in a configurable way."""

    def __init__(self, raise_on_bad_action: bool = False, drop_success: bool = False, unseeded: bool = False) -> None:
        self.observation_space = gymnasium.spaces.Text(max_length=64)
        self.action_space = gymnasium.spaces.Text(max_length=64)
        self.raise_on_bad_action = raise_on_bad_action
        self.drop_success = drop_success
        self.unseeded = unseeded

    def task_ids(self, split: str) -> list[str]:
        if split not in ("train", "eval"):
            raise ValueError(split)
        return [f"{split}-0"]

    def _info(self, valid: bool) -> dict:
        info = {"success": False, "valid_action": valid, "admissible_actions": ["go"]}
        if self.drop_success:
            del info["success"]
        return info

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "start", {"success": False, "valid_action": True, "admissible_actions": ["go"]}

    def step(self, action):
        if action != "go" and self.raise_on_bad_action:
            raise KeyError(action)
        # Each copy made by check_env gets a distinct id(): a stand-in for an unseeded RNG.
        obs = f"moved {id(self)}" if self.unseeded else "moved"
        return obs, 0.0, False, False, self._info(action == "go")


def test_check_env_fails_when_bad_action_raises() -> None:
    with pytest.raises(AssertionError, match="must yield an observation, not an exception"):
        check_env(_BrokenEnv(raise_on_bad_action=True))


def test_check_env_fails_when_info_lacks_success() -> None:
    with pytest.raises(AssertionError, match="info lacks 'success'"):
        check_env(_BrokenEnv(drop_success=True))


def test_check_env_fails_when_not_deterministic() -> None:
    with pytest.raises(AssertionError, match="diverged at step 0"):
        check_env(_BrokenEnv(unseeded=True))


def test_check_env_passes_on_fixed_tiny_env() -> None:
    check_env(_BrokenEnv())  # the same env without its defects satisfies the contract


# ----- registry helpers -----
def test_make_env_unknown_id_lists_registered() -> None:
    with pytest.raises(ValueError, match="unknown environment 'opd/Nope-v0'.*opd/FrozenLakeText-v0"):
        make_env("opd/Nope-v0")
    # A typo gets the id it is closest to (issue 54, item 9); a name like none of them, no guess.
    with pytest.raises(ValueError, match="unknown environment 'opd/FrozenLakeTxt-v0'; did you mean "
                                         "'opd/FrozenLakeText-v0'\\? registered: "):
        make_env("opd/FrozenLakeTxt-v0")
    with pytest.raises(ValueError, match="did you mean 'opd/ALFWorldText-v0'"):
        make_env("opd/alfworldtext-v0")
    with pytest.raises(ValueError) as caught:
        make_env("opd/Nope-v0")
    assert "did you mean" not in str(caught.value)


def test_list_envs_includes_frozenlake_with_description() -> None:
    descriptions = dict(list_envs())
    assert descriptions[ENV_ID].startswith("FrozenLake as text")


def test_env_factory_pickle_round_trip() -> None:
    factory = EnvFactory(ENV_ID, {"max_turns": 5, **SMALL})
    clone = pickle.loads(pickle.dumps(factory))
    assert clone == factory
    env = clone()
    obs, info = env.reset(seed=3)
    assert obs.startswith(INSTRUCTION)
    assert env.unwrapped.max_turns == 5
    assert info["task"] in task_ids(env, "train")
