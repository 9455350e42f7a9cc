"""The loss registry and the built-in losses: pure functions of tensors.

Contract: ``fn(batch: TokenBatch, cfg: Mapping) -> (scalar loss, metrics dict of floats)``.
``batch.student_logprobs_BT`` carries the gradient; every other tensor is data. A recipe names
each loss by registered name or by dotted path to the user's own function, with a weight::

    losses:
      - name: reverse_kl            # registered here
        args: {clip_ratio: 0.2}
      - name: my_pkg.losses.my_loss # a user's file; no library edit
        weight: 0.1

Example:
    >>> @register_loss("zero")
    ... def zero(batch, cfg):
    ...     return batch.student_logprobs_BT.sum() * 0.0, {}
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

import torch

from opd.trajectory import TokenBatch

LossFn = Callable[[TokenBatch, Mapping[str, Any]], tuple[torch.Tensor, dict[str, float]]]

# The one piece of module-level state: name -> function, filled by decorators at import time.
_REGISTRY: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Register ``fn`` under ``name`` so a recipe can say ``name: <name>``."""

    def decorate(fn: LossFn) -> LossFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise KeyError(f"a loss named {name!r} is already registered ({_REGISTRY[name].__module__})")
        _REGISTRY[name] = fn
        return fn

    return decorate


def registered_losses() -> list[str]:
    return sorted(_REGISTRY)


def resolve_loss(name: str) -> LossFn:
    """A registered loss, or ``package.module.function`` imported from the user's code."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." not in name:
        raise KeyError(f"unknown loss {name!r}; registered: {', '.join(registered_losses())}, or give a dotted path")
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module {module_name!r} for loss {name!r}: {exc}") from None
    if not hasattr(module, attr):
        raise AttributeError(f"module {module_name!r} has no function {attr!r} (loss {name!r})")
    return getattr(module, attr)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over masked-in entries; 0 (with a gradient path) when the mask is empty."""
    return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0)


@register_loss("reverse_kl")
def reverse_kl(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Sampled reverse KL to the teacher, used as a per-token policy-gradient advantage.

    For a token ``x`` sampled from the behaviour policy ``mu``, the advantage is
    ``A = kl_coef * (log pi_T(x) - log mu(x))`` (detached). With ``ratio = pi_S(x) / mu(x)`` the
    loss is PPO's clipped surrogate ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)``, averaged
    over response tokens. On policy (``pi_S == mu``) its gradient is exactly
    ``kl_coef * grad KL(pi_S || pi_T)`` per token in expectation.

    Shapes: all inputs ``[B, T]`` (see :class:`TokenBatch`); returns a scalar.

    Args (``cfg``):
        clip_ratio: eps of the clipped ratio (default 0.2).
        kl_coef: scale of the advantage (default 1.0).

    Metrics: ``reverse_kl`` (mean ``log mu - log pi_T`` per token: the sampled reverse KL of
    the behaviour policy), ``clip_frac``, ``ratio_mean``.
    """
    eps = float(cfg.get("clip_ratio", 0.2))
    coef = float(cfg.get("kl_coef", 1.0))
    mask_BT = batch.loss_mask_BT
    student_BT = batch.student_logprobs_BT
    behaviour_BT = batch.behaviour_logprobs_BT
    zeros_BT = torch.zeros_like(behaviour_BT)
    # Masked positions may hold -inf padding (and -inf - -inf is NaN): select, never multiply.
    advantage_BT = torch.where(mask_BT > 0, coef * (batch.teacher_logprobs_BT - behaviour_BT), zeros_BT).detach()
    if cfg.get("baseline", "none") == "batch_mean":
        # A constant baseline keeps the gradient unbiased and removes the sampled advantage's
        # always-negative mean (-KL), the largest part of its variance.
        advantage_BT = torch.where(mask_BT > 0, advantage_BT - masked_mean(advantage_BT, mask_BT), zeros_BT)
    log_ratio_BT = torch.where(mask_BT > 0, student_BT - behaviour_BT, zeros_BT)
    ratio_BT = log_ratio_BT.exp()
    surrogate_BT = torch.minimum(ratio_BT * advantage_BT, ratio_BT.clamp(1 - eps, 1 + eps) * advantage_BT)
    loss = -masked_mean(surrogate_BT, mask_BT)
    with torch.no_grad():
        clipped_BT = ((ratio_BT - 1).abs() > eps).float()
        kl_BT = torch.where(mask_BT > 0, behaviour_BT - batch.teacher_logprobs_BT, zeros_BT)
        metrics = {
            "reverse_kl": float(masked_mean(kl_BT, mask_BT)),
            "clip_frac": float(masked_mean(clipped_BT, mask_BT)),
            "ratio_mean": float(masked_mean(ratio_BT, mask_BT)),
        }
    return loss, metrics


def combined_loss(batch: TokenBatch, terms: list[tuple[str, float, Mapping[str, Any]]]) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_i weight_i * loss_i``; each term's metrics are prefixed with its name."""
    total = None
    metrics: dict[str, float] = {}
    for name, weight, args in terms:
        loss, term_metrics = resolve_loss(name)(batch, args)
        total = weight * loss if total is None else total + weight * loss
        short = name.rsplit(".", 1)[-1]
        metrics[f"loss/{short}"] = float(loss.detach())
        metrics.update({f"{short}/{k}": v for k, v in term_metrics.items()})
    assert total is not None, "combined_loss needs at least one term"
    return total, metrics
