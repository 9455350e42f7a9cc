"""PivotOPD's two terms on constructed cases: each moves probability the intended way.

The student is a table of logits (one row per position) trained by plain gradient steps on the
loss alone, so any change in a probability is the loss's doing.
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.losses import combined_loss, pivot_preventive, pivot_recovery
from opd.trajectory import TokenBatch

V = 6
MISTAKE, HINTED = 2, 4


def _batch(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, **fields) -> TokenBatch:
    logp_BTV = torch.log_softmax(logits_BTV, -1)
    picked_BT = logp_BTV.gather(2, ids_BT[..., None]).squeeze(2)
    B, T = ids_BT.shape
    base = dict(
        input_ids_BT=ids_BT,
        attention_mask_BT=torch.ones(B, T, dtype=torch.long),
        loss_mask_BT=torch.zeros(B, T),
        behaviour_logprobs_BT=picked_BT.detach().clone(),  # on policy
        teacher_logprobs_BT=torch.zeros(B, T),
        turn_index_BT=torch.zeros(B, T, dtype=torch.long),
    )
    base.update(fields)
    return TokenBatch(**base).with_student(picked_BT, logp_BTV)


def _probability(logits_BTV, b, t, token) -> float:
    return torch.softmax(logits_BTV[b, t], -1)[token].item()


def _train(loss_fn, make_batch, logits_BTV, steps=20, lr=0.5):
    logits_BTV = logits_BTV.clone().requires_grad_(True)
    for _ in range(steps):
        loss, metrics = loss_fn(make_batch(logits_BTV), {})
        (grad,) = torch.autograd.grad(loss, logits_BTV)
        with torch.no_grad():
            logits_BTV -= lr * grad
    return logits_BTV.detach(), metrics


def test_preventive_term_lowers_the_mistaken_action_toward_the_teacher():
    # One sequence, three response positions; turn 1 (position 1) is the pivot, where the student
    # committed to MISTAKE with probability 0.7 and the teacher gives it 0.05.
    ids_BT = torch.tensor([[1, MISTAKE, 3]])
    logits_BTV = torch.zeros(1, 3, V)
    logits_BTV[0, 1, MISTAKE] = math.log(0.7 * (V - 1) / 0.3)
    teacher_BT = torch.full((1, 3), math.log(1 / V))
    teacher_BT[0, 1] = math.log(0.05)
    pivot_BT = torch.tensor([[0.0, 1.0, 0.0]])

    def make(logits):
        batch = _batch(logits, ids_BT, loss_mask_BT=torch.ones(1, 3), teacher_logprobs_BT=teacher_BT, masks_BT={"pivot": pivot_BT})
        # Stay on policy: the behaviour is the current student (one PPO epoch per sample).
        return batch.__class__(**{**batch.__dict__, "behaviour_logprobs_BT": batch.student_logprobs_BT.detach()})

    before = _probability(logits_BTV, 0, 1, MISTAKE)
    after_logits, metrics = _train(pivot_preventive, make, logits_BTV, steps=30)
    after = _probability(after_logits, 0, 1, MISTAKE)
    assert before == pytest.approx(0.7)
    assert after < before - 0.3 and after == pytest.approx(0.05, abs=0.02)  # down to the teacher's 0.05
    assert metrics["tokens"] == 1.0
    # Off the pivot the term does nothing, although those positions are on the loss mask.
    torch.testing.assert_close(after_logits[0, [0, 2]], logits_BTV[0, [0, 2]])


def test_preventive_term_follows_the_teacher_upward_too():
    ids_BT = torch.tensor([[1, MISTAKE]])
    logits_BTV = torch.zeros(1, 2, V)  # uniform: 1/6
    teacher_BT = torch.tensor([[0.0, math.log(0.6)]])

    def make(logits):
        batch = _batch(logits, ids_BT, loss_mask_BT=torch.ones(1, 2), teacher_logprobs_BT=teacher_BT,
                       masks_BT={"pivot": torch.tensor([[0.0, 1.0]])})
        return batch.__class__(**{**batch.__dict__, "behaviour_logprobs_BT": batch.student_logprobs_BT.detach()})

    after_logits, _ = _train(pivot_preventive, make, logits_BTV, steps=10)
    assert _probability(after_logits, 0, 1, MISTAKE) > 1 / V + 0.1


def _recovery_fields(B, T, K, position, topk_ids, topk_probs):
    ids_BTK = torch.zeros(B, T, K, dtype=torch.long)
    logp_BTK = torch.full((B, T, K), float("-inf"))
    tail_BT = torch.zeros(B, T)
    ids_BTK[0, position] = torch.tensor(topk_ids)
    logp_BTK[0, position] = torch.tensor(topk_probs).log()
    tail_BT[0, position] = math.log(1 - sum(topk_probs))
    mask_BT = torch.zeros(B, T)
    mask_BT[0, position] = 1.0
    return dict(teacher_topk_ids_BTK=ids_BTK, teacher_topk_logprobs_BTK=logp_BTK, teacher_tail_logprob_BT=tail_BT,
                masks_BT={"recovery": mask_BT})


def test_recovery_term_raises_the_hinted_action_without_the_hint():
    # A recovery row: the hint-free context's student puts 0.1 on HINTED; the hinted self-teacher
    # put 0.85 there (its top-2 plus a tail of 0.05).
    ids_BT = torch.tensor([[1, HINTED, 0]])
    logits_BTV = torch.zeros(1, 3, V)
    logits_BTV[0, 1, 1] = 2.0
    fields = _recovery_fields(1, 3, 2, 1, [HINTED, 1], [0.85, 0.10])
    make = lambda logits: _batch(logits, ids_BT, **fields)  # noqa: E731  loss_mask all 0: a recovery row
    before = _probability(logits_BTV, 0, 1, HINTED)
    kl_before = pivot_recovery(make(logits_BTV), {})[1]["forward_kl"]
    after_logits, metrics = _train(pivot_recovery, make, logits_BTV, steps=40)
    assert before < 0.1
    assert _probability(after_logits, 0, 1, HINTED) > 0.7
    assert metrics["forward_kl"] < kl_before / 10 and metrics["tokens"] == 1.0
    torch.testing.assert_close(after_logits[0, [0, 2]], logits_BTV[0, [0, 2]])  # only the recovery token moves


def test_terms_fold_into_one_loss_with_ppo_and_micro_batches_add_up():
    torch.manual_seed(0)
    B, T, K = 4, 5, 2
    ids_BT = torch.randint(0, V, (B, T))
    logits_BTV = torch.randn(B, T, V, requires_grad=True)
    loss_mask_BT = torch.tensor([[0, 1, 1, 1, 0]] * 3 + [[0] * 5], dtype=torch.float32)  # row 3: a recovery row
    pivot_BT = torch.zeros(B, T)
    pivot_BT[0, 2] = pivot_BT[2, 3] = 1.0
    fields = _recovery_fields(B, T, K, 2, [HINTED, 1], [0.7, 0.2])
    recovery_BT = torch.zeros(B, T)
    recovery_BT[3, 1:4] = 1.0
    fields["masks_BT"] = {"pivot": pivot_BT, "recovery": recovery_BT}
    for key in ("teacher_topk_ids_BTK", "teacher_topk_logprobs_BTK", "teacher_tail_logprob_BT"):
        fields[key][3] = fields[key][0]
        fields[key][3, 1:4] = fields[key][0, 2]
    terms = [("ppo_clip", 1.0, {}), ("pivot_preventive", 0.5, {}), ("pivot_recovery", 0.3, {})]

    def batch_of(logits):
        return _batch(logits, ids_BT, loss_mask_BT=loss_mask_BT, teacher_logprobs_BT=-torch.rand(B, T),
                      advantage_B=torch.tensor([1.0, -1.0, 0.5, 0.0]), **fields)

    torch.manual_seed(1)
    whole = batch_of(logits_BTV).with_totals(micro_batches=2)
    loss, metrics = combined_loss(whole, terms)
    assert {"loss/ppo_clip", "loss/pivot_preventive", "loss/pivot_recovery"} <= set(metrics)
    (expected,) = torch.autograd.grad(loss, logits_BTV)
    # The same batch in two micro-batches (DeepSpeed divides each by 2; the totals undo it).
    total = None
    for rows in (slice(0, 2), slice(2, 4)):
        micro_logits = logits_BTV[rows]
        torch.manual_seed(1)
        full = batch_of(logits_BTV.detach()).with_totals(micro_batches=2).select(rows)
        micro = _batch(micro_logits, ids_BT[rows], **{k: v for k, v in full.__dict__.items()
                                                     if k not in ("input_ids_BT", "student_logprobs_BT", "student_logprobs_NV")})
        part = combined_loss(micro, terms)[0] / 2
        total = part if total is None else total + part
    (got,) = torch.autograd.grad(total, logits_BTV)
    # With totals for 2 micro-batches the whole-batch loss is scaled by 2 (DeepSpeed's division
    # undoes it), so the accumulated micro-batch gradient is half of it: exactly the batch's.
    torch.testing.assert_close(got, expected / 2, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(expected).all()


def test_pivot_terms_refuse_a_batch_without_their_mask():
    ids_BT = torch.tensor([[1, 2]])
    batch = _batch(torch.zeros(1, 2, V), ids_BT, loss_mask_BT=torch.ones(1, 2))
    with pytest.raises(ValueError, match="'pivot' token mask.*pivot_opd"):
        pivot_preventive(batch, {})
    with pytest.raises(ValueError, match="'recovery' token mask.*pivot_opd"):
        pivot_recovery(batch, {})
