"""``supervision.scoring: hidden``: the teacher sends its final hidden states at the scored
tokens and its LM head once; the trainer computes the teacher's distribution from them, chunk by
chunk. Against ``full`` scoring of the same tokens by the same (real, tiny Qwen3) teacher: the
same targets' logprobs, the same losses and gradients, a payload smaller by about ``V / H``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from opd.generation.base import ScoreRequest
from opd.generation.hf import HFEngine
from opd.losses import combined_loss
from opd.supervision.teacher_view import with_teacher_scores
from opd.training.trainer import student_logprobs_at, trained_positions_BT
from opd.trajectory import HeadRows, TokenBatch, TokenRows, length_groups
from tests.unit.test_trainer_logprobs import _rows


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, fmt):
    from opd.models import load_model

    model = load_model(tiny_model_dir)
    with torch.no_grad():  # a teacher that is not the student
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return HFEngine(model, fmt.pad_id, device="cpu")


@pytest.fixture(scope="module")
def student(tiny_model_dir):
    from opd.models import load_model

    return load_model(tiny_model_dir).train()


def _scored(teacher, fmt, vocab: int, mode: str, packed: bool) -> TokenBatch:
    rows, positions = _rows(fmt, vocab, 4, torch.Generator().manual_seed(11), packed)
    requests = [ScoreRequest(r["input_ids"], r.get("position_ids", list(range(len(r["input_ids"])))),
                             r.get("branch_ids", [0] * len(r["input_ids"])), where, [t - 1 for t in where])
                for r, where in zip(rows, positions)]
    scores = teacher.score(requests, batch_size=2, mode=mode)
    batch = with_teacher_scores(TokenBatch.from_rows(rows, fmt.pad_id), positions, scores)
    return batch.with_totals(), scores


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("chunk_rows", [0, 4], ids=["whole", "chunked"])
def test_hidden_states_give_full_scorings_losses(teacher, student, fmt, packed, chunk_rows):
    vocab = student.get_output_embeddings().weight.shape[0]
    full, full_scores = _scored(teacher, fmt, vocab, "full", packed)
    hidden, hidden_scores = _scored(teacher, fmt, vocab, "hidden", packed)
    rows = hidden.teacher_full_logprobs_NV
    assert isinstance(rows, HeadRows) and rows.head is None  # what travels: no head, no [N, V]
    head = teacher.output_head()
    hidden = replace(hidden, teacher_full_logprobs_NV=replace(rows, head=head, chunk_rows=chunk_rows,
                                                               vocab_size=head.vocab_size))
    # The targets' logprobs, and the distribution itself.
    torch.testing.assert_close(hidden.teacher_logprobs_BT, full.teacher_logprobs_BT, rtol=0, atol=1e-6)
    mask_BT = full.loss_mask_BT > 0
    diff = (hidden.teacher_full_logprobs_NV.at(mask_BT) - full.teacher_full_logprobs_NV.at(mask_BT)).abs().max()
    assert float(diff) <= 1e-5
    # The payload: [N, H] hidden states in place of [N, V] logprobs.
    n = sum(len(s.logprobs) for s in full_scores)
    H = head.hidden_size
    assert sum(s.nbytes() for s in hidden_scores) == n * 4 * (1 + H)
    assert sum(s.nbytes() for s in full_scores) == n * 4 * (1 + vocab)

    terms = [("reverse_kl", 1.0, {}), ("forward_kl", 0.5, {"normalize": "turn"}), ("gjsd", 0.3, {"beta": 0.3})]
    results = []
    for batch in (full, hidden):
        student.zero_grad(set_to_none=True)
        picked_BT, rows_NV = student_logprobs_at(student, batch, trained_positions_BT(batch), 1.0, True, chunk_rows)
        loss, metrics = combined_loss(batch.with_student(picked_BT, rows_NV), terms)
        loss.backward()
        results.append((loss.detach(), metrics, {k: p.grad.clone() for k, p in student.named_parameters()}))
    (want_loss, want_metrics, want_grads), (got_loss, got_metrics, got_grads) = results
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=1e-5)
    assert got_metrics == pytest.approx(want_metrics, rel=1e-5, abs=1e-6)
    for name, grad in want_grads.items():
        assert float((got_grads[name] - grad).abs().max()) <= 1e-5 * max(1.0, float(grad.abs().max())), name
    assert want_loss > 0


def test_a_hidden_row_without_its_head_says_what_is_missing(teacher, fmt, student):
    vocab = student.get_output_embeddings().weight.shape[0]
    hidden, _ = _scored(teacher, fmt, vocab, "hidden", False)
    with pytest.raises(ValueError, match="without their output head"):
        hidden.teacher_full_logprobs_NV.at(hidden.loss_mask_BT > 0)


def test_hidden_rows_split_and_join_as_batches_do(teacher, fmt, student):
    """Micro-batches, rank shares and joined batches keep each token's hidden row."""
    vocab = student.get_output_embeddings().weight.shape[0]
    batch, _ = _scored(teacher, fmt, vocab, "hidden", True)
    head = teacher.output_head()
    whole = replace(batch.teacher_full_logprobs_NV, head=head, vocab_size=head.vocab_size).dense()
    parts = batch.micro_batches(2)
    assert len(parts) == 2
    joined = TokenBatch.concat(parts, fmt.pad_id)
    assert isinstance(joined.teacher_full_logprobs_NV, HeadRows)
    order = [i for group in length_groups(batch.attention_mask_BT.sum(1).tolist(), 2) for i in group]
    got = replace(joined.teacher_full_logprobs_NV, head=head, vocab_size=head.vocab_size).dense()
    width = got.shape[1]
    torch.testing.assert_close(got, whole[order][:, :width])
    with pytest.raises(ValueError, match="rows of logprobs in some batches and as hidden states in others"):
        TokenBatch.concat([parts[0], replace(parts[1], teacher_full_logprobs_NV=TokenRows(
            parts[1].loss_mask_BT > 0, torch.zeros(int((parts[1].loss_mask_BT > 0).sum()), vocab)))], fmt.pad_id)
