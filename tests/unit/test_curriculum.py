"""Turn-depth curricula (opd.curriculum, TCOD): the depth a schedule gives at chosen steps, a
forward curriculum's episodes played on real FrozenLake stopping at the depth, and no loss on a
turn outside the window, checked token by token on the batches every algorithm builds."""

from __future__ import annotations

import pytest
import torch

from opd.algorithms.step import build_token_batch
from opd.chat import student_sequence
from opd.config import load_config
from opd.curriculum import Curriculum, depth_at, mark_trained_turns
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.rollout.vanilla import EpisodeSettings, run_episodes
from opd.schema import ConfigError, CurriculumConfig
from opd.supervision.teacher_view import packed_row

FROZENLAKE = EnvFactory("opd/FrozenLakeText-v0", {"max_turns": 10, "n_train_tasks": 8, "n_eval_tasks": 2})


def test_a_schedules_depth_at_chosen_steps():
    linear = CurriculumConfig(depth="backward", start_depth=1, full_depth_step=11, horizon=21)
    assert [depth_at(linear, s, 21) for s in (1, 2, 6, 10, 11, 50)] == [1, 3, 11, 19, 21, 21]
    step = CurriculumConfig(depth="forward", start_depth=2, full_depth_step=9, horizon=10, schedule="step", stages=4)
    # four equal jumps of 2 turns, each held for two steps, then the whole horizon from step 9
    assert [depth_at(step, s, 10) for s in range(1, 11)] == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert depth_at(CurriculumConfig(depth="off"), 1, 10) == 10
    assert depth_at(CurriculumConfig(depth="forward", start_depth=30, full_depth_step=5), 1, 10) == 10


def test_the_recipe_names_what_a_curriculum_lacks(tmp_path):
    recipe = "recipes/quickstart.yaml"
    with pytest.raises(ConfigError, match=r"curriculum.full_depth_step' is 0: with 'curriculum.depth: forward'"):
        load_config(recipe, ["curriculum.depth=forward"])
    with pytest.raises(ConfigError, match=r"curriculum.start_depth' is 9, beyond the horizon of 8 turns"):
        load_config(recipe, ["curriculum.depth=backward", "curriculum.full_depth_step=5", "curriculum.start_depth=9"])
    cfg = load_config(recipe, ["curriculum.depth=forward", "curriculum.full_depth_step=5"])
    curriculum = Curriculum(cfg)
    assert curriculum.horizon == 8  # FrozenLake's own max_turns, read from the environment
    assert [curriculum.settings(EpisodeSettings(), s).max_turns for s in (1, 3, 5)] == [1, 5, 0]


def _episodes(tokenizer, fmt, tiny_model_dir, max_turns=0):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    tasks = FROZENLAKE().unwrapped.task_ids("train")[:6]
    return run_episodes(engine, FROZENLAKE, tasks, tokenizer, fmt,
                        EpisodeSettings(max_new_tokens=6, env_isolation="inprocess", max_turns=max_turns), seed=3)


def test_a_forward_curriculum_plays_the_first_turns_only(tokenizer, fmt, tiny_model_dir):
    whole = _episodes(tokenizer, fmt, tiny_model_dir)
    cut = _episodes(tokenizer, fmt, tiny_model_dir, max_turns=2)
    assert max(len(t.turns) for t in whole) > 2, "the random student should wander past two turns"
    for w, c in zip(whole, cut):
        assert len(c.turns) == min(len(w.turns), 2)
        # the same seed plays the same first turns; an episode cut short says why
        assert [t.response_ids for t in c.turns] == [t.response_ids for t in w.turns[:2]]
        assert c.end_reason == (w.end_reason if len(w.turns) <= 2 else "depth_limit")


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_no_loss_on_a_turn_outside_the_window(tokenizer, fmt, tiny_model_dir, mode):
    trajs = [t for t in _episodes(tokenizer, fmt, tiny_model_dir) if len(t.turns) >= 3]
    assert trajs, "need episodes of three turns or more"
    mark_trained_turns(trajs, 2, mode)
    for traj in trajs:
        n = len(traj.turns)
        assert [turn.trained for turn in traj.turns] == [(t < 2) if mode == "forward" else (t >= n - 2) for t in range(n)]
    batch = build_token_batch(trajs, None, fmt.pad_id, fmt)  # vanilla OPD's and GRPO's rows
    for b, traj in enumerate(trajs):
        row = student_sequence(traj, fmt)
        for t, (start, end) in enumerate(row["response_positions"]):
            expected = 1.0 if traj.turns[t].trained else 0.0
            assert batch.loss_mask_BT[b, start:end].tolist() == [expected] * (end - start)
        assert batch.loss_mask_BT[b].sum() == sum(len(turn.response_ids) for turn in traj.turns if turn.trained)
        # ActFirst's packed rows: the same turns carry loss
        packed, index = packed_row(traj, fmt)
        turn_of = [t for t, turn in enumerate(traj.turns) for _ in turn.response_ids]
        assert [packed["loss_mask"][i] for i in index] == [float(traj.turns[t].trained) for t in turn_of]
        assert sum(packed["loss_mask"]) == batch.loss_mask_BT[b].sum()
    mark_trained_turns(trajs, 2, "off")  # off again: every response token carries loss
    whole = build_token_batch(trajs, None, fmt.pad_id, fmt).loss_mask_BT
    assert whole.sum(1).tolist() == [float(t.num_response_tokens) for t in trajs]


# -- starts from replayed reference prefixes (ReOPD) ----------------------------------------------
class RecordingEngine:
    """The real engine, remembering every prompt it was asked to continue."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return self.engine.generate(prompts, params)


def _expert_references(tasks):
    from opd.rollout.references import expert_reference

    env = FROZENLAKE()
    return {task: expert_reference(env, task, seed=0) for task in tasks}


def test_a_prefix_schedule_and_its_draws():
    from opd.curriculum import draw_starts, prefix_fraction_at

    cfg = CurriculumConfig(prefix_source="expert", prefix_fraction=0.8, prefix_end_step=5)
    assert [prefix_fraction_at(cfg, s) for s in (1, 3, 5, 9)] == pytest.approx([0.8, 0.4, 0.0, 0.0])
    tasks = FROZENLAKE().unwrapped.task_ids("train")[:8]
    refs = _expert_references(tasks)
    starts = draw_starts(cfg, refs, tasks, seed=0, step=1)
    assert starts == draw_starts(cfg, refs, tasks, seed=0, step=1)  # a pure function of (seed, step)
    for task, start in zip(tasks, starts):
        ref = refs[task]
        assert len(start) <= int(0.8 * (len(ref.actions) - 1))  # never the reference's last turn
        assert start == tuple(zip(ref.actions, ref.observations))[:len(start)]
    assert any(starts), "some episode should start from a prefix"
    assert not any(draw_starts(cfg, refs, tasks, seed=0, step=5))  # the schedule has ended
    assert not any(draw_starts(CurriculumConfig(prefix_source="expert", prefix_share=0.0, prefix_end_step=5),
                               refs, tasks, seed=0, step=1))


def test_replayed_prefixes_restore_the_recorded_states_and_carry_no_loss(tokenizer, fmt, tiny_model_dir):
    tasks = FROZENLAKE().unwrapped.task_ids("train")[:6]
    refs = _expert_references(tasks)
    lengths = [min(k % 3 + 1, len(refs[t].actions) - 1) for k, t in enumerate(tasks)]
    starts = tuple(tuple(zip(refs[t].actions[:n], refs[t].observations[:n])) for t, n in zip(tasks, lengths))
    engine = RecordingEngine(HFEngine.from_pretrained(tiny_model_dir))
    settings = EpisodeSettings(max_new_tokens=6, env_isolation="inprocess", starts=starts)
    trajs = run_episodes(engine, FROZENLAKE, tasks, tokenizer, fmt, settings, seed=3)
    for traj, n, task in zip(trajs, lengths, tasks):
        replayed = traj.turns[:n]
        assert [t.action_text for t in replayed] == list(refs[task].actions[:n])
        assert [t.observation for t in replayed] == list(refs[task].observations[:n])  # the recorded states
        assert all(not t.trained and t.info["replayed"] and t.response_logprobs == [0.0] * len(t.response_ids)
                   for t in replayed)
        assert len(traj.turns) > n and all(t.trained and "replayed" not in t.info for t in traj.turns[n:])
    # The student continued from the replayed context, token for token what it trains on.
    for traj, n in zip(trajs, lengths):
        row = student_sequence(traj, fmt)
        first_own = row["input_ids"][:row["response_positions"][n][0]]
        assert first_own in engine.prompts
    batch = build_token_batch(trajs, None, fmt.pad_id, fmt)
    for b, (traj, n) in enumerate(zip(trajs, lengths)):
        positions = student_sequence(traj, fmt)["response_positions"]
        assert all(batch.loss_mask_BT[b, s:e].sum() == 0 for s, e in positions[:n])
        assert all(batch.loss_mask_BT[b, s:e].sum() == e - s for s, e in positions[n:])


def test_a_prefix_that_does_not_replay_names_the_task_and_turn(tokenizer, fmt, tiny_model_dir):
    from opd.rollout.vanilla import StartMismatch

    task = FROZENLAKE().unwrapped.task_ids("train")[0]
    ref = _expert_references([task])[task]
    wrong = ((ref.actions[0], ref.observations[0]), (ref.actions[1], "You fell into a hole."))
    settings = EpisodeSettings(max_new_tokens=6, env_isolation="inprocess", starts=(wrong,))
    with pytest.raises(StartMismatch, match=rf"task '{task}': replaying the reference's turn 1 \('{ref.actions[1]}'\)"):
        run_episodes(HFEngine.from_pretrained(tiny_model_dir), FROZENLAKE, [task], tokenizer, fmt, settings, seed=3)


# -- turns played by the teacher (Guided-OPD) -----------------------------------------------------
def test_teacher_played_turns_are_the_teachers_and_carry_no_loss(tokenizer, fmt, tiny_model_dir, tmp_path):
    from opd.curriculum import guide_share_at
    from opd.models import save_model, tiny_qwen3
    from opd.rollout.vanilla import guided_turn
    from opd.schema import TinyArchConfig

    cfg = CurriculumConfig(guide_share=0.6, guide_end_step=4)
    assert [guide_share_at(cfg, s) for s in (1, 2, 4)] == pytest.approx([0.6, 0.4, 0.0])
    teacher_dir = tmp_path / "teacher"  # another model with the same tokenizer: its turns are its own
    save_model(tiny_qwen3(tokenizer, TinyArchConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128),
                          seed=1), tokenizer, teacher_dir)
    student, teacher = RecordingEngine(HFEngine.from_pretrained(tiny_model_dir)), \
        RecordingEngine(HFEngine.from_pretrained(str(teacher_dir)))
    tasks = FROZENLAKE().unwrapped.task_ids("train")[:6]
    settings = EpisodeSettings(max_new_tokens=6, env_isolation="inprocess", guide_share=0.5)
    trajs = run_episodes(student, FROZENLAKE, tasks, tokenizer, fmt, settings, seed=3, guide=teacher.engine)
    played = [(i, t) for i, traj in enumerate(trajs) for t, turn in enumerate(traj.turns) if turn.info.get("teacher_played")]
    assert played and len(played) < sum(len(t.turns) for t in trajs)
    for i, traj in enumerate(trajs):
        for t, turn in enumerate(traj.turns):
            assert turn.trained == (not guided_turn(3, i, t, 0.5)) == ("teacher_played" not in turn.info)
    # Each guided turn is what the teacher answers from the episode's context, sampled with the
    # episode's seed (the student's engine never saw that context).
    from opd.generation.base import SamplingParams
    from opd.rollout.vanilla import episode_seed

    for i, t in played:
        row = student_sequence(trajs[i], fmt)
        context = row["input_ids"][:row["response_positions"][t][0]]
        assert context not in student.prompts
        params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(fmt.im_end_id,),
                                seed=3 * 1009 + t, seeds=(episode_seed(3, i, t),))
        assert teacher.engine.generate([context], params)[0].response_ids == trajs[i].turns[t].response_ids
    batch = build_token_batch(trajs, None, fmt.pad_id, fmt)
    for b, traj in enumerate(trajs):
        positions = student_sequence(traj, fmt)["response_positions"]
        for (s, e), turn in zip(positions, traj.turns):
            assert batch.loss_mask_BT[b, s:e].sum() == (e - s if turn.trained else 0)
    mark_trained_turns(trajs, 2, "off")  # a depth curriculum beside it never trains the teacher's turns
    assert all(not turn.trained for i, t in played for turn in [trajs[i].turns[t]])


def test_the_kl_by_turn_index_averages_each_turns_tokens_and_skips_untrained_turns(tokenizer, fmt, tiny_model_dir):
    """``kl_turn/<t>`` from real episodes scored by a real teacher: recomputed here by hand from
    each turn's behaviour and teacher logprobs; a turn marked untrained leaves its index."""
    from opd.algorithms.step import kl_by_turn
    from opd.supervision.teacher_view import score_trajectories

    trajs = _episodes(tokenizer, fmt, tiny_model_dir)
    trajs[0].turns[0].trained = False
    scores = score_trajectories(HFEngine.from_pretrained(tiny_model_dir), trajs, "state_grounded", fmt)
    got = kl_by_turn(trajs, scores)
    expected: dict[int, list[float]] = {}
    for traj, score in zip(trajs, scores):
        flat = iter(score.logprobs)
        for t, turn in enumerate(traj.turns, start=1):
            teacher = [next(flat) for _ in turn.response_ids]
            if turn.trained:
                expected.setdefault(t, []).extend(b - a for b, a in zip(turn.response_logprobs, teacher))
    assert list(got) == [f"kl_turn/{t:02d}" for t in sorted(expected)] and len(got) > 2
    for t, values in expected.items():
        assert got[f"kl_turn/{t:02d}"] == pytest.approx(sum(values) / len(values), abs=1e-9)
    # the same student and teacher (one model): behaviour and teacher logprobs agree, the KL is ~0
    assert max(abs(v) for v in got.values()) < 1e-4
    trajs[0].turns[0].trained = True
    assert kl_by_turn(trajs, scores)["kl_turn/01"] != got["kl_turn/01"]
