"""Rendering: the state-grounded teacher view and the student's own view, in token ids."""

from __future__ import annotations

import random

import pytest

from opd.chat import render_context, student_sequence
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.rollout.vanilla import EpisodeSettings, run_episodes
from opd.trajectory import Trajectory, Turn

REASONING = "<think> I should weigh the holes first </think>"


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def ten_turn_trajectory(tokenizer, fmt) -> Trajectory:
    """A real 10-turn FrozenLake episode whose every response carries reasoning before the move."""
    from opd.chat import first_prompt_ids, next_prompt_ids

    env = EnvFactory("opd/FrozenLakeText-v0", {"max_turns": 10, "n_train_tasks": 4, "n_eval_tasks": 2})()
    obs, info = env.reset(seed=0, options={"task": "fl4-train-00000"})
    traj = Trajectory(task="fl4-train-00000")
    prompt = first_prompt_ids(fmt, tokenizer, obs)
    rng = random.Random(0)
    for t in range(10):
        move = ["left", "up"][t % 2] if t < 9 else rng.choice(["left", "up"])  # bump walls: never ends early
        response = tokenizer.encode(f"{REASONING} {move}", add_special_tokens=False) + [fmt.im_end_id]
        start, end = fmt.action_span(response)
        obs, reward, terminated, truncated, info = env.step(tokenizer.decode(response[start:end]))
        traj.turns.append(Turn(prompt_ids=prompt, response_ids=response, response_logprobs=[-1.0] * len(response),
                               action_start=start, action_end=end, action_text=move, observation=obs,
                               reward=reward, terminated=terminated, truncated=truncated, info=dict(valid=info["valid_action"])))
        if t < 9:
            assert not (terminated or truncated)
        prompt = next_prompt_ids(fmt, tokenizer, obs)
    assert traj.turns[-1].truncated, "the 10-turn budget ends the episode at turn 10"
    return traj


def test_state_grounded_view_holds_actions_and_observations_not_reasoning(tokenizer, fmt):
    traj = ten_turn_trajectory(tokenizer, fmt)
    reasoning_ids = tokenizer.encode(REASONING, add_special_tokens=False)
    think_id = tokenizer.convert_tokens_to_ids("<think>")
    last = len(traj.turns) - 1
    context = render_context(traj, last, "state_grounded", fmt)
    # Every executed action and every observation (as its message ids) is in the view, in order.
    cursor = 0
    for k, turn in enumerate(traj.turns[:last]):
        for segment in (turn.prompt_ids, turn.action_ids + [fmt.im_end_id]):
            found = next(i for i in range(cursor, len(context)) if context[i : i + len(segment)] == segment)
            cursor = found + len(segment)
    assert context[-len(traj.turns[last].prompt_ids):] == traj.turns[last].prompt_ids
    # No reasoning token reaches the teacher.
    assert think_id not in context
    assert not _contains(context, reasoning_ids)
    assert "weigh the holes" not in tokenizer.decode(context)
    # It is exactly prompts + actions + closings: nothing else.
    expected = []
    for turn in traj.turns[:last]:
        expected += turn.prompt_ids + turn.action_ids + [fmt.im_end_id, *fmt.newline_ids]
    assert context == expected + traj.turns[last].prompt_ids
    # The full view keeps the reasoning.
    assert _contains(render_context(traj, last, "full", fmt), reasoning_ids)


def test_student_sequence_masks_only_response_tokens(tokenizer, fmt):
    traj = ten_turn_trajectory(tokenizer, fmt)
    row = student_sequence(traj, fmt)
    assert sum(row["loss_mask"]) == traj.num_response_tokens
    for (start, end), turn in zip(row["response_positions"], traj.turns):
        assert row["input_ids"][start:end] == turn.response_ids
        assert row["loss_mask"][start:end] == [1.0] * len(turn.response_ids)
        assert row["behaviour_logprobs"][start:end] == turn.response_logprobs
    assert row["input_ids"][: row["response_positions"][-1][0]] == render_context(traj, 9, "full", fmt)


class RecordingEngine:
    """The real HF engine, recording every prompt it is given (to check for token drift)."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def generate(self, prompts, params):
        self.prompts.append([list(p) for p in prompts])
        return self.engine.generate(prompts, params)


def test_no_token_drift_in_a_real_rollout(tokenizer, fmt, tiny_model_dir):
    engine = RecordingEngine(HFEngine.from_pretrained(tiny_model_dir))
    factory = EnvFactory("opd/FrozenLakeText-v0", {"max_turns": 10, "n_train_tasks": 8, "n_eval_tasks": 2})
    tasks = factory().unwrapped.task_ids("train")[:4]
    trajs = run_episodes(engine, factory, tasks, tokenizer, fmt, EpisodeSettings(max_new_tokens=6), seed=3)
    assert max(len(t.turns) for t in trajs) == 10, "a random tiny model mostly emits invalid moves: 10 turns"
    for t, batch in enumerate(engine.prompts):
        live = [traj for traj in trajs if len(traj.turns) > t]
        assert len(batch) == len(live)
        for prompt, traj in zip(batch, live):
            # What the model was conditioned on is exactly the rendered student context...
            assert prompt == render_context(traj, t, "full", fmt)
            # ...in which each earlier response appears exactly as sampled.
            row = student_sequence(traj, fmt)
            for k in range(t):
                start, end = row["response_positions"][k]
                assert prompt[start:end] == traj.turns[k].response_ids


def test_unknown_view_is_refused(tokenizer, fmt):
    traj = ten_turn_trajectory(tokenizer, fmt)
    with pytest.raises(ValueError, match="unknown view 'thoughts'"):
        render_context(traj, 1, "thoughts", fmt)
