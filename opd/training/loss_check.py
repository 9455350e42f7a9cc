"""Each loss of a recipe, tried once before the run spends time on anything else.

A loss that raises would otherwise be found at the first training step, after the models are
loaded into their workers and the pre-training evaluation has run (minutes on a real recipe).
:func:`check_losses` calls every term of the recipe's ``losses`` on a small probe batch, in the
driver, within a second of the tokenizer being known: random tokens of the student's vocabulary
shaped as the recipe's batches are (the teacher's grades of its scoring mode, the student's
distribution over the vocabulary, advantages, the named token masks the terms train on, the
frozen reference's logprobs), with a student whose logprobs carry a gradient. A term that raises,
returns something other than ``(scalar tensor, dict)`` or a loss the gradient cannot flow back
from stops the run with a :class:`opd.losses.LossError` naming the term and its line.

The probe's numbers are random: what it checks is that the loss runs, not what it computes
(``tests/unit/test_loss_library.py`` checks that).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from opd.losses import LossError, combined_loss, loss_traits, resolve_loss
from opd.trajectory import HeadRows, LinearHead, TokenBatch, TokenRows

__all__ = ["check_losses", "probe_batch"]


def probe_batch(vocab_size: int, terms: list[tuple[str, float, Mapping[str, Any]]], scoring: str = "sampled",
                top_k: int = 20, algorithm: str = "vanilla_opd", seed: int = 0) -> TokenBatch:
    """Two rows of 12 tokens (the second padded), two turns of response tokens each, every field
    a loss of this recipe may read; the student's logprobs from random logits with a gradient."""
    gen = torch.Generator().manual_seed(seed)
    B, T, V = 2, 12, vocab_size
    attention_BT = torch.ones(B, T, dtype=torch.long)
    attention_BT[1, -3:] = 0
    loss_mask_BT = torch.zeros(B, T)
    loss_mask_BT[0, 3:6] = loss_mask_BT[0, 7:10] = 1.0
    loss_mask_BT[1, 2:4] = loss_mask_BT[1, 5:8] = 1.0
    turn_BT = torch.full((B, T), -1, dtype=torch.long)
    turn_BT[0, 3:6], turn_BT[0, 7:10], turn_BT[1, 2:4], turn_BT[1, 5:8] = 0, 1, 0, 1
    ids_BT = torch.randint(0, V, (B, T), generator=gen)

    def logprobs_BT() -> torch.Tensor:
        return torch.log(torch.rand(B, T, generator=gen).clamp(min=1e-3)) * loss_mask_BT

    logits_BTV = torch.randn(B, T, V, generator=gen).requires_grad_()
    student_BTV = torch.log_softmax(logits_BTV, dim=-1)
    student_BT = student_BTV.gather(-1, ids_BT[..., None])[..., 0] * loss_mask_BT
    batch = TokenBatch(input_ids_BT=ids_BT, attention_mask_BT=attention_BT, loss_mask_BT=loss_mask_BT,
                       behaviour_logprobs_BT=logprobs_BT(), teacher_logprobs_BT=logprobs_BT(), turn_index_BT=turn_BT,
                       advantage_B=torch.randn(B, generator=gen), reference_logprobs_BT=logprobs_BT())
    teacher_BTV = torch.log_softmax(torch.randn(B, T, V, generator=gen), dim=-1)
    trained_BT = loss_mask_BT.bool()
    if scoring == "topk" or algorithm == "pivot_opd":  # PivotOPD's recovery rows carry top-k targets
        k = min(top_k, V)
        top_lp_BTK, top_ids_BTK = teacher_BTV.topk(k, dim=-1)
        batch.teacher_topk_ids_BTK = torch.where(trained_BT[..., None], top_ids_BTK, 0)
        batch.teacher_topk_logprobs_BTK = torch.where(trained_BT[..., None], top_lp_BTK, float("-inf"))
        tail_BT = torch.log1p(-top_lp_BTK.exp().sum(-1).clamp(max=1 - 1e-6))
        batch.teacher_tail_logprob_BT = torch.where(trained_BT, tail_BT, 0.0)
    elif scoring == "full":
        batch.teacher_full_logprobs_NV = TokenRows(trained_BT, teacher_BTV[trained_BT])
    elif scoring == "hidden":  # as the trainer hands them over: hidden states with the teacher's head attached
        H = 8
        head = LinearHead(torch.randn(V, H, generator=gen))
        hidden = TokenRows(trained_BT, torch.randn(int(trained_BT.sum()), H, generator=gen))
        batch.teacher_full_logprobs_NV = HeadRows(hidden, head, vocab_size=V)
    masks = {trait for name, _, _ in terms if (trait := loss_traits(name)["token_mask"])}
    if algorithm == "pivot_opd":
        masks |= {"pivot", "recovery"}
    if masks:
        batch.masks_BT = {name: loss_mask_BT.clone() for name in sorted(masks)}
    batch = batch.with_totals()
    return batch.with_student(student_BT, TokenRows(attention_BT.bool(), student_BTV[attention_BT.bool()]))


def check_losses(vocab_size: int, terms: list[tuple[str, float, Mapping[str, Any]]], scoring: str = "sampled",
                 top_k: int = 20, algorithm: str = "vanilla_opd") -> None:
    """Call each term on :func:`probe_batch` and back-propagate its loss; a term that fails
    raises :class:`opd.losses.LossError`, naming it and its line."""
    batch = probe_batch(vocab_size, terms, scoring, top_k, algorithm)
    when = " on the probe batch opd tries each loss on before the run (random tokens of this recipe's shapes)"
    for term in terms:
        name = term[0]
        try:
            loss, _ = combined_loss(batch, [term])
        except LossError as exc:
            raise LossError(f"{exc}{when}") from exc.__cause__
        if not loss.requires_grad:
            raise LossError(f"loss {name!r} returned a tensor without a gradient (computed without "
                            f"batch.student_logprobs_BT, or detached): the student would not learn from it{when}")
        try:
            loss.backward(retain_graph=True)
        except Exception as exc:  # noqa: BLE001 - a user's loss's backward may raise anything
            raise LossError.of(name, resolve_loss(name), exc, f" in its backward pass{when}") from exc
