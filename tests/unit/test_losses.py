"""The reverse-KL policy-gradient loss against brute-force references on a tiny vocabulary."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from opd.losses import combined_loss, register_loss, resolve_loss, reverse_kl
from opd.trajectory import TokenBatch

V = 5  # tiny vocabulary: every token can be enumerated


def _batch(student_BT, behaviour_BT, teacher_BT, mask_BT) -> TokenBatch:
    B, T = mask_BT.shape
    return TokenBatch(
        input_ids_BT=torch.zeros(B, T, dtype=torch.long),
        attention_mask_BT=torch.ones(B, T, dtype=torch.long),
        loss_mask_BT=mask_BT,
        behaviour_logprobs_BT=behaviour_BT,
        teacher_logprobs_BT=teacher_BT,
        turn_index_BT=torch.zeros(B, T, dtype=torch.long),
        student_logprobs_BT=student_BT,
    )


def test_expected_gradient_equals_exact_reverse_kl_gradient():
    """On policy, E_{x~pi}[grad of the sampled loss] == grad KL(pi || pi_T), enumerated exactly."""
    gen = torch.Generator().manual_seed(0)
    student_logits_V = torch.randn(V, generator=gen, requires_grad=True)
    teacher_logp_V = torch.log_softmax(torch.randn(V, generator=gen), -1)

    # Exact reverse KL over the vocabulary.
    logp_V = torch.log_softmax(student_logits_V, -1)
    exact = (logp_V.exp() * (logp_V - teacher_logp_V)).sum()
    (grad_exact,) = torch.autograd.grad(exact, student_logits_V)

    # Every token x as one row, weighted by pi(x): the expectation of the sampled estimator.
    logp_V = torch.log_softmax(student_logits_V, -1)
    weights_V = logp_V.exp().detach()
    batch = _batch(logp_V[:, None], logp_V.detach()[:, None], teacher_logp_V[:, None], torch.ones(V, 1))
    loss, _ = reverse_kl(batch, {"clip_ratio": 0.2})
    # reverse_kl averages over the V rows; undo that and weight each row by pi(x).
    per_row = []
    for x in range(V):
        row = _batch(logp_V[x : x + 1, None], logp_V.detach()[x : x + 1, None], teacher_logp_V[x : x + 1, None], torch.ones(1, 1))
        per_row.append(weights_V[x] * reverse_kl(row, {})[0])
    (grad_sampled,) = torch.autograd.grad(torch.stack(per_row).sum(), student_logits_V)
    torch.testing.assert_close(grad_sampled, grad_exact, atol=1e-6, rtol=1e-5)
    # The sampled-KL metric is the mean of log mu - log pi_T over the rows.
    assert torch.isfinite(loss)


def test_clipping_stops_the_gradient_past_the_trust_region():
    behaviour = torch.log(torch.tensor([[0.5]]))
    teacher = torch.log(torch.tensor([[0.9]]))  # positive advantage
    inside = torch.log(torch.tensor([[0.55]])).requires_grad_()
    outside = torch.log(torch.tensor([[0.7]])).requires_grad_()  # ratio 1.4 > 1.2
    mask = torch.ones(1, 1)
    loss_in, m_in = reverse_kl(_batch(inside, behaviour, teacher, mask), {"clip_ratio": 0.2})
    loss_out, m_out = reverse_kl(_batch(outside, behaviour, teacher, mask), {"clip_ratio": 0.2})
    (g_in,) = torch.autograd.grad(loss_in, inside)
    (g_out,) = torch.autograd.grad(loss_out, outside)
    advantage = float(teacher - behaviour)
    assert g_in.item() == pytest.approx(-advantage * 0.55 / 0.5, rel=1e-5)  # d/dlogp of -ratio*A
    assert g_out.item() == 0.0
    assert (m_in["clip_frac"], m_out["clip_frac"]) == (0.0, 1.0)
    assert m_in["reverse_kl"] == pytest.approx(-advantage, rel=1e-6)


def test_all_masked_batch_gives_zero_loss_and_finite_zero_gradient():
    student = torch.randn(2, 4, requires_grad=True)
    batch = _batch(student, torch.randn(2, 4), torch.randn(2, 4), torch.zeros(2, 4))
    loss, metrics = reverse_kl(batch, {})
    (grad,) = torch.autograd.grad(loss, student)
    assert loss.item() == 0.0 and metrics["reverse_kl"] == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_minus_inf_padding_and_low_temperature_keep_gradients_finite():
    logits_BTV = torch.randn(2, 3, V, requires_grad=True)
    student_BT = torch.log_softmax(logits_BTV / 0.05, -1)[..., 0]  # temperature 0.05: very peaked
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    neg_inf = torch.full((2, 3), float("-inf"))
    behaviour = torch.where(mask > 0, student_BT.detach(), neg_inf)  # -inf on padding
    teacher = torch.where(mask > 0, torch.log_softmax(torch.randn(2, 3, V), -1)[..., 0], neg_inf)
    loss, metrics = reverse_kl(_batch(student_BT, behaviour, teacher, mask), {})
    (grad,) = torch.autograd.grad(loss, logits_BTV)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(map(lambda v: v == v, metrics.values()))


def test_registry_and_dotted_paths_and_weighted_sum():
    @register_loss("test_constant")
    def constant(batch, cfg):
        return batch.student_logprobs_BT.sum() * 0.0 + cfg.get("value", 1.0), {"value": cfg.get("value", 1.0)}

    assert resolve_loss("test_constant") is constant
    assert resolve_loss("opd.losses.reverse_kl") is reverse_kl
    with pytest.raises(KeyError, match="unknown loss 'nope'"):
        resolve_loss("nope")
    with pytest.raises(ImportError, match="no_such_module"):
        resolve_loss("no_such_module.fn")
    batch = _batch(torch.zeros(1, 1, requires_grad=True), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    total, metrics = combined_loss(batch, [("test_constant", 2.0, {"value": 3.0}), ("test_constant", 0.5, {"value": 1.0})])
    assert total.item() == pytest.approx(6.5)
    assert metrics["loss/test_constant"] == 1.0  # last term's value under its name


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_reference_kl_expected_gradient_is_the_documented_divergence(estimator):
    """Enumerated over the vocabulary, E_{x~pi}[grad] of ``reference_kl`` is grad KL(pi_ref || pi)
    for k3 and grad KL(pi || pi_ref) for k2; its ``kl`` metric, weighted by pi, is KL(pi || pi_ref)."""
    from opd.losses import needs_reference, reference_kl

    gen = torch.Generator().manual_seed(1)
    logits_V = torch.randn(V, generator=gen, requires_grad=True)
    ref_V = torch.log_softmax(torch.randn(V, generator=gen), -1)
    logp_V = torch.log_softmax(logits_V, -1)
    p_V = logp_V.exp()
    exact = (ref_V.exp() * (ref_V - logp_V)).sum() if estimator == "k3" else (p_V * (logp_V - ref_V)).sum()
    (grad_exact,) = torch.autograd.grad(exact, logits_V)

    logp_V = torch.log_softmax(logits_V, -1)
    weights_V = logp_V.exp().detach()
    per_row, kl_estimate = [], 0.0
    for x in range(V):
        row = replace(_batch(logp_V[x : x + 1, None], torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)),
                      reference_logprobs_BT=ref_V[x : x + 1, None])
        loss, metrics = reference_kl(row, {"estimator": estimator})
        per_row.append(weights_V[x] * loss)
        kl_estimate += float(weights_V[x]) * metrics["kl"]
    (grad_rows,) = torch.autograd.grad(torch.stack(per_row).sum(), logits_V)
    torch.testing.assert_close(grad_rows, grad_exact, atol=1e-6, rtol=1e-5)
    assert kl_estimate == pytest.approx(float((weights_V * (logp_V.detach() - ref_V)).sum()), rel=1e-5)
    assert needs_reference([("reverse_kl", 1.0, {}), ("reference_kl", 0.1, {})])
    assert not needs_reference([("reverse_kl", 1.0, {})])


def test_reference_kl_is_zero_at_the_reference_and_refuses_a_batch_without_it():
    from opd.losses import reference_kl

    student = torch.log(torch.tensor([[0.3, 0.6, 0.1]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = _batch(student, student.detach(), student.detach(), mask)
    loss, metrics = reference_kl(replace(batch, reference_logprobs_BT=student.detach()), {})
    (grad,) = torch.autograd.grad(loss, student)
    assert loss.item() == 0.0 and metrics["kl"] == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    with pytest.raises(ValueError, match="reference_logprobs_BT"):
        reference_kl(batch, {})
    with pytest.raises(ValueError, match="estimator='k1'"):
        reference_kl(replace(batch, reference_logprobs_BT=student.detach()), {"estimator": "k1"})
