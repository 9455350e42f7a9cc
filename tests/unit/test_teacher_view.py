"""Prefix-shared (packed) teacher scoring equals naive per-turn scoring, in both views."""

from __future__ import annotations

import pytest
import torch

from opd.generation.hf import HFEngine
from opd.supervision.teacher_view import naive_requests, pack_trajectory, score_trajectories, unpack_scores
from tests.unit.test_chat import ten_turn_trajectory


@pytest.mark.parametrize("view", ["state_grounded", "full"])
def test_packed_scores_equal_naive_per_turn_scores(tokenizer, fmt, tiny_model_dir, view):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    traj = ten_turn_trajectory(tokenizer, fmt)
    packed = pack_trajectory(traj, view, fmt)
    per_turn = unpack_scores(traj, engine.score([packed])[0])
    naive = engine.score(naive_requests(traj, view, fmt))
    assert len(per_turn) == len(naive) == 10
    diffs = [abs(a - b) for p, n in zip(per_turn, naive) for a, b in zip(p, n)]
    assert len(diffs) == traj.num_response_tokens
    assert max(diffs) <= 1e-4
    # Sharing really happened: the packed sequence is much shorter than all contexts together.
    naive_tokens = sum(len(r.input_ids) for r in naive_requests(traj, view, fmt))
    assert len(packed.input_ids) < naive_tokens / 3


def test_scores_are_the_teachers_logprobs_of_the_student_tokens(tokenizer, fmt, tiny_model_dir):
    """Independent reference: a plain forward over context + response, read off by hand."""
    engine = HFEngine.from_pretrained(tiny_model_dir)
    traj = ten_turn_trajectory(tokenizer, fmt)
    scores = score_trajectories(engine, [traj, traj], "state_grounded", fmt)
    assert scores[0] == scores[1], "batched rows do not leak into each other"
    from opd.chat import render_context

    t = 6
    context = render_context(traj, t, "state_grounded", fmt)
    ids = torch.tensor([context + traj.turns[t].response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(ids).logits[0].float(), -1)
    n = len(context)
    expected = [logp[n - 1 + k, tok].item() for k, tok in enumerate(traj.turns[t].response_ids)]
    assert scores[0][t] == pytest.approx(expected, abs=1e-4)
