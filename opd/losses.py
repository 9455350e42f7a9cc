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
import inspect
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch.utils.checkpoint import checkpoint

from opd.trajectory import HeadRows, TokenBatch

LossFn = Callable[[TokenBatch, Mapping[str, Any]], tuple[torch.Tensor, dict[str, float]]]

# The one piece of module-level state: name -> function, filled by decorators at import time.
_REGISTRY: dict[str, LossFn] = {}


def register_loss(name: str, *, needs_teacher: bool = False, token_mask: str | None = None,
                  needs_reference: bool = False) -> Callable[[LossFn], LossFn]:
    """Register ``fn`` under ``name`` so a recipe can say ``name: <name>``, with what it needs.

    The traits are attributes of the function (:func:`loss_traits`), so a user's loss named by
    dotted path declares them by setting the same attributes:

    - ``needs_teacher``: it reads the teacher's grades; algorithms that do not consult the
      teacher (``grpo``) refuse it.
    - ``token_mask``: it trains on the tokens of that named mask (``TokenBatch.masks_BT``)
      instead of ``loss_mask_BT``; only algorithms whose batches carry the mask accept it.
    - ``needs_reference``: the trainer fills ``reference_logprobs_BT`` (a frozen copy of the
      starting weights) for it.
    """

    def decorate(fn: LossFn) -> LossFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise KeyError(f"a loss named {name!r} is already registered ({_REGISTRY[name].__module__})")
        # Only what is declared here: traits a function already carries are kept.
        for trait, value in (("needs_teacher", needs_teacher), ("token_mask", token_mask),
                             ("needs_reference", needs_reference)):
            if value:
                setattr(fn, trait, value)
        _REGISTRY[name] = fn
        return fn

    return decorate


def registered_losses() -> list[str]:
    return sorted(_REGISTRY)


_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def resolve_loss(name: str) -> LossFn:
    """A registered loss, or ``package.module.function`` imported from the user's code.

    Raises:
        KeyError: neither a registered name nor a dotted path.
        ImportError: the module does not import (whatever it raised while importing).
        AttributeError: the module has no such attribute.
        TypeError: the attribute is not a function taking ``(batch, cfg)``.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." not in name:
        raise KeyError(f"unknown loss {name!r}; registered: {', '.join(registered_losses())}, or give a dotted path")
    if not _DOTTED.match(name):
        raise KeyError(f"loss {name!r} is not a dotted path of Python names (e.g. my_pkg.my_losses.my_loss)")
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a user's module may raise anything while importing
        raise ImportError(f"cannot import module {module_name!r} for loss {name!r}: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attr):
        raise AttributeError(f"module {module_name!r} has no function {attr!r} (loss {name!r})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"loss {name!r} is a {type(fn).__name__}, not a function; a loss is fn(batch, cfg) -> "
                        "(loss, metrics)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TypeError(f"loss {name!r} has signature {fn.__name__}{inspect.signature(fn)}; a loss takes two "
                        "arguments, fn(batch, cfg), and returns (loss, metrics)") from None
    except ValueError:  # no signature to inspect (a builtin): let the first call tell
        pass
    return fn


def loss_traits(name: str) -> dict[str, Any]:
    """What the loss ``name`` needs (see :func:`register_loss`): ``needs_teacher``,
    ``token_mask`` and ``needs_reference``, absent attributes read as not needed."""
    fn = resolve_loss(name)
    return {"needs_teacher": bool(getattr(fn, "needs_teacher", False)), "token_mask": getattr(fn, "token_mask", None),
            "needs_reference": bool(getattr(fn, "needs_reference", False))}


NORMALISATIONS = ("token", "turn", "sequence")


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over masked-in entries; 0 (with a gradient path) when the mask is empty.

    Entries outside the mask are never multiplied (they may hold ``-inf`` or NaN padding)."""
    return torch.where(mask_BT > 0, values_BT, 0.0).sum() / mask_BT.sum().clamp(min=1.0)


# -- normalisation ---------------------------------------------------------------------------
def token_weights_BT(batch: TokenBatch, cfg: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` weight of each token: the loss mask times the recipe's ``turn_weights``
    (``[w_0, w_1, ...]``; turn ``k`` gets ``w_min(k, len - 1)``)."""
    weight_BT = batch.loss_mask_BT.float()
    turn_weights = cfg.get("turn_weights")
    if turn_weights:
        table_K = torch.tensor([float(w) for w in turn_weights], device=weight_BT.device)
        index_BT = batch.turn_index_BT.clamp(min=0, max=len(table_K) - 1)
        weight_BT = weight_BT * table_K[index_BT]
    return weight_BT


def reduce_tokens(values_BT: torch.Tensor, batch: TokenBatch, cfg: Mapping[str, Any]) -> torch.Tensor:
    """Reduce per-token values to the scalar loss, at the level ``cfg["normalize"]`` names.

    - ``token`` (default): the mean over all response tokens of the batch.
    - ``turn``: each turn's mean over its tokens, then the mean over turns (a long turn counts
      as much as a short one).
    - ``sequence``: each sequence's mean over its tokens, then the mean over sequences.

    Token weights (:func:`token_weights_BT`) multiply the values; the denominator still counts
    units, so weights change the balance, not the scale. When ``batch.totals`` is set (the
    trainer sets it before splitting into micro-batches and among its ranks), the denominator is
    the whole batch's count and the result is scaled by the number of micro-batches and of ranks:
    the gradients accumulated over the micro-batches (which DeepSpeed divides by their number) and
    averaged over the ranks equal those of the whole batch.

    Shapes: ``values_BT`` ``[B, T]`` (anything off the mask, even NaN, is ignored); returns a
    scalar.
    """
    level = cfg.get("normalize", "token")
    if level not in NORMALISATIONS:
        raise ValueError(f"normalize={level!r}; expected one of {NORMALISATIONS}")
    mask_BT = batch.loss_mask_BT > 0
    weight_BT = token_weights_BT(batch, cfg)
    if level == "token":
        unit_BT = torch.ones_like(weight_BT)
        local = mask_BT.sum()
    else:
        keys_BT = batch.turn_keys_BT() if level == "turn" else torch.arange(len(batch), device=mask_BT.device)[:, None].expand_as(mask_BT)
        counts = torch.zeros(int(keys_BT.max()) + 1, device=weight_BT.device).index_add_(
            0, keys_BT[mask_BT], torch.ones(int(mask_BT.sum()), device=weight_BT.device))
        unit_BT = 1.0 / counts[keys_BT].clamp(min=1.0)
        local = (counts > 0).sum()
    totals = batch.totals
    denominator = totals[{"token": "tokens", "turn": "turns", "sequence": "sequences"}[level]] if totals else float(local)
    scale = totals["micro_batches"] * totals.get("ranks", 1.0) if totals else 1.0
    total = torch.where(mask_BT, values_BT * weight_BT * unit_BT, 0.0).sum()
    return total * (scale / max(denominator, 1.0))


# -- numerically safe pieces over log-distributions -----------------------------------------
def _masked_logsumexp(x_NS: torch.Tensor, keep_NS: torch.Tensor) -> torch.Tensor:
    """``log sum exp`` over the kept entries of the last dim; ``-inf`` (with a zero, not NaN,
    gradient) where none is kept."""
    any_N = keep_NS.any(-1)
    safe_NS = torch.where(keep_NS, x_NS, float("-inf"))
    safe_NS = torch.where(any_N[..., None], safe_NS, 0.0)
    return torch.where(any_N, torch.logsumexp(safe_NS, dim=-1), float("-inf"))


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``sum_s p_s (log p_s - log q_s)`` over the last dim, with ``0 log 0 = 0``."""
    p_ok = p_log > float("-inf")
    p_safe = torch.where(p_ok, p_log, 0.0)
    q_safe = torch.where(p_ok, q_log, 0.0)
    return torch.where(p_ok, p_safe.exp() * (p_safe - q_safe), 0.0).sum(-1)


def _log_mixture(a_log: torch.Tensor, b_log: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta * exp(a) + (1 - beta) * exp(b))``, finite gradients where both are ``-inf``."""
    a = a_log + math.log(beta)
    b = b_log + math.log1p(-beta)
    high = torch.maximum(a, b)
    finite = high > float("-inf")
    shift = torch.where(finite, high, 0.0).detach()
    total = (a - shift).exp() + (b - shift).exp()
    return torch.where(finite, shift + torch.where(finite, total, 1.0).log(), float("-inf"))


def teacher_student_distributions(batch: TokenBatch, estimator: str,
                                  part: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's and the student's distributions at the trained tokens (``loss_mask_BT > 0``,
    ``N`` of them in row-major order, as :class:`~opd.trajectory.TokenRows` keeps them), as
    ``[N, S]`` logprobs; :func:`per_token` puts a value per row back at its ``[B, T]`` token.
    With ``part``, only those of the ``N`` rows (a chunk: :func:`divergence_per_token`).

    - ``full``: ``S = V``, the whole vocabulary.
    - ``topk``: ``S = K + 1``: the teacher's top-k ids, then one bucket for all other ids (the
      tail). Both distributions are coarsened the same way, so each divergence is the exact
      divergence of the coarsened pair (a lower bound on the full one, equal when the tail
      is empty). Padded top-k entries (teacher logprob ``-inf``) move to the student's tail.
    """
    if batch.student_logprobs_NV is None:
        raise ValueError("this loss needs the student's full distribution (batch.student_logprobs_NV); "
                         "the trainer sets it, set it yourself when calling a loss directly (batch.with_student)")
    mask_BT = batch.loss_mask_BT > 0
    student_NV = batch.student_logprobs_NV.at(mask_BT, part)
    part = slice(None) if part is None else part
    if estimator == "full":
        if batch.teacher_full_logprobs_NV is None:
            raise ValueError("estimator 'full' needs supervision.scoring: full (or hidden)")
        return batch.teacher_full_logprobs_NV.at(mask_BT, part).to(student_NV.device), student_NV
    if batch.teacher_topk_ids_BTK is None:
        raise ValueError("estimator 'topk' needs supervision.scoring: topk")
    ids_NK = batch.teacher_topk_ids_BTK[mask_BT][part]
    teacher_NK = batch.teacher_topk_logprobs_BTK[mask_BT][part]
    real_NK = teacher_NK > float("-inf")
    student_NK = torch.where(real_NK, student_NV.gather(-1, ids_NK), float("-inf"))
    in_topk_NV = torch.zeros_like(student_NV, dtype=torch.bool).scatter_(-1, ids_NK, real_NK)
    student_tail_N = _masked_logsumexp(student_NV, ~in_topk_NV)
    teacher_NS = torch.cat([teacher_NK, batch.teacher_tail_logprob_BT[mask_BT][part][..., None]], dim=-1)
    student_NS = torch.cat([student_NK, student_tail_N[..., None]], dim=-1)
    return teacher_NS, student_NS


def divergence_per_token(batch: TokenBatch, estimator: str,
                         divergence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[B, T]``: ``divergence(teacher_NS, student_NS) -> [N]`` of the distributions of
    :func:`teacher_student_distributions`, at the trained tokens (0 elsewhere), with gradient.

    Where the student's or the teacher's rows are computed on demand
    (:class:`~opd.trajectory.HeadRows`, ``trainer.vocab_chunk_tokens``), the rows go through
    ``divergence`` ``chunk_rows`` at a time, each chunk recomputed in the backward pass
    (activation checkpointing) rather than kept: at most one chunk's ``[chunk, V]`` log-softmax
    (and its gradient) is held at once, and the loss and its gradient are the unchunked ones.
    """
    mask_BT = batch.loss_mask_BT > 0
    n = int(mask_BT.sum())
    chunk = min((rows.chunk_rows for rows in (batch.student_logprobs_NV, batch.teacher_full_logprobs_NV)
                 if isinstance(rows, HeadRows) and rows.chunk_rows > 0), default=0)
    if chunk == 0 or n <= chunk:
        return per_token(batch, divergence(*teacher_student_distributions(batch, estimator)))

    def one_chunk(start: int) -> torch.Tensor:
        return divergence(*teacher_student_distributions(batch, estimator, slice(start, start + chunk)))

    values_N = torch.cat([checkpoint(one_chunk, start, use_reentrant=False) for start in range(0, n, chunk)])
    return per_token(batch, values_N)


def per_token(batch: TokenBatch, values_N: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: ``values_N`` (one per trained token, in the row-major order of
    :func:`teacher_student_distributions`) at their tokens, 0 elsewhere; the gradient flows."""
    mask_BT = batch.loss_mask_BT > 0
    return values_N.new_zeros(mask_BT.shape).index_put(tuple(mask_BT.nonzero().T), values_N)


def _estimator(batch: TokenBatch, cfg: Mapping[str, Any], allowed: tuple[str, ...]) -> str:
    """The estimator ``cfg["estimator"]`` names; ``auto`` picks the richest teacher data present."""
    name = cfg.get("estimator", "auto")
    if name == "auto":
        name = "full" if batch.teacher_full_logprobs_NV is not None else "topk" if batch.teacher_topk_ids_BTK is not None else "sampled"
    if name not in allowed:
        raise ValueError(f"estimator {name!r} is not available for this loss; choose one of {allowed} "
                         "(and set supervision.scoring to match)")
    return name


def _clipped_surrogate(batch: TokenBatch, advantage_BT: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token ``min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r = pi_S / mu``; also ``r``."""
    mask_BT = batch.loss_mask_BT > 0
    # Masked positions may hold -inf padding (and -inf - -inf is NaN): select, never multiply.
    log_ratio_BT = torch.where(mask_BT, batch.student_logprobs_BT - batch.behaviour_logprobs_BT, 0.0)
    ratio_BT = log_ratio_BT.exp()
    surrogate_BT = torch.minimum(ratio_BT * advantage_BT, ratio_BT.clamp(1 - eps, 1 + eps) * advantage_BT)
    return surrogate_BT, ratio_BT


def _ratio_metrics(batch: TokenBatch, ratio_BT: torch.Tensor, eps: float) -> dict[str, float]:
    with torch.no_grad():
        return {
            "clip_frac": float(masked_mean(((ratio_BT - 1).abs() > eps).float(), batch.loss_mask_BT)),
            "ratio_mean": float(masked_mean(ratio_BT, batch.loss_mask_BT)),
        }


# -- the built-in losses ----------------------------------------------------------------------
# Every built-in takes the normalisation arguments of reduce_tokens: ``normalize``
# (token | turn | sequence) and ``turn_weights``.


@register_loss("reverse_kl", needs_teacher=True)
def reverse_kl(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Reverse KL ``KL(pi_S || pi_T)`` to the teacher at every response position.

    Estimators (``cfg["estimator"]``; ``auto`` uses the richest teacher data in the batch):

    - ``sampled``: for the token ``x`` sampled from the behaviour policy ``mu``, the per-token
      advantage ``A = kl_coef * (log pi_T(x) - log mu(x))`` (detached) in PPO's clipped surrogate
      ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r = pi_S(x) / mu(x)``. On policy its
      gradient is ``kl_coef * grad KL(pi_S || pi_T)`` per token, in expectation.
    - ``topk``: exact over the teacher's top-k plus one tail bucket (``scoring: topk``).
    - ``full``: exact over the vocabulary (``scoring: full``).

    Shapes: ``[B, T]`` inputs, plus for the exact estimators the student's ``[N, V]`` rows
    (``student_logprobs_NV``) and the teacher's ``[B, T, K]`` top-k or ``[N, V]`` rows; returns a
    scalar.

    Args (``cfg``): ``estimator``, ``clip_ratio`` (0.2), ``kl_coef`` (1.0), ``baseline``
    (``none`` | ``batch_mean``, sampled only), ``normalize``, ``turn_weights``.

    Metrics: ``reverse_kl`` (sampled: mean ``log mu - log pi_T``; exact: the mean divergence),
    and for ``sampled`` ``clip_frac``, ``ratio_mean``.
    """
    estimator = _estimator(batch, cfg, ("sampled", "topk", "full"))
    mask_BT = batch.loss_mask_BT
    coef = float(cfg.get("kl_coef", 1.0))
    if estimator != "sampled":
        kl_BT = divergence_per_token(batch, estimator, lambda teacher_NS, student_NS: _kl(student_NS, teacher_NS))
        loss = coef * reduce_tokens(kl_BT, batch, cfg)
        return loss, {"reverse_kl": float(masked_mean(kl_BT.detach(), mask_BT))}
    eps = float(cfg.get("clip_ratio", 0.2))
    log_ratio_BT = torch.where(mask_BT > 0, batch.teacher_logprobs_BT - batch.behaviour_logprobs_BT, 0.0).detach()
    advantage_BT = coef * log_ratio_BT
    if cfg.get("baseline", "none") == "batch_mean":
        # A constant baseline keeps the gradient unbiased and removes the sampled advantage's
        # always-negative mean (-KL), the largest part of its variance.
        advantage_BT = torch.where(mask_BT > 0, advantage_BT - masked_mean(advantage_BT, mask_BT), 0.0)
    surrogate_BT, ratio_BT = _clipped_surrogate(batch, advantage_BT, eps)
    loss = -reduce_tokens(surrogate_BT, batch, cfg)
    metrics = {"reverse_kl": float(masked_mean(-log_ratio_BT, mask_BT)), **_ratio_metrics(batch, ratio_BT, eps)}
    return loss, metrics


@register_loss("forward_kl", needs_teacher=True)
def forward_kl(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL ``KL(pi_T || pi_S)`` at every response position, exact over the teacher's
    top-k plus tail (``scoring: topk``) or over the vocabulary (``scoring: full``).

    Mode-covering, where reverse KL is mode-seeking: the student is pulled towards every token
    the teacher gives mass to, including ones it never samples.

    Shapes: ``student_logprobs_NV`` ``[N, V]`` rows, teacher ``[B, T, K]`` + ``[B, T]`` tail or
    ``[N, V]`` rows; returns a scalar. Args: ``estimator`` (auto | topk | full), ``normalize``,
    ``turn_weights``. Metric: ``forward_kl``.
    """
    kl_BT = divergence_per_token(batch, _estimator(batch, cfg, ("topk", "full")), _kl)
    return reduce_tokens(kl_BT, batch, cfg), {"forward_kl": float(masked_mean(kl_BT.detach(), batch.loss_mask_BT))}


@register_loss("gjsd", needs_teacher=True)
def gjsd(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Generalised Jensen-Shannon divergence of GKD (Agarwal et al., 2024), per position:

    ``JSD_beta = beta * KL(pi_T || M) + (1 - beta) * KL(pi_S || M)``, ``M = beta pi_T + (1 - beta) pi_S``.

    ``beta = 0.5`` is the symmetric JSD. As GKD's reference code does, the endpoints are the
    two KLs themselves: ``beta = 0`` gives ``KL(pi_T || pi_S)`` (forward) and ``beta = 1``
    gives ``KL(pi_S || pi_T)`` (reverse) (the formula itself vanishes there).

    Shapes and estimators as :func:`forward_kl`. Args: ``beta`` (0.5), ``estimator``,
    ``normalize``, ``turn_weights``. Metric: ``gjsd``.
    """
    beta = float(cfg.get("beta", 0.5))
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"gjsd: beta={beta} must lie in [0, 1]")

    def divergence(teacher_NS: torch.Tensor, student_NS: torch.Tensor) -> torch.Tensor:
        if beta == 0.0:
            return _kl(teacher_NS, student_NS)
        if beta == 1.0:
            return _kl(student_NS, teacher_NS)
        mixture_NS = _log_mixture(teacher_NS, student_NS, beta)
        return beta * _kl(teacher_NS, mixture_NS) + (1 - beta) * _kl(student_NS, mixture_NS)

    div_BT = divergence_per_token(batch, _estimator(batch, cfg, ("topk", "full")), divergence)
    return reduce_tokens(div_BT, batch, cfg), {"gjsd": float(masked_mean(div_BT.detach(), batch.loss_mask_BT))}


def group_advantages(reward_B: torch.Tensor, group_B: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantage: ``(r_i - mean_g) / (std_g + eps)`` over the sequences of
    the same group (``std`` the population standard deviation; ``scale=False`` keeps only the
    centring). A group of one gets 0.

    Shapes: ``reward_B`` float ``[B]``, ``group_B`` int ``[B]``; returns ``[B]``.
    """
    reward_B = reward_B.float()
    _, index_B = torch.unique(group_B, return_inverse=True)
    n_G = torch.zeros(int(index_B.max()) + 1).index_add_(0, index_B, torch.ones_like(reward_B))
    mean_G = torch.zeros_like(n_G).index_add_(0, index_B, reward_B) / n_G
    centred_B = reward_B - mean_G[index_B]
    if not scale:
        return centred_B
    var_G = torch.zeros_like(n_G).index_add_(0, index_B, centred_B**2) / n_G
    return centred_B / (var_G.sqrt()[index_B] + eps)


@register_loss("ppo_clip")
def ppo_clip(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with one advantage per sequence: GRPO when the advantages are
    group-relative (:func:`group_advantages`, which the algorithm computes over the whole step
    and stores in ``batch.advantage_B``; ``rollout.group_size`` sets the groups).

    ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` per response token, ``r = pi_S(x) / mu(x)``.

    Shapes: ``[B, T]`` inputs and ``advantage_B`` ``[B]``; returns a scalar.
    Args: ``clip_ratio`` (0.2), ``normalize``, ``turn_weights``. Metrics: ``advantage_mean``,
    ``clip_frac``, ``ratio_mean``.
    """
    if batch.advantage_B is None:
        raise ValueError("ppo_clip needs batch.advantage_B (group advantages); the algorithm sets it from the "
                         "episodes' rewards; set rollout.group_size > 1 for GRPO groups")
    eps = float(cfg.get("clip_ratio", 0.2))
    advantage_BT = batch.advantage_B[:, None].float().expand_as(batch.loss_mask_BT)
    surrogate_BT, ratio_BT = _clipped_surrogate(batch, advantage_BT, eps)
    loss = -reduce_tokens(surrogate_BT, batch, cfg)
    return loss, {"advantage_mean": float(batch.advantage_B.float().mean()), **_ratio_metrics(batch, ratio_BT, eps)}


@register_loss("pivot_preventive", needs_teacher=True, token_mask="pivot")
def pivot_preventive(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """PivotOPD's preventive term: :func:`reverse_kl` to the teacher on the committed response
    of each failed episode's pivotal turn only (``batch.masks_BT["pivot"]``), normalised over
    those tokens. Where the teacher finds the mistaken action unlikely, its probability goes down.

    Shapes and args as :func:`reverse_kl`. Metrics: ``reverse_kl`` and ``tokens`` (pivot tokens
    in this micro-batch).
    """
    sub = batch.restricted_to("pivot")
    # The top-k fields of a PivotOPD batch hold the self-teacher's recovery targets, not the
    # teacher's: the teacher's own grade here is the sampled one unless the recipe says otherwise.
    loss, metrics = reverse_kl(sub, {**cfg, "estimator": cfg.get("estimator", "sampled")})
    return loss, {**metrics, "tokens": float(sub.loss_mask_BT.sum())}


@register_loss("pivot_recovery", needs_teacher=True, token_mask="recovery")
def pivot_recovery(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """PivotOPD's recovery term: :func:`forward_kl` from the hinted self-teacher's distribution
    (detached; its top-k plus tail in the ``teacher_topk_*`` fields of the recovery rows) to the
    student's hint-free distribution, on the self-teacher's responses
    (the ``recovery`` mask). The hinted action's probability goes up without the hint.

    Shapes as :func:`forward_kl` (``topk`` estimator). Args: ``normalize``, ``turn_weights``.
    Metrics: ``forward_kl`` and ``tokens`` (recovery tokens in this micro-batch).
    """
    sub = batch.restricted_to("recovery")
    loss, metrics = forward_kl(sub, {**cfg, "estimator": "topk"})
    return loss, {**metrics, "tokens": float(sub.loss_mask_BT.sum())}


@register_loss("sft")
def sft(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy (negative log-likelihood) of the batch's response tokens under the student.

    Used on demonstrations (teacher- or expert-written turns, e.g. bootstrap SFT) or as a small
    anchor next to a distillation loss. Shapes: ``[B, T]``; returns a scalar. Args:
    ``normalize``, ``turn_weights``. Metric: ``nll`` (mean per token).
    """
    nll_BT = -batch.student_logprobs_BT
    return reduce_tokens(nll_BT, batch, cfg), {"nll": float(masked_mean(nll_BT.detach(), batch.loss_mask_BT))}


@register_loss("reference_kl", needs_reference=True)
def reference_kl(batch: TokenBatch, cfg: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """An anchor to the frozen starting student ``pi_ref`` on the sampled response tokens, next to
    a distillation loss: it keeps the policy near where training began on the states it visits
    (GRPO's KL penalty).

    With ``r = log pi_ref(x) - log pi_S(x)`` for each response token ``x`` (sampled on policy):

    - ``k3`` (default): ``exp(r) - r - 1``, never negative. Its value estimates
      ``KL(pi_S || pi_ref)`` without bias; its gradient, in expectation over ``x ~ pi_S``, is that
      of ``KL(pi_ref || pi_S)``: it keeps mass on what the starting student said.
    - ``k2``: ``r**2 / 2``; in expectation its gradient is that of ``KL(pi_S || pi_ref)``.

    The trainer fills ``batch.reference_logprobs_BT`` (a frozen copy of the starting weights, one
    forward without gradient per micro-batch) because this function sets ``needs_reference``; a
    user's loss that sets it gets them too. Shapes: ``[B, T]``; returns a scalar. Args:
    ``estimator`` (k3 | k2), ``normalize``, ``turn_weights``. Metric: ``kl``, the mean k3 (the
    estimate of ``KL(pi_S || pi_ref)``) whatever the estimator.
    """
    if batch.reference_logprobs_BT is None:
        raise ValueError("reference_kl needs batch.reference_logprobs_BT; the trainer fills it for a loss that "
                         "sets needs_reference (a custom loss calling reference_kl must set it too)")
    estimator = cfg.get("estimator", "k3")
    if estimator not in ("k3", "k2"):
        raise ValueError(f"reference_kl: estimator={estimator!r}; expected k3 or k2")
    mask_BT = batch.loss_mask_BT
    r_BT = torch.where(mask_BT > 0, batch.reference_logprobs_BT - batch.student_logprobs_BT, 0.0)
    k3_BT = torch.exp(r_BT) - r_BT - 1.0
    values_BT = k3_BT if estimator == "k3" else 0.5 * r_BT**2
    return reduce_tokens(values_BT, batch, cfg), {"kl": float(masked_mean(k3_BT.detach(), mask_BT))}


def needs_reference(terms: list[tuple[str, float, Mapping[str, Any]]]) -> bool:
    """Whether any term's function sets ``needs_reference`` (the trainer then keeps a frozen copy
    of the starting weights and fills ``reference_logprobs_BT``)."""
    return any(loss_traits(name)["needs_reference"] for name, _, _ in terms)


class LossError(RuntimeError):
    """A loss term raised: the message names the term (its registered name or dotted path), what
    it raised and the innermost line of its own code (:func:`loss_frame`). One string argument,
    so that it crosses from a Ray actor to the driver intact."""

    @classmethod
    def of(cls, name: str, fn: Callable, exc: BaseException, when: str = "") -> "LossError":
        return cls(f"loss {name!r} raised {type(exc).__name__}: {exc}{when} at {loss_frame(fn, exc.__traceback__)}")


def loss_frame(fn: Callable, tb: Any) -> str:
    """``file:line (code)`` of the innermost frame of ``tb`` in the loss's own code: the user's
    files for a user's loss (not opd's, the standard library's or an installed package's), the
    loss's module for one of opd's."""
    import sysconfig
    import traceback

    frames = traceback.extract_tb(tb)
    own = inspect.getsourcefile(fn) or ""
    library = [str(Path(p).resolve()) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}]
    opd_dir = str(Path(__file__).resolve().parent)

    def users(filename: str) -> bool:
        path = str(Path(filename).resolve())
        return not path.startswith((opd_dir, *library)) or path == str(Path(own).resolve())

    found = [f for f in frames if users(f.filename)] or frames[-1:]
    if not found:
        return "?"
    frame = found[-1]
    return f"{frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")


def combined_loss(batch: TokenBatch, terms: list[tuple[str, float, Mapping[str, Any]]]) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_i weight_i * loss_i``; each term's metrics are prefixed with its name. A term that
    raises becomes a :class:`LossError` naming it and the line of its code that raised."""
    total = None
    metrics: dict[str, float] = {}
    for name, weight, args in terms:
        fn = resolve_loss(name)
        try:
            result = fn(batch, args)
        except Exception as exc:  # noqa: BLE001 - a user's loss may raise anything; it is named and re-raised
            raise LossError.of(name, fn, exc) from exc
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
                and result[0].numel() == 1 and isinstance(result[1], Mapping)):
            def kind(value: Any) -> str:
                return f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__

            got = f"({', '.join(map(kind, result))})" if isinstance(result, tuple) else kind(result)
            raise LossError(f"loss {name!r} returned {got}; a loss returns (a scalar tensor, a dict of floats)")
        loss, term_metrics = result
        total = weight * loss if total is None else total + weight * loss
        short = name.rsplit(".", 1)[-1]
        metrics[f"loss/{short}"] = float(loss.detach())
        metrics.update({f"{short}/{k}": v for k, v in term_metrics.items()})
    assert total is not None, "combined_loss needs at least one term"
    return total, metrics
