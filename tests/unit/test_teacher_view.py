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
    per_turn = unpack_scores(traj, engine.score([packed])[0].logprobs)
    naive = [s.logprobs for s in engine.score(naive_requests(traj, view, fmt))]
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
    flat = score_trajectories(engine, [traj, traj], "state_grounded", fmt)
    scores = [unpack_scores(traj, f.logprobs) for f in flat]
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


def _plain_forward_logprobs(engine, traj, view, fmt) -> torch.Tensor:
    """``[N, V]`` teacher log-softmax at every response token, one ordinary forward per turn
    (no packing, no branch mask): the reference for the packed ``topk`` and ``full`` modes."""
    from opd.chat import render_context

    rows = []
    for t, turn in enumerate(traj.turns):
        context = render_context(traj, t, view, fmt)
        with torch.no_grad():
            logits = engine.model(torch.tensor([context + turn.response_ids])).logits[0].float()
        n = len(context)
        rows.append(torch.log_softmax(logits[n - 1 : n - 1 + len(turn.response_ids)], -1))
    return torch.cat(rows)


@pytest.mark.parametrize("view", ["state_grounded", "full"])
@pytest.mark.parametrize("mode", ["topk", "full"])
def test_packed_topk_and_full_scores_equal_plain_forwards(tokenizer, fmt, tiny_model_dir, view, mode):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    traj = ten_turn_trajectory(tokenizer, fmt)
    scores = score_trajectories(engine, [traj], view, fmt, mode=mode, top_k=5)[0]
    ref_NV = _plain_forward_logprobs(engine, traj, view, fmt)
    targets = torch.tensor([tok for turn in traj.turns for tok in turn.response_ids])
    assert len(scores.logprobs) == traj.num_response_tokens == len(ref_NV)
    torch.testing.assert_close(torch.tensor(scores.logprobs), ref_NV.gather(1, targets[:, None]).squeeze(1), atol=1e-4, rtol=0)
    if mode == "full":
        assert scores.topk_ids is None and scores.full_logprobs.shape == ref_NV.shape
        torch.testing.assert_close(scores.full_logprobs, ref_NV, atol=1e-4, rtol=0)
        return
    assert scores.full_logprobs is None and scores.topk_ids.shape == (len(ref_NV), 5)
    ref_values, _ = ref_NV.topk(5, -1)
    torch.testing.assert_close(scores.topk_logprobs, ref_values, atol=1e-4, rtol=0)
    # The ids are the ones holding those values in the reference distribution.
    torch.testing.assert_close(ref_NV.gather(1, scores.topk_ids), ref_values, atol=1e-4, rtol=0)
    tail_ref = torch.log1p(-ref_values.exp().sum(-1))
    torch.testing.assert_close(scores.tail_logprob, tail_ref, atol=1e-4, rtol=0)


def test_token_batch_carries_topk_and_full_scores_on_response_positions(tokenizer, fmt, tiny_model_dir):
    from opd.algorithms.step import build_token_batch
    from opd.chat import student_sequence

    engine = HFEngine.from_pretrained(tiny_model_dir)
    traj = ten_turn_trajectory(tokenizer, fmt)
    row = student_sequence(traj, fmt)
    positions = [p for start, end in row["response_positions"] for p in range(start, end)]
    off = [p for p in range(len(row["input_ids"])) if p not in set(positions)]
    topk = score_trajectories(engine, [traj, traj], "state_grounded", fmt, mode="topk", top_k=4)
    batch = build_token_batch([traj, traj], topk, fmt.pad_id, fmt)
    assert batch.teacher_topk_ids_BTK.shape == (2, len(row["input_ids"]), 4)
    assert torch.equal(batch.teacher_topk_ids_BTK[0, positions], topk[0].topk_ids)
    assert torch.equal(batch.teacher_topk_logprobs_BTK[1, positions], topk[1].topk_logprobs)
    assert torch.equal(batch.teacher_tail_logprob_BT[0, positions], topk[0].tail_logprob)
    assert torch.isinf(batch.teacher_topk_logprobs_BTK[0, off]).all()  # -inf padding off the responses
    assert batch.teacher_logprobs_BT[0, positions].tolist() == pytest.approx(topk[0].logprobs)
    full = score_trajectories(engine, [traj], "state_grounded", fmt, mode="full")
    batch = build_token_batch([traj], full, fmt.pad_id, fmt)
    assert torch.equal(batch.teacher_full_logprobs_BTV[0, positions], full[0].full_logprobs)
    assert batch.teacher_topk_ids_BTK is None and batch.advantage_B.tolist() == [0.0]


def test_length_groups_cover_every_row_once_within_both_caps():
    from opd.trajectory import length_groups

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3000, (57,), generator=gen).tolist()
    for max_rows, max_tokens in [(16, 4096), (4, 0), (1, 4096), (57, 100)]:
        groups = length_groups(lengths, max_rows, max_tokens)
        assert sorted(i for g in groups for i in g) == list(range(57))
        flat = [lengths[i] for g in groups for i in g]
        assert flat == sorted(lengths, reverse=True)  # longest first, neighbours together
        for g in groups:
            assert len(g) <= max_rows
            padded = len(g) * max(lengths[i] for i in g)
            assert len(g) == 1 or max_tokens == 0 or padded <= max_tokens
    assert length_groups([10] * 5, 16, 0) == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="max_rows"):
        length_groups([1], 0)


def test_scores_come_back_in_request_order_whatever_the_batching(tokenizer, fmt, tiny_model_dir):
    """Requests of very different lengths, batched by a padded-token budget (sorted by length,
    several forwards), score exactly as each alone, each in its own place."""
    engine = HFEngine.from_pretrained(tiny_model_dir)
    traj = ten_turn_trajectory(tokenizer, fmt)
    requests = naive_requests(traj, "full", fmt)[::-1] + naive_requests(traj, "state_grounded", fmt)
    alone = [engine.score([r])[0].logprobs for r in requests]
    longest = max(len(r.input_ids) for r in requests)
    for batch_size, batch_tokens in [(16, 0), (16, 2 * longest), (3, 0), (16, longest // 2)]:
        scores = engine.score(requests, batch_size=batch_size, batch_tokens=batch_tokens)
        assert [len(s.logprobs) for s in scores] == [len(a) for a in alone]
        assert max(abs(x - y) for s, a in zip(scores, alone) for x, y in zip(s.logprobs, a)) <= 1e-4
