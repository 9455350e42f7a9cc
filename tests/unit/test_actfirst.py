"""ActFirst's episode loop, its prompts, transition checks, metrics, training rows and the
bootstrap targets it relies on.

Everything is real: FrozenLake's gymnasium engine, a trained BPE tokenizer and a tiny Qwen3 in
the HF engine. The only test-specific pieces are two FrozenLake subclasses that define
``transition_matches`` (registered here under test ids) and an HF engine subclass that also
keeps the prompts it was given.
"""

from __future__ import annotations

import gymnasium
import pytest
import torch

from environments.frozenlake import FrozenLakeTextEnv
from opd.chat import render_context
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.models import load_model
from opd.chat import ACTION_ONLY_INSTRUCTION, REFERENCE_HEADER, action_only_prompt_ids
from opd.rollout.actfirst import (ActFirstSettings, ActFirstStats, TransitionCheck, exact_match, run_actfirst_episodes,
                                  s_ideal)
from opd.rollout.references import Reference, expert_reference
from opd.rollout.vanilla import EpisodeSettings

KWARGS = {"n_train_tasks": 40, "n_eval_tasks": 10, "max_turns": 5}
FULL_BUDGET, FAST_BUDGET = 12, 3


class AnyTransitionLake(FrozenLakeTextEnv):
    """FrozenLake whose transition check accepts every observation except a reference reading
    ``DEVIATE``: a test can place the first failed check at the turn it wants."""

    @staticmethod
    def transition_matches(observation: str, reference: str) -> bool:
        return reference != "DEVIATE"


for _id, _cls in (("opd-test/AnyTransitionLake-v0", AnyTransitionLake),):
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=_cls)


class RecordingEngine(HFEngine):
    """The real HF engine, also keeping every (prompt, max_new_tokens) added to its streams."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], int]] = []

    def stream(self, seed=0):
        stream = super().stream(seed)
        add = stream.add

        def recording_add(key, prompt_ids, params):
            self.calls.append((list(prompt_ids), params.max_new_tokens))
            add(key, prompt_ids, params)

        stream.add = recording_add
        return stream

    def generate(self, prompts, params):
        self.calls += [(list(p), params.max_new_tokens) for p in prompts]
        return super().generate(prompts, params)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, fmt):
    return RecordingEngine(load_model(tiny_model_dir), pad_id=fmt.pad_id)


def _settings(**kwargs) -> ActFirstSettings:
    return ActFirstSettings(episode=EpisodeSettings(max_new_tokens=FULL_BUDGET, temperature=1.0),
                            action_max_new_tokens=FAST_BUDGET, **kwargs)


def _tasks(n: int = 4) -> list[str]:
    return FrozenLakeTextEnv(**KWARGS).task_ids("train")[:n]


def test_action_only_prompt_shows_the_reference_then_the_instruction(tokenizer, fmt):
    obs, ref = "A F\nH G\nAround you: left wall.", "S A\nH G"
    with_ref = tokenizer.decode(action_only_prompt_ids(fmt, tokenizer, obs, ref))
    assert with_ref == (f"<|im_start|>user\n{obs}\n{REFERENCE_HEADER}\n{ref}\n{ACTION_ONLY_INSTRUCTION}<|im_end|>\n"
                        "<|im_start|>assistant\n")
    autonomous = tokenizer.decode(action_only_prompt_ids(fmt, tokenizer, obs, None))
    assert autonomous == f"<|im_start|>user\n{obs}\n{ACTION_ONLY_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    # The observation's ids are those of the standard prompt (encoded on their own).
    observation_ids = tokenizer.encode(obs, add_special_tokens=False)
    prompt = action_only_prompt_ids(fmt, tokenizer, obs, ref)
    header = 1 + len(fmt.role_ids["user"])
    assert prompt[header : header + len(observation_ids)] == observation_ids


def test_exact_match_normalises_case_and_whitespace():
    assert exact_match("S  A\nH G\n", "s a h g")
    assert not exact_match("S A\nH G", "S F\nH G")


def test_comparator_is_looked_up_from_the_registered_entry_point():
    assert TransitionCheck("env", "opd-test/AnyTransitionLake-v0").resolve() is AnyTransitionLake.transition_matches
    assert TransitionCheck("exact", "opd/FrozenLakeText-v0").resolve() is exact_match
    with pytest.raises(ValueError, match="actfirst.transition_check.*FrozenLakeTextEnv.*transition_matches"):
        TransitionCheck("env", "opd/FrozenLakeText-v0").resolve()  # a string entry point, imported


def test_first_failed_check_switches_the_episode_to_autonomous_prompts(engine, tokenizer, fmt):
    tasks = _tasks(3)
    # Checks pass at turns 0-1 and fail at turn 2 (task 0); fail at once (task 1); task 2 has none.
    refs = {tasks[0]: Reference(tasks[0], ("a",) * 5, ("x", "x", "DEVIATE", "x", "x")),
            tasks[1]: Reference(tasks[1], ("a",) * 5, ("DEVIATE", "x", "x", "x", "x"))}
    engine.calls.clear()
    factory = EnvFactory("opd-test/AnyTransitionLake-v0", KWARGS)
    trajs, stats = run_actfirst_episodes(engine, factory, tasks, refs, tokenizer, fmt,
                                         _settings(check=TransitionCheck("env", "opd-test/AnyTransitionLake-v0")), seed=0)
    n0, n1, n2 = (len(t.turns) for t in trajs)
    assert n0 >= 4, "tiny random students rarely end a 5-turn lake early; pick other tasks if this trips"
    assert stats.modes[0] == ["reference"] * 3 + ["autonomous"] * (n0 - 3)
    assert stats.matches[0][:3] == [True, True, False] and stats.first_deviation[0] == 2
    assert stats.modes[1] == ["reference"] + ["autonomous"] * (n1 - 1) and stats.first_deviation[1] == 0
    assert stats.modes[2] == ["autonomous"] * n2 and stats.has_reference == [True, True, False]
    assert [t.info["actfirst_mode"] for t in trajs[0].turns] == stats.modes[0]
    # The fast prompts carry o_ref(t+1) exactly on the reference turns.
    fast = [tokenizer.decode(p) for p, budget in engine.calls if budget == FAST_BUDGET]
    assert sum(REFERENCE_HEADER in text for text in fast) == 3 + 1
    assert sum("DEVIATE" in text for text in fast) == 2
    metrics = stats.metrics()
    assert metrics["actfirst/alignment_rate_turn_0"] == 0.5 and metrics["actfirst/alignment_rate_turn_1"] == 0.5
    assert metrics["actfirst/alignment_rate_turn_2"] == 0.0
    assert metrics["actfirst/first_deviation_turn"] == 1.0 and metrics["actfirst/deviated_share"] == 1.0


def test_exact_check_against_expert_references(engine, tokenizer, fmt):
    tasks = _tasks(4)
    env = FrozenLakeTextEnv(**KWARGS)
    refs = {task: expert_reference(env, task, 0) for task in tasks}
    trajs, stats = run_actfirst_episodes(engine, EnvFactory("opd/FrozenLakeText-v0", KWARGS), tasks, refs, tokenizer,
                                         fmt, _settings(), seed=1)
    for i, traj in enumerate(trajs):
        d = stats.first_deviation[i]
        for t, turn in enumerate(traj.turns):
            if stats.modes[i][t] == "reference":
                assert stats.matches[i][t] == exact_match(turn.observation, refs[traj.task].observations[t])
        if d is not None:
            assert stats.modes[i][d + 1 :] == ["autonomous"] * (len(traj.turns) - d - 1)
            assert stats.modes[i][: d + 1] == ["reference"] * (d + 1)


def test_full_requests_are_queued_while_the_episode_lives_in_its_state_grounded_context(engine, tokenizer, fmt):
    tasks = _tasks(4)
    engine.calls.clear()
    trajs, stats = run_actfirst_episodes(engine, EnvFactory("opd/FrozenLakeText-v0", KWARGS), tasks, {}, tokenizer,
                                         fmt, _settings(), seed=2)
    full_prompts = [p for p, budget in engine.calls if budget == FULL_BUDGET]
    assert len(full_prompts) == sum(len(t.turns) for t in trajs) == stats.metrics()["actfirst/full_requests"]
    for i, traj in enumerate(trajs):
        assert len(stats.full_queued_at[i]) == len(traj.turns)
        assert all(queued <= stats.ended_at[i] for queued in stats.full_queued_at[i])
        assert all(q < f for q, f in zip(stats.full_queued_at[i], stats.full_finished_at[i]))
        for t, turn in enumerate(traj.turns):
            context = render_context(traj, t, "state_grounded", fmt)
            assert context in full_prompts  # sampled from exactly the context the teacher will see
            assert tokenizer.decode(context).count(ACTION_ONLY_INSTRUCTION) == 0
            assert turn.action_ids == turn.executed_action_ids
            assert turn.action_text == tokenizer.decode(turn.executed_action_ids, skip_special_tokens=True)
            assert len(turn.response_ids) == len(turn.response_logprobs) > 0
    # Full requests overlapped with later turns: some finished before the last env step, and
    # the stream's steps carried more rows than the fast turns alone.
    assert min(min(f) for f in stats.full_finished_at) < stats.critical_path_end
    assert stats.metrics()["actfirst/stream_rows_mean"] > len(tasks)
    assert stats.metrics()["actfirst/late_full_requests"] == 0.0


def test_full_responses_decode_while_the_environments_step(engine, tokenizer, fmt):
    """With the environments in child processes, the stream advances the full responses while
    a turn's steps compute (the issue's overlap with later environment steps); switched off, it
    waits. Both play every turn with a full response; only the overlap differs."""
    import tests.data.faulty_env  # noqa: F401  (registers opdtest/FaultyFrozenLake-v0)
    from opd.rollout.env_pool import EnvWorkerPool

    factory = EnvFactory("opdtest/FaultyFrozenLake-v0", {**KWARGS, "fault": "slow", "step_delay_s": 0.2},
                         "tests.data.faulty_env")
    tasks = _tasks(3)
    results = {}
    with EnvWorkerPool(factory, timeout_s=30.0, preload=("environments", "tests.data.faulty_env")) as pool:
        for overlap in (True, False):
            results[overlap] = run_actfirst_episodes(engine, factory, tasks, {}, tokenizer, fmt,
                                                     _settings(decode_during_env_steps=overlap), seed=4, envs=pool)
    for overlap, (trajs, stats) in results.items():
        assert all(len(t.response_ids) > 0 for traj in trajs for t in traj.turns)
        assert stats.metrics()["actfirst/full_requests"] == sum(len(traj.turns) for traj in trajs)
        assert stats.env_overlap_steps <= stats.stream_steps
    assert results[True][1].env_overlap_steps > 0 and results[False][1].env_overlap_steps == 0


def test_without_inverse_dynamics_no_prompt_shows_a_reference(engine, tokenizer, fmt):
    tasks = _tasks(3)
    env = FrozenLakeTextEnv(**KWARGS)
    refs = {task: expert_reference(env, task, 0) for task in tasks}
    engine.calls.clear()
    trajs, stats = run_actfirst_episodes(engine, EnvFactory("opd/FrozenLakeText-v0", KWARGS), tasks, refs, tokenizer,
                                         fmt, _settings(inverse_dynamics=False), seed=3)
    assert all(REFERENCE_HEADER not in tokenizer.decode(p) for p, _ in engine.calls)
    assert all(m == "autonomous" for episode in stats.modes for m in episode)
    metrics = stats.metrics()
    assert metrics["actfirst/reference_prompt_share"] == 0.0 and "actfirst/alignment_rate" not in metrics


def test_s_ideal_and_latency_metrics():
    assert s_ideal(10, 1.0, 10.0) == pytest.approx(100 / 19)
    assert s_ideal(1, 1.0, 10.0) == pytest.approx(1.0)
    stats = ActFirstStats(modes=[["reference", "reference", "autonomous"], ["reference"]], matches=[[True, False, None], [True]],
                          first_deviation=[1, None], has_reference=[True, True], ended_at=[5.0, 5.0],
                          full_queued_at=[[1.0, 2.0, 3.0], [1.0]], full_finished_at=[[3.0, 4.0, 5.0], [3.0]],
                          fast_latencies_s=[0.1, 0.3], full_latencies_s=[2.0], stream_steps=10, stream_row_steps=45, env_overlap_steps=3,
                          fast_tokens=8, full_tokens=40, critical_path_s=1.0, critical_path_end=4.0, drain_s=0.5,
                          generation_s=1.5)
    m = stats.metrics()
    assert m["actfirst/alignment_rate_turn_0"] == 1.0 and m["actfirst/alignment_rate_turn_1"] == 0.0
    assert m["actfirst/alignment_rate"] == pytest.approx(2 / 4)
    assert m["actfirst/first_deviation_turn"] == 1.0 and m["actfirst/deviated_share"] == 0.5
    assert m["latency/fast_s"] == pytest.approx(0.2) and m["latency/full_s"] == 2.0 and m["actfirst/turns"] == 2.0
    assert m["actfirst/s_ideal"] == pytest.approx(2 * 2.0 / (0.2 + 2.0))
    assert m["actfirst/stream_rows_mean"] == 4.5 and m["actfirst/env_overlap_steps"] == 3.0


def test_one_packed_row_per_episode_trains_each_full_response_as_its_own_row_would(engine, tokenizer, fmt,
                                                                                  tiny_model_dir):
    from opd.algorithms.actfirst_opd import build_episode_batch
    from opd.supervision.teacher_view import score_trajectories
    from opd.training.trainer import student_logprobs
    from opd.trajectory import TokenBatch

    trajs, _ = run_actfirst_episodes(engine, EnvFactory("opd/FrozenLakeText-v0", KWARGS), _tasks(3), {}, tokenizer,
                                     fmt, _settings(), seed=4)
    assert max(len(t.turns) for t in trajs) >= 2
    teacher = HFEngine(load_model(tiny_model_dir), pad_id=fmt.pad_id)
    scores = score_trajectories(teacher, trajs, "state_grounded", fmt, mode="topk", top_k=4)
    batch = build_episode_batch(trajs, scores, fmt.pad_id, fmt)
    assert len(batch) == len(trajs)
    # The reference: one plain row per turn, c_t then y_t.
    rows = []
    for traj in trajs:
        for t, turn in enumerate(traj.turns):
            context = render_context(traj, t, "state_grounded", fmt)
            n = len(context) + len(turn.response_ids)
            rows.append({"input_ids": context + turn.response_ids, "attention_mask": [1] * n,
                         "loss_mask": [0.0] * len(context) + [1.0] * len(turn.response_ids)})
    plain = TokenBatch.from_rows(rows, fmt.pad_id)
    student = load_model(tiny_model_dir)
    with torch.no_grad():
        packed_lp = student_logprobs(student, batch)[0][batch.loss_mask_BT > 0]
        plain_lp = student_logprobs(student, plain)[0][plain.loss_mask_BT > 0]
    # Same tokens trained, in the same order (episode by episode, turn by turn), same logprobs.
    assert batch.input_ids_BT[batch.loss_mask_BT > 0].tolist() == plain.input_ids_BT[plain.loss_mask_BT > 0].tolist()
    torch.testing.assert_close(packed_lp, plain_lp, atol=1e-5, rtol=0)
    # Behaviour logprobs, the teacher's scores and the turn index sit on the same tokens.
    assert batch.behaviour_logprobs_BT[batch.loss_mask_BT > 0].tolist() == pytest.approx(
        [lp for traj in trajs for turn in traj.turns for lp in turn.response_logprobs])
    assert batch.teacher_logprobs_BT[batch.loss_mask_BT > 0].tolist() == pytest.approx(
        [lp for score in scores for lp in score.logprobs])
    assert torch.equal(batch.teacher_topk_ids_BTK[batch.loss_mask_BT > 0], torch.cat([s.topk_ids for s in scores]))
    assert batch.turn_index_BT[batch.loss_mask_BT > 0].tolist() == [t for traj in trajs for t, turn in enumerate(traj.turns)
                                                                    for _ in turn.response_ids]
    # The packed rows are shorter than the turn rows they replace.
    assert int(batch.attention_mask_BT.sum()) < int(plain.attention_mask_BT.sum())


def test_evaluation_of_actfirst_shows_past_turns_as_actions_only(engine, tokenizer, fmt):
    """ActFirst's full responses are trained after contexts of actions and observations, so it
    is evaluated (think-then-act, greedy) in that format: ``run.eval_history`` resolves to
    ``state_grounded`` for actfirst_opd, ``full`` otherwise."""
    from pathlib import Path

    from opd.config import ConfigError, load_config
    from opd.rollout.vanilla import run_episodes

    recipe = Path(__file__).resolve().parents[1] / "data" / "actfirst_tiny.yaml"
    assert load_config(recipe, []).run.eval_history == "state_grounded"
    assert load_config(recipe, ["algorithm=vanilla_opd"]).run.eval_history == "full"
    assert load_config(recipe, ["run.eval_history=full"]).run.eval_history == "full"
    with pytest.raises(ConfigError, match="run.eval_history"):
        load_config(recipe, ["run.eval_history=thoughts"])
    engine.calls.clear()
    settings = EpisodeSettings(max_new_tokens=FULL_BUDGET, temperature=0.0, history="state_grounded")
    trajs = run_episodes(engine, EnvFactory("opd/FrozenLakeText-v0", KWARGS), _tasks(3), tokenizer, fmt, settings, seed=0)
    contexts = [render_context(traj, t, "state_grounded", fmt) for traj in trajs for t in range(len(traj.turns))]
    assert sorted(p for p, _ in engine.calls) == sorted(contexts)
    assert max(len(traj.turns) for traj in trajs) > 1  # later turns were prompted with a history


# ----- bootstrap targets ----------------------------------------------------------------------
def test_plan_targets_are_long_and_keep_the_action_parseable(tokenizer, fmt):
    from opd.bootstrap.rows import actfirst_rows, scripted_episode, scripted_policy, sft_row
    import random

    env = FrozenLakeTextEnv(**KWARGS)
    steps = scripted_episode(env, env.task_ids("train")[0], scripted_policy("expert", random.Random(0)), seed=0)
    row = sft_row(steps, "t", tokenizer, fmt, think="plan")
    for (start, end), (obs, action, _) in zip(row["response_positions"], steps):
        response = row["input_ids"][start:end]
        a_start, a_end = fmt.action_span(response)
        assert tokenizer.decode(response[a_start:a_end]) == action
        assert len(response) >= 8 * (a_end - a_start + 1)  # the think budget the benchmark relies on
        assert tokenizer.decode(response).startswith("<think> State: ")
    plain = sft_row(steps, "t", tokenizer, fmt)
    assert all(end - start == len(tokenizer.encode(a)) + 1 for (start, end), (_, a, _) in zip(plain["response_positions"], steps))
    rows = actfirst_rows(steps, tokenizer, fmt, 1.0, "", random.Random(0))
    assert len(rows) == len(steps) - 1
    for k, row in enumerate(rows):
        text = tokenizer.decode(row["input_ids"])
        assert text.endswith(f"{ACTION_ONLY_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n{steps[k][1]}<|im_end|>")
        target = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert tokenizer.decode(target) == f"{steps[k][1]}<|im_end|>"
        assert "<think>" not in text  # every context is state-grounded: actions and observations only
    assert {REFERENCE_HEADER in tokenizer.decode(r["input_ids"]) for r in rows} == {True, False}
    # With a think format, some turns are the standard prompt answered with the full response.
    planned = [r for seed in range(4) for r in actfirst_rows(steps, tokenizer, fmt, 1.0, "plan", random.Random(seed))]
    full = [r for r in planned if ACTION_ONLY_INSTRUCTION not in tokenizer.decode(r["input_ids"])]
    assert full and all(tokenizer.decode([i for i, m in zip(r["input_ids"], r["loss_mask"]) if m]).startswith("<think>")
                        for r in full)
    assert all(tokenizer.decode(r["input_ids"]).count("<think>") == 1 for r in full)


def test_state_grounded_sft_rows_train_each_response_in_its_state_grounded_context(tokenizer, fmt, tiny_model_dir):
    """``bootstrap.history: state_grounded``: one packed row per episode whose logprobs on every
    response equal those of that response after its own state-grounded context (past turns as
    actions only), built here by hand; exploratory turns get no loss."""
    import random

    from opd.chat import first_prompt_ids, next_prompt_ids
    from opd.bootstrap.rows import response_ids, scripted_episode, scripted_policy, sft_row
    from opd.training.trainer import token_logprobs
    from opd.trajectory import TokenBatch

    env = FrozenLakeTextEnv(**{**KWARGS, "max_turns": 8})
    steps = next(s for seed in range(50) for s in [scripted_episode(env, env.task_ids("train")[seed], scripted_policy(
        "expert", random.Random(seed)), seed=seed, explore_prob=0.4)] if len(s) > 4 and not all(t for *_, t in s[:-1]))
    row = sft_row(steps, "t", tokenizer, fmt, think="plan", history="state_grounded")
    plain = TokenBatch.from_rows([{k: v for k, v in row.items() if k not in ("position_ids", "branch_ids")}], fmt.pad_id)
    packed = TokenBatch.from_rows([row], fmt.pad_id)
    assert plain.branch_ids_BT is None and packed.branch_ids_BT is not None
    trunk = [i for i, b in zip(row["input_ids"], row["branch_ids"]) if b == 0]
    assert tokenizer.decode(trunk).count("<think>") == 0  # past turns show their action only
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        got = token_logprobs(model, packed)[0]
    history: list[int] = []
    for k, (obs, action, train_on) in enumerate(steps[:-1]):
        prompt = history + (first_prompt_ids(fmt, tokenizer, obs) if k == 0 else next_prompt_ids(fmt, tokenizer, obs))
        response = response_ids(obs, action, tokenizer, fmt, "plan")[0]
        with torch.no_grad():
            want = token_logprobs(model, TokenBatch.from_rows([{"input_ids": prompt + response,
                                                                "attention_mask": [1] * (len(prompt) + len(response))}],
                                                              fmt.pad_id))[0, len(prompt):]
        index = [i for i, t in enumerate(row["turn_index"]) if t == k]
        assert [row["input_ids"][i] for i in index] == response
        torch.testing.assert_close(got[index], want, atol=1e-5, rtol=1e-5)
        assert {row["loss_mask"][i] for i in index} == {1.0 if train_on else 0.0}
        history = prompt + tokenizer.encode(action, add_special_tokens=False) + [fmt.im_end_id, *fmt.newline_ids]
    assert sum(row["loss_mask"]) == sum(len(response_ids(o, a, tokenizer, fmt, "plan")[0]) for o, a, t in steps[:-1] if t)


def test_lockstep_decode_metrics_count_each_turns_longest_response_over_its_live_rows():
    """Vanilla's decode steps, which the bench sets against ActFirst's stream steps: turn 0 runs
    4 steps (responses of 3 and 4 tokens), turn 1 runs 5 over the one episode still going."""
    from opd.algorithms.vanilla_opd import lockstep_decode_metrics
    from opd.trajectory import Trajectory, Turn

    def turn(n: int) -> Turn:
        return Turn(prompt_ids=[1], response_ids=list(range(n)), response_logprobs=[0.0] * n)

    metrics = lockstep_decode_metrics([Trajectory("a", [turn(3), turn(5)]), Trajectory("b", [turn(4)])])
    assert metrics == {"rollout/decode_steps": 9.0, "rollout/decode_rows_mean": 12 / 9}
    assert lockstep_decode_metrics([]) == {"rollout/decode_steps": 0.0, "rollout/decode_rows_mean": 0.0}
