"""Matched-state comparison on the real FrozenLake and real (tiny, random) engines."""

from __future__ import annotations

import pytest

from opd.envs import EnvFactory
from opd.evaluation.compare import (Reference, StateMismatch, compare_policies, expert_outcome, references_from_expert,
                                    references_from_trajectories, restore, shares, verdict)
from opd.rollout.vanilla import EpisodeSettings
from opd.trajectory import Turn

FACTORY = EnvFactory("opd/FrozenLakeText-v0", {"map_size": 4, "max_turns": 8, "n_eval_tasks": 6})


def _expert_reference(task: str, mistakes: dict[int, str] | None = None) -> Reference:
    """The expert's episode of ``task`` (with ``mistakes[t]`` played instead at turn t)."""
    env = FACTORY()
    _, info = env.reset(seed=0, options={"task": task})
    turns, observations, done, t = [], [], False, 0
    while not done:
        action = (mistakes or {}).get(t, info["expert_action"])
        obs, _, term, trunc, info = env.step(action)
        turns.append(Turn([], [], [], action_text=action))
        observations.append(obs)
        done, t = term or trunc, t + 1
    return Reference(task, 0, turns, observations)


def test_verdicts_rank_solved_then_fewer_steps_then_rates():
    assert verdict((False, 3), (True, 9)) == "better"
    assert verdict((True, 3), (True, 5)) == "worse"
    assert verdict((False, 2), (False, 7)) == "equal"  # unsolved is unsolved, however long
    assert verdict(0.25, 0.5) == "better" and verdict(0.5, 0.5) == "equal"
    assert shares([{"verdict": "better"}, {"verdict": "equal"}, {"verdict": "equal"}, {"verdict": "worse"}]) == \
        {"better": 0.25, "equal": 0.5, "worse": 0.25, "n": 4}


def test_the_expert_judge_plays_on_from_the_restored_state():
    task = FACTORY().unwrapped.task_ids("eval")[0]
    ref = _expert_reference(task)
    env = FACTORY()
    length = len(ref.responses)
    # The expert's own first move solves it in the reference's length; each state on its path too.
    for t in range(length):
        assert expert_outcome(env, ref, t, ref.responses[t].action_text) == (True, length - t)
    # No other first move does better than the expert's shortest path, and some do worse (a wall
    # costs a step, a hole ends the episode); the verdict sees it.
    detour = [a for a in ("left", "down", "right", "up") if a != ref.responses[0].action_text]
    outcomes = [expert_outcome(env, ref, 0, a) for a in detour]
    assert all(o is not None and (not o[0] or o[1] >= length) for o in outcomes), outcomes
    assert any(verdict((True, length), o) == "worse" for o in outcomes), outcomes


def test_a_state_that_replays_differently_is_refused():
    ref = _expert_reference(FACTORY().unwrapped.task_ids("eval")[1])
    ref.observations[0] = "a different board"
    with pytest.raises(StateMismatch, match="reference recorded 'a different board'"):
        restore(FACTORY(), ref, 2)


def test_compare_counts_every_state_by_stage_and_recovery(tiny_model_dir):
    from opd.runtime.workers import EngineSpec, RolloutWorker

    host = RolloutWorker(EngineSpec(tiny_model_dir, engine="hf", torch_threads=1))
    tasks = FACTORY().unwrapped.task_ids("eval")[:4]
    # References: the expert's episodes, one with a wrong first move (states after it are recovery states).
    refs = [_expert_reference(tasks[0], {0: "up"}), *(_expert_reference(t) for t in tasks[1:])]
    refs = [r for r in refs if len(r.responses) >= 2]
    settings = EpisodeSettings(max_new_tokens=4, temperature=1.0, history="state_grounded", env_isolation="inprocess")
    # A policy against itself: equal in every state, and every state of every reference is there.
    result = compare_policies(host, host, FACTORY, refs, settings, judge="expert")
    assert result["states"] == sum(len(r.responses) for r in refs) == result["overall"]["n"]
    assert result["overall"] == {"better": 0.0, "equal": 1.0, "worse": 0.0, "n": result["states"]}
    records = result["records"]
    assert sum(result["by_stage"][s]["n"] for s in ("early", "middle", "late")) == result["states"]
    for r in records:
        third = 3 * r["turn"] / r["length"]
        assert r["stage"] == ("early" if third < 1 else "middle" if third < 2 else "late")
    # The up-first reference: every state after turn 0 follows a mistake (unless up was the expert's move).
    first = [r for r in records if r["task"] == refs[0].task]
    if refs[0].task == tasks[0] and first[0]["expert_action"] != "up":
        assert not first[0]["after_mistake"] and all(r["after_mistake"] for r in first[1:])
    assert all(not r["after_mistake"] for r in records if r["task"] in {t.task for t in refs[1:]})
    # The expert's episodes make references in the policy's ids: every state on track, the
    # expert solving each one.
    expert_refs = references_from_expert(FACTORY, tasks, 0, host.tokenizer, host.fmt)
    for ref in expert_refs:
        assert ref.responses[-1].action_ids == host.tokenizer.encode(ref.responses[-1].action_text, add_special_tokens=False)
        assert expert_outcome(FACTORY(), ref, 0, ref.responses[0].action_text) == (True, len(ref.responses))
    on_expert = compare_policies(host, host, FACTORY, expert_refs, settings)
    assert on_expert["by_recovery"]["error_recovery"]["n"] == 0 and on_expert["states"] == sum(len(r.responses) for r in expert_refs)
    # The episodes a policy plays itself make references too.
    trajs, _ = host.collect(FACTORY, tasks[:2], settings, 0)
    assert [len(r.responses) for r in references_from_trajectories(trajs, 0)] == [len(t.turns) for t in trajs]


def test_the_rollouts_judge_continues_with_the_reference_policy(tiny_model_dir, tokenizer, tmp_path):
    """Two different (random) policies, judged by the success rate of A's continuations: every
    differing action gets a verdict from rates in [0, 1], and the same seed gives the same rate."""
    from opd.evaluation.compare import State, rollout_outcome
    from opd.models import save_model, tiny_qwen3
    from opd.runtime.workers import EngineSpec, RolloutWorker
    from opd.schema import TinyArchConfig

    other = tmp_path / "other"
    save_model(tiny_qwen3(tokenizer, TinyArchConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128),
                          seed=1), tokenizer, other)
    host_a = RolloutWorker(EngineSpec(tiny_model_dir, engine="hf", torch_threads=1))
    host_b = RolloutWorker(EngineSpec(str(other), engine="hf", torch_threads=1))
    small = EnvFactory("opd/FrozenLakeText-v0", {"map_size": 4, "max_turns": 3, "n_eval_tasks": 2})
    refs = [_expert_reference(t) for t in small().unwrapped.task_ids("eval")]
    for ref in refs:  # the expert's episodes under a 3-turn budget end truncated at turn 3
        ref.responses, ref.observations = ref.responses[:3], ref.observations[:3]
    settings = EpisodeSettings(max_new_tokens=4, temperature=1.0, history="state_grounded", env_isolation="inprocess")
    result = compare_policies(host_a, host_b, small, refs, settings, judge="rollouts", rollouts=2, seed=3)
    assert result["states"] == sum(len(r.responses) for r in refs)
    assert {r["verdict"] for r in result["records"]} <= {"better", "equal", "worse"}
    state = State(0, 1, 3, [], "", False)
    from opd.chat import first_prompt_ids, next_prompt_ids

    env = small()
    obs, _ = env.reset(seed=0, options={"task": refs[0].task})
    context = first_prompt_ids(host_a.fmt, host_a.tokenizer, obs)
    shown, closing = host_a.fmt.shown_and_close_ids(refs[0].responses[0], "state_grounded")
    state.context = context + shown + closing + next_prompt_ids(host_a.fmt, host_a.tokenizer, refs[0].observations[0])
    rates = [rollout_outcome(env, refs[0], state, "down", host_a, settings, 3, seed=5) for _ in range(2)]
    assert rates[0] == rates[1] and 0.0 <= rates[0] <= 1.0
