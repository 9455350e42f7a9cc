"""TokenRows (``[N, V]`` at some tokens of a ``[B, T]`` batch) against the dense ``[B, T, V]``
tensor it stands for, through everything a batch goes through: micro-batch selection, narrowing,
concatenation, moving, and a loss's look-up at its mask (with the gradient)."""

from __future__ import annotations

import pytest
import torch

from opd.trajectory import TokenBatch, TokenRows

B, T, V = 4, 6, 5


def _dense_and_mask(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask_BT = torch.rand(B, T, generator=gen) > 0.5
    mask_BT[2] = False  # a row with no tokens
    mask_BT[0, 1] = True
    values_BTV = torch.randn(B, T, V, generator=gen)
    return torch.where(mask_BT[..., None], values_BTV, 0.0), mask_BT


def _batch(rows: TokenRows, width: int = T) -> TokenBatch:
    attention_BT = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate((6, 3, 2, 5)):
        attention_BT[b, :n] = 1
    zeros = torch.zeros(B, T)
    return TokenBatch(input_ids_BT=torch.zeros(B, T, dtype=torch.long), attention_mask_BT=attention_BT,
                      loss_mask_BT=rows.mask_BT.float(), behaviour_logprobs_BT=zeros, teacher_logprobs_BT=zeros,
                      turn_index_BT=torch.zeros(B, T, dtype=torch.long), teacher_full_logprobs_NV=rows)


def test_rows_round_trip_to_the_dense_tensor():
    dense_BTV, mask_BT = _dense_and_mask()
    rows = TokenRows.from_dense(dense_BTV, mask_BT)
    assert rows.values_NV.shape == (int(mask_BT.sum()), V)
    torch.testing.assert_close(rows.dense(), dense_BTV, rtol=0, atol=0)
    every = TokenRows.from_dense(dense_BTV)  # every position: a view, no copy
    assert every.values_NV.data_ptr() == dense_BTV.data_ptr() and every.dense().data_ptr() == dense_BTV.data_ptr()


def test_at_a_mask_gives_the_rows_in_row_major_order_and_fill_elsewhere():
    dense_BTV, mask_BT = _dense_and_mask()
    rows = TokenRows.from_dense(dense_BTV, mask_BT, fill=-7.0)
    other_BT = mask_BT.clone()
    other_BT[0, 1] = False
    other_BT[2, 3] = True  # holds no row: filled
    got_MV = rows.at(other_BT)
    expected_MV = torch.where(mask_BT[..., None], dense_BTV, -7.0)[other_BT]
    torch.testing.assert_close(got_MV, expected_MV, rtol=0, atol=0)
    assert rows.at(mask_BT) is rows.values_NV


def test_the_gradient_flows_through_at_and_dense():
    dense_BTV, mask_BT = _dense_and_mask()
    leaf_NV = dense_BTV[mask_BT].clone().requires_grad_()
    rows = TokenRows(mask_BT, leaf_NV)
    sub_BT = mask_BT.clone()
    sub_BT[0, 1] = False
    (rows.at(sub_BT).sum() * 2 + rows.dense().sum()).backward()
    kept_N = sub_BT[mask_BT]
    assert leaf_NV.grad[kept_N].eq(3.0).all() and leaf_NV.grad[~kept_N].eq(1.0).all()


@pytest.mark.parametrize("index", [[2, 0, 3], [1], [3, 2, 1, 0], [2]])
def test_selecting_rows_equals_selecting_the_dense_rows(index):
    dense_BTV, mask_BT = _dense_and_mask(seed=1)
    picked = TokenRows.from_dense(dense_BTV, mask_BT).select_rows(torch.tensor(index))
    torch.testing.assert_close(picked.dense(), dense_BTV[index], rtol=0, atol=0)
    assert torch.equal(picked.mask_BT, mask_BT[index])


def test_micro_batches_narrow_and_concat_keep_every_row():
    dense_BTV, mask_BT = _dense_and_mask(seed=2)
    mask_BT &= torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 2 + [0] * 4, [1] * 5 + [0]], dtype=torch.bool)
    dense_BTV = torch.where(mask_BT[..., None], dense_BTV, 0.0)
    batch = _batch(TokenRows.from_dense(dense_BTV, mask_BT))
    seen = []
    for micro in batch.micro_batches(max_rows=2):
        width = micro.input_ids_BT.shape[1]
        assert micro.teacher_full_logprobs_NV.mask_BT.shape == (len(micro), width)
        seen.append(micro)
    whole = TokenBatch.concat(seen, pad_id=0)
    order = [0, 3, 1, 2]  # micro_batches: longest rows first
    torch.testing.assert_close(whole.teacher_full_logprobs_BTV, dense_BTV[order], rtol=0, atol=0)
    # A batch without the field joins with no rows.
    plain = TokenBatch(**{**batch.__dict__, "teacher_full_logprobs_NV": None})
    joined = TokenBatch.concat([batch, plain], pad_id=0)
    assert joined.teacher_full_logprobs_NV.values_NV.shape[0] == int(mask_BT.sum())
    assert not joined.teacher_full_logprobs_NV.mask_BT[B:].any()


def test_narrowing_past_held_tokens_drops_them_and_a_bad_count_is_refused():
    dense_BTV, mask_BT = _dense_and_mask(seed=3)
    mask_BT[:, -1] = True
    rows = TokenRows.from_dense(dense_BTV, mask_BT).narrow(T - 1)
    torch.testing.assert_close(rows.dense(), torch.where(mask_BT[..., None], dense_BTV, 0.0)[:, : T - 1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="values for a mask"):
        TokenRows(mask_BT, dense_BTV[mask_BT][1:])
