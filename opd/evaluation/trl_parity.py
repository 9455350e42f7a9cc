"""opd's losses against TRL's ``GKDTrainer`` on one batch: whether the two optimise the same thing.

On one batch built the way a ``vanilla_opd`` step builds it (the student's own samples through
opd's rollout, the teacher's full distributions through opd's scoring), opd's ``reverse_kl``
(``estimator: full``, the trainer's own logprob path) and ``GKDTrainer.generalized_jsd_loss(beta=1.0)``
on the same rows, shifted as ``GKDTrainer.compute_loss`` shifts them. Both reduce to the mean over
the batch's completion tokens of the exact per-token ``KL(pi_S || pi_T)``: opd's ``normalize:
token`` divides the sum by the batch's response tokens, TRL's ``batchmean`` with labels divides
by the unmasked labels, the same tokens, so no factor is applied. ``beta=0.0`` is opd's
``forward_kl`` (TRL's convention).

``bench/vs_trl.py`` checks it on its models before it times the two frameworks, and
``tests/integration/test_vs_trl_loss.py`` on two tiny models. It needs ``trl`` (the ``bench`` and
``dev`` extras).

Example:
    >>> result = loss_agreement(student_dir, teacher_dir, EnvFactory("opd/PromptDataset-v0"), tasks,
    ...                         max_new_tokens=6)  # doctest: +SKIP
    >>> result["abs_diff"] < 1e-4  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
from typing import Any

import torch

from opd.algorithms.step import build_token_batch
from opd.chat import ChatFormat
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.losses import combined_loss
from opd.models import load_model, load_tokenizer
from opd.rollout.vanilla import EpisodeSettings, run_episodes
from opd.supervision.teacher_view import score_trajectories
from opd.training.trainer import student_logprobs_at, trained_positions_BT


def loss_agreement(student_path: str, teacher_path: str, env_factory: EnvFactory, tasks: list[str], *,
                   max_new_tokens: int, temperature: float = 1.0, teacher_view: str = "state_grounded",
                   seed: int = 0) -> dict[str, Any]:
    """opd's exact ``reverse_kl`` and TRL's ``generalized_jsd_loss(beta=1)`` on one batch.

    The batch is built as a vanilla_opd step builds it: the student plays ``tasks`` through opd's
    rollout (HF engine, in-process environments), the teacher scores every response token with
    its full distribution, :func:`opd.algorithms.step.build_token_batch` makes the rows. opd's
    loss takes the trainer's logprob path (:func:`opd.training.trainer.student_logprobs_at`);
    TRL's takes plain forwards of both models on the same rows, labels ``-100`` off the response
    tokens, shifted as ``GKDTrainer.compute_loss`` does. Both are per-token means over the
    batch's response tokens (see the module docstring), compared without any factor.

    Returns ``opd_loss``, ``trl_loss``, ``abs_diff``; the student's gradients' ``grad_max_abs_diff``
    and ``grad_max_abs``; ``teacher_max_abs_diff`` (opd's scored teacher logprobs against TRL's
    forward); the forward-KL pair at ``beta=0`` (``opd_forward_kl``, ``trl_beta0``); ``rows``,
    ``tokens`` and ``row_tokens`` (each row's completion tokens: unequal ones tell a per-token
    mean from a per-sequence one).
    """
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # GKDTrainer lives in trl.experimental since 0.24
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError as exc:
        raise ImportError(f"the comparison with TRL needs trl ({exc}): pip install trl==1.16.0 (the bench extra)") from None

    tokenizer = load_tokenizer(student_path)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    student, teacher = load_model(student_path), load_model(teacher_path)
    settings = EpisodeSettings(max_new_tokens=max_new_tokens, temperature=temperature, env_isolation="inprocess")
    student_engine = HFEngine(student, fmt.pad_id, device="cpu")
    trajs = run_episodes(student_engine, env_factory, tasks, tokenizer, fmt, settings, seed)
    scores = score_trajectories(HFEngine(teacher, fmt.pad_id, device="cpu"), trajs, teacher_view, fmt, mode="full")
    batch = build_token_batch(trajs, scores, fmt.pad_id, fmt).with_totals(micro_batches=1)
    params = [p for p in student.parameters() if p.requires_grad]

    def grads_of(loss: torch.Tensor) -> list[torch.Tensor]:
        return [g if g is not None else torch.zeros_like(p) for g, p in zip(torch.autograd.grad(loss, params), params)]

    # opd: the trainer's logprobs (LM head at the trained positions only), the recipe's loss term.
    picked_BT, full_BTV = student_logprobs_at(student, batch, trained_positions_BT(batch), temperature, full_vocab=True)
    scored = batch.with_student(picked_BT, full_BTV)
    opd_loss, _ = combined_loss(scored, [("reverse_kl", 1.0, {"estimator": "full"})])
    opd_forward, _ = combined_loss(scored, [("forward_kl", 1.0, {"estimator": "full"})])
    opd_grads = grads_of(opd_loss)

    # TRL: GKDTrainer.compute_loss's forwards and shift, labels -100 off the completion tokens.
    labels_BT = torch.where(batch.loss_mask_BT > 0, batch.input_ids_BT, -100)
    student_logits = student(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    with torch.no_grad():
        teacher_logits = teacher(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    shifted = (student_logits[:, :-1], teacher_logits[:, :-1], labels_BT[:, 1:])
    trl_loss = GKDTrainer.generalized_jsd_loss(*shifted, beta=1.0, temperature=temperature)
    trl_beta0 = GKDTrainer.generalized_jsd_loss(*shifted, beta=0.0, temperature=temperature)
    trl_grads = grads_of(trl_loss)

    on_BT = batch.loss_mask_BT[:, 1:] > 0
    teacher_trl_NV = torch.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)[on_BT]
    return {
        "rows": len(batch), "tokens": int(batch.loss_mask_BT.sum()),
        "row_tokens": [int(n) for n in batch.loss_mask_BT.sum(1)],
        "opd_loss": float(opd_loss.detach()), "trl_loss": float(trl_loss.detach()),
        "abs_diff": abs(float(opd_loss.detach()) - float(trl_loss.detach())),
        "grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(opd_grads, trl_grads)),
        "grad_max_abs": max(float(g.abs().max()) for g in opd_grads),
        "teacher_max_abs_diff": float((batch.teacher_full_logprobs_BTV[:, 1:][on_BT] - teacher_trl_NV).abs().max()),
        "opd_forward_kl": float(opd_forward.detach()), "trl_beta0": float(trl_beta0.detach()),
    }
