"""The loss library against brute-force references on a tiny vocabulary, normalisation levels,
micro-batch accumulation, and finite gradients in the hard cases (-inf padding, an all-masked
batch, temperature 0.05).

References are written with Python loops over explicit probabilities, independently of the
vectorised code they check.
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.losses import forward_kl, gjsd, group_advantages, ppo_clip, reduce_tokens, reverse_kl, sft
from opd.trajectory import TokenBatch, TokenRows

B, T, V, K = 2, 5, 6, 3
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
TURNS = torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 1, -1, -1]])


def make_batch(mode: str, temperature: float = 1.0, mask=MASK, seed: int = 0, logits=None,
               banned: int | None = None, rows: str = "dense") -> tuple[TokenBatch, torch.Tensor]:
    """A batch with teacher data for ``mode`` and student logits (the leaf to differentiate).

    ``banned``: a vocabulary id both models give no mass (a ``-inf`` logit). ``rows``: the
    distributions at every position (``dense``) or, as the trainer and the teacher give them,
    at some tokens only (``sparse``: the teacher's at the trained tokens, the student's there and
    at one more token per row)."""
    gen = torch.Generator().manual_seed(seed)
    drawn_BTV = torch.randn(B, T, V, generator=gen) * 2
    logits_BTV = (drawn_BTV if logits is None else logits.detach()).clone().requires_grad_()
    teacher_logits_BTV = torch.randn(B, T, V, generator=gen) * 2
    student_logits_BTV = logits_BTV
    if banned is not None:
        student_logits_BTV = student_logits_BTV.index_fill(-1, torch.tensor([banned]), float("-inf"))
        teacher_logits_BTV = teacher_logits_BTV.index_fill(-1, torch.tensor([banned]), float("-inf"))
    student_BTV = torch.log_softmax(student_logits_BTV / temperature, -1)
    teacher_BTV = torch.log_softmax(teacher_logits_BTV, -1)
    ids_BT = torch.randint(0, V - 1, (B, T), generator=gen)  # sampled tokens: never the banned id V - 1
    picked = lambda d: d.gather(-1, ids_BT[..., None]).squeeze(-1)  # noqa: E731
    batch = TokenBatch(
        input_ids_BT=ids_BT,
        attention_mask_BT=torch.ones(B, T, dtype=torch.long),
        loss_mask_BT=mask,
        behaviour_logprobs_BT=picked(student_BTV).detach(),
        teacher_logprobs_BT=picked(teacher_BTV),
        turn_index_BT=TURNS,
        student_logprobs_BT=picked(student_BTV),
    )
    if rows == "dense":
        batch = batch.with_student(batch.student_logprobs_BT, student_BTV)
        teacher_rows = TokenRows.from_dense(teacher_BTV)
    else:
        extra_BT = torch.zeros(B, T, dtype=torch.bool)
        extra_BT[:, -1] = True
        batch = batch.with_student(batch.student_logprobs_BT, TokenRows.from_dense(student_BTV, (mask > 0) | extra_BT))
        teacher_rows = TokenRows.from_dense(teacher_BTV, mask > 0)
    if mode == "full":
        batch.teacher_full_logprobs_NV = teacher_rows
    if mode == "topk":
        values, ids = teacher_BTV.topk(K, -1)
        batch.teacher_topk_ids_BTK = ids
        batch.teacher_topk_logprobs_BTK = values
        batch.teacher_tail_logprob_BT = torch.log1p(-values.exp().sum(-1))
    return batch, logits_BTV


def coarse(p: list[float], keep: list[int]) -> list[float]:
    """Probabilities of the buckets ``keep[0], ..., keep[-1], everything else``."""
    return [p[i] for i in keep] + [sum(p[j] for j in range(len(p)) if j not in keep)]


def kl(p: list[float], q: list[float]) -> float:
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def jsd(p_teacher: list[float], q_student: list[float], beta: float) -> float:
    m = [beta * a + (1 - beta) * b for a, b in zip(p_teacher, q_student)]
    return beta * kl(p_teacher, m) + (1 - beta) * kl(q_student, m)


def brute_force(batch: TokenBatch, mode: str, divergence) -> float:
    """Token-level mean over the mask of ``divergence(teacher, student)`` at each position."""
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            if batch.loss_mask_BT[b, t] == 0:
                continue
            student = batch.student_logprobs_BTV[b, t].exp().tolist()
            if mode == "full":
                teacher = batch.teacher_full_logprobs_BTV[b, t].exp().tolist()
            else:
                keep = batch.teacher_topk_ids_BTK[b, t].tolist()
                teacher = batch.teacher_topk_logprobs_BTK[b, t].exp().tolist() + [math.exp(batch.teacher_tail_logprob_BT[b, t])]
                student = coarse(student, keep)
            total += divergence(teacher, student)
            count += 1
    return total / count


@pytest.mark.parametrize("rows", ["dense", "sparse"])
@pytest.mark.parametrize("mode", ["topk", "full"])
@pytest.mark.parametrize(
    "loss_fn, args, divergence",
    [
        (reverse_kl, {}, lambda p_t, q_s: kl(q_s, p_t)),
        (forward_kl, {}, lambda p_t, q_s: kl(p_t, q_s)),
        (gjsd, {"beta": 0.5}, lambda p_t, q_s: jsd(p_t, q_s, 0.5)),
        (gjsd, {"beta": 0.2}, lambda p_t, q_s: jsd(p_t, q_s, 0.2)),
        (gjsd, {"beta": 0.0}, lambda p_t, q_s: kl(p_t, q_s)),
        (gjsd, {"beta": 1.0}, lambda p_t, q_s: kl(q_s, p_t)),
    ],
    ids=["reverse_kl", "forward_kl", "gjsd0.5", "gjsd0.2", "gjsd0", "gjsd1"],
)
def test_divergences_equal_brute_force(mode, loss_fn, args, divergence, rows):
    batch, _ = make_batch(mode, rows=rows)
    loss, metrics = loss_fn(batch, args)
    expected = brute_force(batch, mode, divergence)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert next(iter(metrics.values())) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_topk_with_every_id_equals_full():
    """With K = V the tail is empty and the coarsened divergence is the full one."""
    batch, _ = make_batch("full")
    values, ids = batch.teacher_full_logprobs_BTV.topk(V, -1)
    batch.teacher_topk_ids_BTK, batch.teacher_topk_logprobs_BTK = ids, values
    batch.teacher_tail_logprob_BT = torch.full((B, T), float("-inf"))
    full = reverse_kl(batch, {"estimator": "full"})[0]
    topk = reverse_kl(batch, {"estimator": "topk"})[0]
    assert topk.item() == pytest.approx(full.item(), rel=1e-5)


def test_exact_reverse_kl_gradient_equals_autograd_of_brute_force():
    batch, logits = make_batch("full")
    (grad,) = torch.autograd.grad(reverse_kl(batch, {})[0], logits)
    logits_ref = logits.detach().clone().requires_grad_()
    student = torch.log_softmax(logits_ref, -1)
    ref = (student.exp() * (student - batch.teacher_full_logprobs_BTV)).sum(-1)
    ref = (ref * MASK).sum() / MASK.sum()
    (grad_ref,) = torch.autograd.grad(ref, logits_ref)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)


def test_group_advantages_and_ppo_clip_equal_brute_force():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    for i, (r, g) in enumerate(zip(rewards.tolist(), groups.tolist())):
        members = [x for x, h in zip(rewards.tolist(), groups.tolist()) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        assert adv[i].item() == pytest.approx((r - mean) / (std + 1e-6), abs=1e-5)
    assert adv[5].item() == 0.0  # a group of one has no signal
    assert group_advantages(rewards, groups, scale=False)[0].item() == pytest.approx(2 / 3)

    batch, _ = make_batch("sampled")
    batch.advantage_B = torch.tensor([0.7, -1.3])
    batch.student_logprobs_BT = batch.behaviour_logprobs_BT + torch.tensor([[0.0, 0.1, -0.5, 0.3, 0.0], [0.0, 0.25, -0.05, 0.0, 0.0]])
    loss, metrics = ppo_clip(batch, {"clip_ratio": 0.2})
    terms = []
    for b in range(B):
        for t in range(T):
            if MASK[b, t]:
                r = math.exp(batch.student_logprobs_BT[b, t] - batch.behaviour_logprobs_BT[b, t])
                a = batch.advantage_B[b].item()
                terms.append(-min(r * a, min(max(r, 0.8), 1.2) * a))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(3 / 5)  # 0.3, -0.5 and 0.25 leave [0.8, 1.2]


def test_sft_is_the_mean_negative_log_likelihood():
    batch, _ = make_batch("sampled")
    loss, metrics = sft(batch, {})
    expected = -(batch.student_logprobs_BT * MASK).sum() / MASK.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["nll"] == pytest.approx(expected.item(), rel=1e-6)


def test_normalisation_levels_and_turn_weights_equal_loops():
    batch, _ = make_batch("sampled")
    values = torch.arange(B * T, dtype=torch.float32).reshape(B, T) + 1
    # token: mean over the 5 tokens
    tokens = [(b, t) for b in range(B) for t in range(T) if MASK[b, t]]
    assert reduce_tokens(values, batch, {}).item() == pytest.approx(sum(values[b, t].item() for b, t in tokens) / 5)
    # turn: mean within each (row, turn), then over the 4 turns
    turns: dict[tuple[int, int], list[float]] = {}
    for b, t in tokens:
        turns.setdefault((b, int(TURNS[b, t])), []).append(values[b, t].item())
    by_turn = sum(sum(v) / len(v) for v in turns.values()) / len(turns)
    assert reduce_tokens(values, batch, {"normalize": "turn"}).item() == pytest.approx(by_turn)
    # sequence: mean within each row, then over the 2 rows
    rows = [[values[b, t].item() for bb, t in tokens if bb == b] for b in range(B)]
    assert reduce_tokens(values, batch, {"normalize": "sequence"}).item() == pytest.approx(sum(sum(r) / len(r) for r in rows) / 2)
    # per-turn weights: turn 0 x2, later turns x0.5; the denominator still counts tokens
    weighted = sum(values[b, t].item() * (2.0 if TURNS[b, t] == 0 else 0.5) for b, t in tokens) / 5
    assert reduce_tokens(values, batch, {"turn_weights": [2.0, 0.5]}).item() == pytest.approx(weighted)
    with pytest.raises(ValueError, match="normalize='word'"):
        reduce_tokens(values, batch, {"normalize": "word"})


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(level):
    """Split in micro-batches with the whole batch's totals, the gradients (divided by the
    number of micro-batches, as DeepSpeed does) add up to the whole batch's gradient."""
    batch, logits = make_batch("full")
    (whole,) = torch.autograd.grad(reverse_kl(batch, {"normalize": level})[0], logits)
    split, logits2 = make_batch("full", logits=logits)
    split = split.with_totals(micro_batches=2)
    total = sum(reverse_kl(split.select(slice(b, b + 1)), {"normalize": level})[0] / 2 for b in range(B))
    (accumulated,) = torch.autograd.grad(total, logits2)
    torch.testing.assert_close(accumulated, whole, atol=1e-6, rtol=1e-5)


LOSSES = [
    (reverse_kl, {"estimator": "sampled"}, "sampled"),
    (reverse_kl, {}, "topk"),
    (reverse_kl, {}, "full"),
    (forward_kl, {}, "topk"),
    (forward_kl, {}, "full"),
    (gjsd, {"beta": 0.5}, "topk"),
    (gjsd, {"beta": 0.5}, "full"),
    (ppo_clip, {}, "sampled"),
    (sft, {}, "sampled"),
]
LOSS_IDS = ["rkl-sampled", "rkl-topk", "rkl-full", "fkl-topk", "fkl-full", "gjsd-topk", "gjsd-full", "ppo", "sft"]


def _pad_with_minus_inf(batch: TokenBatch) -> None:
    """What padding looks like: -inf teacher and behaviour logprobs off the mask, and -inf top-k
    entries (a row with fewer than K real entries; all of them off the mask)."""
    off = batch.loss_mask_BT == 0
    batch.behaviour_logprobs_BT = batch.behaviour_logprobs_BT.masked_fill(off, float("-inf"))
    batch.teacher_logprobs_BT = batch.teacher_logprobs_BT.masked_fill(off, float("-inf"))
    if batch.teacher_topk_logprobs_BTK is not None:
        topk_BTK = batch.teacher_topk_logprobs_BTK.detach().clone()
        batch.teacher_tail_logprob_BT = torch.logaddexp(batch.teacher_tail_logprob_BT, topk_BTK[:, :, -1])
        topk_BTK[:, :, -1] = float("-inf")
        topk_BTK[off] = float("-inf")
        batch.teacher_topk_logprobs_BTK = topk_BTK


@pytest.mark.parametrize("loss_fn, args, mode", LOSSES, ids=LOSS_IDS)
@pytest.mark.parametrize("case", ["minus_inf_padding", "all_masked", "temperature_0.05"])
def test_gradients_are_finite(loss_fn, args, mode, case):
    temperature = 0.05 if case == "temperature_0.05" else 1.0
    mask = torch.zeros_like(MASK) if case == "all_masked" else MASK
    # minus_inf_padding: also one vocabulary entry with no mass (-inf) in both models.
    batch, logits = make_batch(mode, temperature=temperature, mask=mask, banned=V - 1 if case == "minus_inf_padding" else None)
    batch.advantage_B = torch.tensor([1.0, -1.0])
    if case == "minus_inf_padding":
        _pad_with_minus_inf(batch)
    loss, metrics = loss_fn(batch, args)
    (grad,) = torch.autograd.grad(loss, logits, allow_unused=True)
    assert torch.isfinite(loss)
    assert grad is not None and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    if case == "all_masked":
        assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
    else:
        assert torch.count_nonzero(grad) > 0  # the loss does reach the student


def test_exact_losses_refuse_a_batch_without_the_teacher_data_they_need():
    batch, _ = make_batch("sampled")
    with pytest.raises(ValueError, match="supervision.scoring"):
        forward_kl(batch, {})
    with pytest.raises(ValueError, match="estimator 'topk' needs supervision.scoring: topk"):
        reverse_kl(batch, {"estimator": "topk"})
    with pytest.raises(ValueError, match="beta=1.5"):
        gjsd(make_batch("full")[0], {"beta": 1.5})
    with pytest.raises(ValueError, match="advantage_B"):
        ppo_clip(batch, {})
