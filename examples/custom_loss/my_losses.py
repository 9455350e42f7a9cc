"""A user's own loss, in the user's own file: no edit of ``opd/`` needed.

Name it in a recipe by dotted path (this file must be importable from where ``opd train`` runs,
e.g. the current directory or ``PYTHONPATH``)::

    losses:
      - name: reverse_kl
      - name: examples.custom_loss.my_losses.teacher_weighted_nll
        weight: 0.1
        args: {min_teacher_prob: 0.5}
"""

from __future__ import annotations

import torch

from opd.losses import masked_mean
from opd.trajectory import TokenBatch


def teacher_weighted_nll(batch: TokenBatch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """Raise the student's own tokens in proportion to how much the teacher likes them.

    ``loss = -mean_t( w_t * log pi_S(x_t) )`` with ``w_t = p_T(x_t)`` where the teacher's
    probability is at least ``min_teacher_prob`` and 0 elsewhere (detached).

    Shapes: every tensor of ``batch`` is ``[B, T]``; returns a scalar and a metrics dict.
    """
    floor = float(cfg.get("min_teacher_prob", 0.5))
    mask_BT = batch.loss_mask_BT
    teacher_prob_BT = torch.where(mask_BT > 0, batch.teacher_logprobs_BT, torch.full_like(mask_BT, -1e9)).exp()
    weight_BT = torch.where(teacher_prob_BT >= floor, teacher_prob_BT, torch.zeros_like(teacher_prob_BT)).detach()
    loss = -masked_mean(weight_BT * batch.student_logprobs_BT, mask_BT)
    return loss, {"kept_fraction": float(masked_mean((weight_BT > 0).float(), mask_BT))}
