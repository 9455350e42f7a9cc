"""KV-cache machinery of the Hugging Face engine: a ``DynamicCache`` that grows in place
(:func:`kv_cache`), helpers that read and reshape per-layer keys and values, and
:class:`PrefixCache`, the KV of recent prompts reused by the prompts that extend them.

Keys and values are ``[B, heads, S, head_dim]`` per layer throughout (``[heads, L, head_dim]``
for one prompt in the prefix cache).
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def pad_columns(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``[N, heads, S, head_dim]`` with ``left`` / ``right`` zero columns added."""
    return torch.nn.functional.pad(x, (0, 0, left, right))


def right_aligned(layers, mask_BS: torch.Tensor):
    """``(layers, mask_BW)`` with each row's real columns moved to the right end, in order.

    Padding goes first, and the columns that are padding in every row are dropped (a prefill
    with a reused prefix leaves a gap between the prefix and the new tokens; closing it keeps
    later steps narrow)."""
    order_BS = torch.sort(mask_BS, dim=1, stable=True).indices  # padding (0) first, then the positions in order
    width = int(mask_BS.sum(1).max())
    order_BS = order_BS[:, mask_BS.shape[1] - width :]
    index = order_BS[:, None, :, None]
    moved = [(k.gather(2, index.expand(-1, k.shape[1], -1, k.shape[3])),
              v.gather(2, index.expand(-1, v.shape[1], -1, v.shape[3]))) for k, v in layers]
    return moved, mask_BS.gather(1, order_BS)


def kv_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)``, each ``[B, heads, S, head_dim]``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of a buffer with spare room: a
    decode step writes its token in place instead of copying the whole cache (``DynamicLayer``
    concatenates), and the buffer doubles when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int | None = None):
        """Over ``keys`` / ``values`` (``[B, heads, S, head_dim]``): copied into a roomier
        buffer, or, with ``length``, used as the buffer itself, its first ``length`` positions
        being the cache."""
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        if length is None:
            self._length = keys.shape[2]
            self._buffers = (self._room(keys, self._length + 64), self._room(values, self._length + 64))
        else:
            self._length, self._buffers = length, (keys, values)
        self._views()

    @staticmethod
    def _room(x: torch.Tensor, capacity: int) -> torch.Tensor:
        buffer = x.new_empty((x.shape[0], x.shape[1], capacity, x.shape[3]))  # beyond the length: never read
        buffer[:, :, : x.shape[2]] = x
        return buffer

    def _views(self) -> None:
        self.keys = self._buffers[0][:, :, : self._length]
        self.values = self._buffers[1][:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[2]
        if self._length + n > self._buffers[0].shape[2]:
            capacity = 2 * (self._length + n)
            self._buffers = (self._room(self.keys, capacity), self._room(self.values, capacity))
        self._buffers[0][:, :, self._length : self._length + n] = key_states
        self._buffers[1][:, :, self._length : self._length + n] = value_states
        self._length += n
        self._views()
        return self.keys, self.values


def kv_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], length: int | None = None) -> DynamicCache:
    """A ``DynamicCache`` over per-layer ``(keys, values)`` (``[B, heads, S, head_dim]``) that
    grows in place (:class:`_GrowingLayer`); with ``length`` the tensors are the buffers."""
    cache = DynamicCache()
    cache.layers = [_GrowingLayer(k, v, length) for k, v in layers]
    return cache


class PrefixCache:
    """The KV of recent prompts, for prompts that extend them (least recently used out first).

    Keyed by the prompt's ids; a value is per layer ``(keys, values)``, each ``[heads, L,
    head_dim]``. ``capacity_bytes`` 0 turns it off. Reused KV equals recomputed KV up to float
    rounding (the computation is split differently), so samples from a warm and a cold cache
    agree except on a draw within rounding of a boundary.
    """

    def __init__(self, capacity_bytes: int = 0, min_tokens: int = 16):
        self.capacity_bytes, self.min_tokens = capacity_bytes, min_tokens
        self._entries: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._lengths: list[int] = []  # the entries' distinct key lengths, ascending
        self._per_length: Counter[int] = Counter()
        self._bytes = 0
        self.dtype = torch.float32
        self.hits = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self._per_length.clear()
        self._bytes = 0

    def longest(self, prompt: list[int]) -> tuple[int, list | None]:
        """``(n, kv)``: the longest cached prompt that starts ``prompt``, usable for its first
        ``n`` tokens (at most ``len(prompt) - 1``: the last token is computed for its logits);
        ``(0, None)`` when none. One lookup per distinct length of the cached prompts, longest
        first (a multi-turn context usually finds its previous turn's at once)."""
        ids, best = tuple(prompt), None
        for k in range(bisect.bisect_right(self._lengths, len(ids)) - 1, -1, -1):
            if (key := ids[: self._lengths[k]]) in self._entries:
                best = key
                break
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        n = min(len(best), len(prompt) - 1)
        if n <= 0:
            return 0, None
        self.hits += 1
        self.reused_tokens += n
        return n, self._entries[best]

    def wants(self, prompt: list[int]) -> bool:
        """Whether :meth:`put` would keep ``prompt``'s KV (long enough, not cached yet): ask
        before gathering it."""
        return self.capacity_bytes > 0 and len(prompt) >= self.min_tokens and tuple(prompt) not in self._entries

    def put(self, prompt: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(prompt)
        if len(key) < self.min_tokens or key in self._entries:
            return
        size = _nbytes(kv)
        if size > self.capacity_bytes:
            return
        kv = [(k.contiguous(), v.contiguous()) for k, v in kv]
        self.dtype = kv[0][0].dtype
        self._entries[key] = kv
        self._count_length(len(key), +1)
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            gone, old = self._entries.popitem(last=False)
            self._count_length(len(gone), -1)
            self._bytes -= _nbytes(old)

    def _count_length(self, length: int, change: int) -> None:
        self._per_length[length] += change
        if change > 0 and self._per_length[length] == 1:
            bisect.insort(self._lengths, length)
        elif change < 0 and self._per_length[length] == 0:
            del self._per_length[length]
            self._lengths.pop(bisect.bisect_left(self._lengths, length))


def _nbytes(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes held by per-layer ``(keys, values)``."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
