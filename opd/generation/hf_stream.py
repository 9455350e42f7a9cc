"""Continuous batching on the Hugging Face engine: :class:`HFStream`, where requests join and
leave between decode steps over one slotted KV buffer.

It prefills through :meth:`opd.generation.hf.HFEngine.prefill` (so it shares the engine's
prefix cache) and samples as :meth:`~opd.generation.hf.HFEngine.generate` does, per row.
Build one with ``engine.stream(seed)``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from opd.generation.base import Completion, SamplingParams
from opd.generation.kv_cache import kv_cache, kv_layers, pad_columns, right_aligned

if TYPE_CHECKING:  # for annotations only: hf.py imports this module (HFEngine.stream), so no cycle
    from opd.generation.hf import HFEngine


@dataclass
class _Live:
    """A request in an :class:`HFStream`: its params and what it has sampled so far."""

    key: Hashable
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class HFStream:
    """Continuous batching on the HF engine: requests join and leave between decode steps.

    The KV cache is a buffer of *slots* (rows) and columns. Every slot writes its next token at
    the same column, so a decode step is one forward over all slots that appends one column in
    place. A new request is prefilled (with those added alongside it, next-token logits only)
    and copied right-aligned into a free slot, ending at the current column; a finished
    request frees its slot for the next. Nothing already in the cache is moved when requests
    join or leave, except when the buffer must grow (more slots, which at least doubles them, or
    room for a longer prompt on the left or for more steps on the right, 256 columns spare). Free slots ride along in
    the forward (their cost is a row's, small against a forward's fixed cost on a small model)
    and are dropped when fewer than a quarter of the slots are live. Attention reads only the
    columns from the first one a live request uses.

    A step's forward costs little more for a hundred rows than for ten on a small model, so
    requests that share steps are nearly free: this is what lets ActFirst's full responses ride
    along with its fast actions in one thread.

    Sampling matches :meth:`HFEngine.generate` per row (behaviour logprobs after temperature,
    greedy at temperature 0, stop tokens and stop strings kept in the response), from one
    ``torch.Generator`` seeded at creation. Which rows share a step is decided by the caller's
    order of ``add`` and ``step`` calls alone, so a stream is reproducible; its samples differ
    from ``generate``'s for the same seed (the generator's draws are shared differently).

    ``params.n`` must be 1 (add a request per sample). The number of live requests is not
    capped (``max_batch_size`` applies to ``generate``): the caller bounds it.

    Example:
        >>> stream = engine.stream(seed=0)  # doctest: +SKIP
        >>> stream.add("a", prompt_ids, SamplingParams(max_new_tokens=8))  # doctest: +SKIP
        >>> while stream: finished = stream.step()  # doctest: +SKIP
    """

    def __init__(self, engine: HFEngine, seed: int = 0):
        self.engine = engine
        self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        self.slots: list[_Live | None] = []
        self.steps = 0
        self.row_steps = 0  # sum over steps of live rows: row_steps / steps is the mean batch
        self._waiting: list[tuple[_Live, list[int]]] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer [slots, heads, columns, head_dim]
        self._mask_NS: torch.Tensor | None = None  # [slots, columns]; every slot keeps >= 1 visible column
        self._start = []  # per slot: first column its request uses
        self._next_pos_N: torch.Tensor | None = None
        self._logits_NV: torch.Tensor | None = None
        self._cur = 0  # the column the next decode step writes

    def __len__(self) -> int:
        return sum(r is not None for r in self.slots) + len(self._waiting)

    def add(self, key: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError(f"a stream request samples once (SamplingParams.n={params.n}); add one request per sample")
        if params.stop and self.engine.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer: build it with HFEngine.from_pretrained "
                             "or pass tokenizer=")
        if not prompt_ids:
            raise ValueError(f"request {key!r} has an empty prompt")
        self._waiting.append((_Live(key, params), list(prompt_ids)))

    @torch.no_grad()
    def step(self) -> list[tuple[Hashable, Completion]]:
        if self._waiting:
            self._join()
        live = [i for i, row in enumerate(self.slots) if row is not None]
        if not live:
            return []
        self.steps += 1
        self.row_steps += len(live)
        token_L, logp_L = self._sample(live)
        finished = []
        for i, token, lp in zip(live, token_L.tolist(), logp_L.tolist()):
            row = self.slots[i]
            row.tokens.append(token)
            row.logprobs.append(lp)
            reason = self._finish_reason(row, token)
            if reason:
                finished.append((row.key, Completion(response_ids=row.tokens, logprobs=row.logprobs, finish_reason=reason)))
                self.slots[i] = None
        alive = [i for i in live if self.slots[i] is not None]
        if not alive:
            return finished
        token_N = torch.full((len(self.slots),), self.engine.pad_id, dtype=torch.long, device=self.engine.device)
        token_N[torch.tensor(live, device=self.engine.device)] = token_L
        if 4 * len(alive) < len(self.slots) and len(self.slots) > 16:
            token_N = token_N[torch.tensor(alive, device=self.engine.device)]
            self._keep(alive)
        self._decode(token_N)
        return finished

    # -- internals ---------------------------------------------------------------------------
    def _sample(self, live: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        temps = [self.slots[i].params.temperature for i in live]
        greedy_L = torch.tensor([t <= 0 for t in temps], device=self.engine.device)
        temperature_L1 = torch.tensor([t if t > 0 else 1.0 for t in temps], device=self.engine.device)[:, None]
        logits_LV = self._logits_NV[torch.tensor(live, device=self.engine.device)]
        logp_LV = torch.log_softmax(logits_LV / temperature_L1, dim=-1)
        token_L = logp_LV.argmax(-1)
        if not bool(greedy_L.all()):
            drawn_L = torch.multinomial(logp_LV.exp(), 1, generator=self.generator).squeeze(1)
            token_L = torch.where(greedy_L, token_L, drawn_L)
        return token_L, logp_LV.gather(1, token_L[:, None]).squeeze(1)

    def _finish_reason(self, row: _Live, token: int) -> str:
        if token in row.params.stop_token_ids:
            return "stop"
        if row.params.stop:
            text = self.engine.tokenizer.decode(row.tokens, skip_special_tokens=True)
            if any(s in text for s in row.params.stop):
                return "stop"
        return "length" if len(row.tokens) >= row.params.max_new_tokens else ""

    def _join(self) -> None:
        """Prefill the waiting requests and copy each into a free slot, ending at the current column."""
        new, prompts = [r for r, _ in self._waiting], [p for _, p in self._waiting]
        self._waiting = []
        past, mask_BW, next_pos_B, logits_BV = self.engine.prefill(prompts)
        layers, mask_BW = right_aligned(kv_layers(past), mask_BW)
        width = mask_BW.shape[1]
        if not self._kv:
            self._allocate(layers, logits_BV, width)
        free = [i for i, row in enumerate(self.slots) if row is None]
        if len(free) < len(new):
            self._grow_slots(len(new) - len(free))
            free = [i for i, row in enumerate(self.slots) if row is None]
        if width > self._cur:
            self._grow_columns(left=width - self._cur)
        if self._cur + 1 > self._mask_NS.shape[1]:
            self._grow_columns(right=1)
        slots = free[: len(new)]
        index = torch.tensor(slots, device=self.engine.device)
        lo = self._cur - width
        for (keys, values), (k_new, v_new) in zip(self._kv, layers):
            keys[index, :, lo : self._cur] = k_new
            values[index, :, lo : self._cur] = v_new
        self._mask_NS[index] = 0
        self._mask_NS[index, lo : self._cur] = mask_BW
        self._next_pos_N[index] = next_pos_B
        self._logits_NV[index] = logits_BV
        for slot, row, m in zip(slots, new, mask_BW.long().argmax(1).tolist()):
            self.slots[slot] = row
            self._start[slot] = lo + m

    def _allocate(self, layers, logits_BV: torch.Tensor, width: int) -> None:
        """Empty buffers for the first requests: as many slots, room for 64 steps on the right."""
        n, columns = len(layers[0][0]), width + 64
        self._kv = [(k.new_zeros((n, k.shape[1], columns, k.shape[3])), v.new_zeros((n, v.shape[1], columns, v.shape[3])))
                    for k, v in layers]
        self._mask_NS = torch.zeros((n, columns), dtype=torch.long, device=self.engine.device)
        self._mask_NS[:, width - 1] = 1  # a free slot sees one (zero) column: no empty softmax
        self._next_pos_N = torch.zeros(n, dtype=torch.long, device=self.engine.device)
        self._logits_NV = logits_BV.new_zeros((n, logits_BV.shape[1]))
        self.slots, self._start, self._cur = [None] * n, [width - 1] * n, width

    def _grow_slots(self, needed: int) -> None:
        """At least double the slots (new ones free)."""
        n = len(self.slots)
        extra = max(needed, n)
        self._kv = [(torch.cat([k, k.new_zeros((extra, *k.shape[1:]))]), torch.cat([v, v.new_zeros((extra, *v.shape[1:]))]))
                    for k, v in self._kv]
        mask = self._mask_NS.new_zeros((extra, self._mask_NS.shape[1]))
        mask[:, self._cur - 1] = 1
        self._mask_NS = torch.cat([self._mask_NS, mask])
        self._next_pos_N = torch.cat([self._next_pos_N, self._next_pos_N.new_zeros(extra)])
        self._logits_NV = torch.cat([self._logits_NV, self._logits_NV.new_zeros((extra, self._logits_NV.shape[1]))])
        self.slots += [None] * extra
        self._start += [self._cur - 1] * extra

    def _grow_columns(self, left: int = 0, right: int = 0) -> None:
        """Room for ``left`` more columns before the current one, or ``right`` more after it (256 spare)."""
        left = left + 256 if left else 0  # a copy of the whole buffer: with margin, it happens every few turns
        right = right + 256 if right else 0
        self._kv = [(pad_columns(k, left, right), pad_columns(v, left, right)) for k, v in self._kv]
        self._mask_NS = torch.nn.functional.pad(self._mask_NS, (left, right))
        self._cur += left
        self._start = [s + left for s in self._start]

    def _keep(self, alive: list[int]) -> None:
        """Only the slots ``alive``, and only the columns they use."""
        index = torch.tensor(alive, device=self.engine.device)
        lo = min(self._start[i] for i in alive)
        self._kv = [(k[index, :, lo:].contiguous(), v[index, :, lo:].contiguous()) for k, v in self._kv]
        self._mask_NS = self._mask_NS[index, lo:]
        self._next_pos_N = self._next_pos_N[index]
        self._logits_NV = self._logits_NV[index]
        self.slots = [self.slots[i] for i in alive]
        self._start = [self._start[i] - lo for i in alive]
        self._cur -= lo

    def _decode(self, token_N: torch.Tensor) -> None:
        if self._cur + 1 > self._mask_NS.shape[1]:
            self._grow_columns(right=1)
        lo = min(self._start[i] for i, row in enumerate(self.slots) if row is not None)
        self._mask_NS[:, self._cur] = 1
        past = kv_cache([(k[:, :, lo:], v[:, :, lo:]) for k, v in self._kv], length=self._cur - lo)
        out = self.engine.model(input_ids=token_N[:, None], attention_mask=self._mask_NS[:, lo : self._cur + 1],
                                position_ids=self._next_pos_N[:, None], past_key_values=past, use_cache=True)
        self._logits_NV = out.logits[:, -1].float()
        self._next_pos_N = self._next_pos_N + 1
        self._cur += 1
