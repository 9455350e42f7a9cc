"""One forward over packed rows, with attention split so that most of it stays causal.

A packed row (:class:`opd.generation.base.ScoreRequest`, ActFirst's training rows) is a trunk
with branches: a branch token sees the trunk before its branch and its own branch, a trunk token
sees the trunk before it. Passed to the model as one ``[B, 1, L, L]`` mask
(:func:`~opd.generation.base.branch_attention_mask`), every query pays for all ``L`` keys and
PyTorch's attention leaves its causal fast path. Here the forward instead:

1. reorders each row: its trunk tokens first (in order), then its branch tokens, then padding
   (positions travel with their tokens, so the rotary embeddings see the same positions);
2. computes each row's attention in two calls on contiguous slices:

   - the trunk's queries against the trunk's keys: plain causal attention (``is_causal=True``,
     the fast path);
   - the branch tokens' queries against the trunk and branch keys, with their rows of the mask;

3. puts the logits back in the row's own order.

The result is the masked forward's, to float rounding (``tests/unit/test_packed_attention.py``);
``bench/forwards.py`` measures the time. It needs a model whose attention layers pass the
forward's keyword arguments on to the attention function, as transformers' Llama / Qwen family
does; for any other model the layout goes unread, which :func:`packed_forward` notices, and it
runs the masked forward instead (same numbers, slower).

Plain rows (one sequence each, right-padded: the trainer's vanilla rows, the bootstrap SFT)
take :func:`causal_forward`, which leaves the padding mask out for the same reason.

    >>> logits_BLV = packed_forward(model, ids_BL, pos_BL, branch_BL, valid_BL)  # doctest: +SKIP
    >>> logits_BLV = causal_forward(model, ids_BL, valid_BL)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from opd.generation.base import branch_attention_mask

log = logging.getLogger(__name__)

ATTENTION_NAME = "opd_packed"
_WARNED: set[str] = set()  # model classes already warned about (once each, not every forward)


@dataclass
class PackedLayout:
    """Per row of a reordered batch: how many trunk and branch tokens lead it, and the branch
    tokens' ``[1, 1, n_branch, n_trunk + n_branch]`` mask rows. Built once per forward, read by
    every attention layer (which sets ``used``)."""

    n_trunk: list[int]
    n_branch: list[int]
    branch_mask: list[torch.Tensor | None]
    used: bool = field(default=False)

    @classmethod
    def reorder(cls, branch_BL: torch.Tensor, valid_BL: torch.Tensor) -> tuple["PackedLayout", torch.Tensor]:
        """The layout, and ``order_BL``: row ``b`` of the reordered batch is row ``b`` of the
        packed one indexed by ``order_BL[b]`` (trunk, then branches, then padding)."""
        B, L = branch_BL.shape
        trunk_BL, on_branch_BL = valid_BL & (branch_BL == 0), valid_BL & (branch_BL > 0)
        rank_BL = torch.where(trunk_BL, 0, torch.where(on_branch_BL, 1, 2))
        order_BL = torch.sort(rank_BL, dim=1, stable=True).indices
        n_trunk, n_branch, masks = trunk_BL.sum(1).tolist(), on_branch_BL.sum(1).tolist(), []
        for b in range(B):
            nt, nb = n_trunk[b], n_branch[b]
            if not nb:
                masks.append(None)
                continue
            keys = order_BL[b, : nt + nb]
            branch_K, queries = branch_BL[b, keys], keys[nt:]
            # branch_attention_mask's rule in the packed order: a key no later than the query,
            # and on the trunk or on the query's own branch.
            visible = (keys[None, :] <= queries[:, None]) & (
                (branch_K[None, :] == 0) | (branch_K[None, :] == branch_BL[b, queries][:, None]))
            masks.append(visible[None, None])
        return cls(n_trunk, n_branch, masks), order_BL


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     packed_layout: PackedLayout | None = None, **kwargs):
    """transformers attention function (registered as ``opd_packed``) on a reordered batch: per
    row, causal attention over the trunk and masked attention for the branch tokens. Padding
    positions come out as zeros (nothing reads them)."""
    if packed_layout is None:  # a model that drops keyword arguments: packed_forward reruns it masked
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    packed_layout.used = True
    B, H, L, _ = query.shape
    gqa = key.shape[1] != H
    dropout = dropout if module.training else 0.0
    rows = []
    for b in range(B):
        nt, nb = packed_layout.n_trunk[b], packed_layout.n_branch[b]
        q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        parts = []
        if nt:
            parts.append(F.scaled_dot_product_attention(q[:, :, :nt], k[:, :, :nt], v[:, :, :nt], dropout_p=dropout,
                                                        is_causal=True, scale=scaling, enable_gqa=gqa))
        if nb:
            parts.append(F.scaled_dot_product_attention(q[:, :, nt : nt + nb], k[:, :, : nt + nb], v[:, :, : nt + nb],
                                                        attn_mask=packed_layout.branch_mask[b], dropout_p=dropout,
                                                        scale=scaling, enable_gqa=gqa))
        if nt + nb < L:
            parts.append(query.new_zeros(1, H, L - nt - nb, value.shape[-1]))
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the layout carries the mask


@functools.cache  # once per process, not at every forward
def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


@contextmanager
def _attention(model, name: str):
    """Run the model's forward with attention implementation ``name``, then restore it. Only the
    forward reads it; the backward replays the graph the forward recorded."""
    config = getattr(model, "module", model).config  # a DeepSpeed engine wraps the HF model
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _masked_forward(model, input_ids_BL, position_ids_BL, branch_BL, valid_BL) -> torch.Tensor:
    mask_B1LL = branch_attention_mask(branch_BL, valid_BL)
    return model(input_ids=input_ids_BL, attention_mask=mask_B1LL, position_ids=position_ids_BL).logits


def packed_forward(model, input_ids_BL: torch.Tensor, position_ids_BL: torch.Tensor, branch_BL: torch.Tensor,
                   valid_BL: torch.Tensor) -> torch.Tensor:
    """``[B, L, V]`` logits of the model on packed rows (``branch_BL``: 0 on the trunk, ``k > 0``
    on branch ``k``; ``valid_BL``: False on padding), on the device of ``input_ids_BL``. Logits
    at padding positions are unspecified."""
    device = input_ids_BL.device
    position_ids_BL, branch_BL, valid_BL = position_ids_BL.to(device), branch_BL.to(device), valid_BL.to(device)
    _register()
    layout, order_BL = PackedLayout.reorder(branch_BL, valid_BL)
    with _attention(model, ATTENTION_NAME):
        logits_BLV = model(input_ids=input_ids_BL.gather(1, order_BL), position_ids=position_ids_BL.gather(1, order_BL),
                           packed_layout=layout).logits
    if not layout.used:  # the model's attention layers dropped the layout: its forward was plain causal
        name = type(getattr(model, "module", model)).__name__
        if name not in _WARNED:
            _WARNED.add(name)
            log.warning("%s does not pass keyword arguments to its attention: packed rows use the one-mask forward", name)
        return _masked_forward(model, input_ids_BL, position_ids_BL, branch_BL, valid_BL)
    back_BL = torch.argsort(order_BL, dim=1)
    return logits_BLV[torch.arange(len(back_BL), device=device)[:, None], back_BL]


def causal_forward(model, input_ids_BL: torch.Tensor, valid_BL: torch.Tensor) -> torch.Tensor:
    """``[B, L, V]`` logits of the model on plain causal rows (``valid_BL``: False on padding).
    Logits at padding positions are unspecified.

    Right-padded rows run with no attention mask: a causal query never sees the padding after
    it, so every valid position gets the masked forward's logits, and attention stays on
    PyTorch's causal fast path (a padding mask takes it off, as a branch mask does). Rows padded
    any other way get the mask.
    """
    valid_BL = valid_BL.to(input_ids_BL.device).bool()
    lengths_B1 = valid_BL.sum(1, keepdim=True)
    if torch.equal(valid_BL, torch.arange(valid_BL.shape[1], device=valid_BL.device) < lengths_B1):
        return model(input_ids=input_ids_BL).logits
    return model(input_ids=input_ids_BL, attention_mask=valid_BL.long()).logits


class FinalHiddenStates:
    """The model as :mod:`opd.generation.packed`'s forwards call it, answering with the final
    hidden states (the LM head's input, after the last norm) in place of the logits: the LM head
    runs at one position only (``logits_to_keep=1``), whose logits check that the head is the
    plain linear map :func:`head_hidden_at` hands out (no soft-capping or scaling after it)."""

    def __init__(self, model):
        self.model = model  # the DeepSpeed engine or the HF model: the call goes through its forward
        self.module = getattr(model, "module", model)  # what packed reads the config from
        self.head = self.module.get_output_embeddings()
        # The torch engine's bfloat16 autocast: the head applied by hand must run in it as well.
        self.autocast = getattr(model, "autocast", contextlib.nullcontext)
        self.ok = False

    def __call__(self, **inputs):
        self.ok = False
        ids_BL = inputs["input_ids"]
        placeholder_BL1 = torch.zeros(*ids_BL.shape, 1, device=ids_BL.device)  # what the caller reorders when not ok
        decoder = getattr(self.module, "get_decoder", lambda: None)()
        if not isinstance(decoder, torch.nn.Module):
            return SimpleNamespace(logits=placeholder_BL1)
        captured = []
        hook = decoder.register_forward_hook(lambda mod, args, out: captured.append(out[0]))
        try:
            logits_B1V = self.model(**inputs, logits_to_keep=1).logits
        except TypeError:  # a forward without logits_to_keep
            return SimpleNamespace(logits=placeholder_BL1)
        finally:
            hook.remove()
        hidden_BLH = captured[-1] if captured else None
        if hidden_BLH is not None and isinstance(self.head, torch.nn.Linear):
            with torch.no_grad(), self.autocast():  # padding positions may hold NaN (a query that sees no key)
                self.ok = torch.allclose(self.head(hidden_BLH[:, -1:]).float(), logits_B1V.float(), rtol=1e-4,
                                         atol=1e-4, equal_nan=True)
        return SimpleNamespace(logits=hidden_BLH if self.ok else placeholder_BL1)


def head_hidden_at(model, input_ids_BL: torch.Tensor, valid_BL: torch.Tensor, rows_N: torch.Tensor,
                   columns_N: torch.Tensor, position_ids_BL: torch.Tensor | None = None,
                   branch_BL: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable, int] | None:
    """The final hidden states ``[N, H]`` at the ``N`` positions ``(rows_N, columns_N)`` of a
    forward over the rows (plain, or packed when ``branch_BL`` is given), the LM head as a
    function of them (``[M, H] -> [M, V]`` logits, in the engine's autocast) and ``V``. ``None``
    when the model's head is not a plain linear map of the decoder's output (soft-capped or
    scaled logits): the caller computes every position instead."""
    stand_in = FinalHiddenStates(model)
    if branch_BL is None:
        hidden_BLH = causal_forward(stand_in, input_ids_BL, valid_BL)
    else:
        hidden_BLH = packed_forward(stand_in, input_ids_BL, position_ids_BL, branch_BL, valid_BL.bool())
    if not stand_in.ok:
        return None

    def head(hidden_MH: torch.Tensor) -> torch.Tensor:
        with stand_in.autocast():
            return stand_in.head(hidden_MH)

    return hidden_BLH[rows_N, columns_N], head, int(stand_in.head.out_features)
