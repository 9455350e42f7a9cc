"""The Hugging Face transformers engine: batched sampling with behaviour logprobs, packed
prefix-shared scoring, and in-place weight updates. The CPU default; it runs on GPU unchanged.

Sampling is a short explicit loop over a KV cache rather than ``model.generate``: the
behaviour logprobs must be those of the exact distribution sampled from (``generate``'s
default processors, such as a top-k of 50 from a model's generation config, would silently
change it), and a private ``torch.Generator`` makes a call reproducible without touching the
global RNG.

Example:
    >>> engine = HFEngine.from_pretrained("path/to/model")  # doctest: +SKIP
    >>> engine.score([request])  # doctest: +SKIP
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from opd.generation.base import Completion, SamplingParams, ScoreRequest, TokenScores, scores_from_logprobs
from opd.generation.packed import packed_forward
from opd.models import load_model, load_tokenizer
from opd.trajectory import length_groups


class HFEngine:
    """One causal LM behind the engine contract (see :mod:`opd.generation.base`)."""

    def __init__(self, model, pad_id: int, max_batch_size: int = 64, device: str | None = None, tokenizer=None,
                 prefix_cache_mb: float = 0.0):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval()
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.tokenizer = tokenizer  # only stop strings need it (generation is ids in, ids out)
        self.prefixes = PrefixCache(int(prefix_cache_mb * 2**20))

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", trust_remote_code: bool = False,
                        prefix_cache_mb: float = 0.0) -> "HFEngine":
        model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
        pad = model.config.pad_token_id
        if pad is None:
            pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
        return cls(model, pad_id=pad, tokenizer=load_tokenizer(path, trust_remote_code), prefix_cache_mb=prefix_cache_mb)

    # -- generation -------------------------------------------------------------------------
    def stream(self, seed: int = 0) -> "HFStream":
        """Continuous batching over one KV cache (see :class:`HFStream`), sampled with ``seed``."""
        return HFStream(self, seed)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer: build it with HFEngine.from_pretrained "
                             "or pass tokenizer=")
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        prompts = [p for p in prompts for _ in range(params.n)]
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            out += self._generate_batch(prompts[start : start + self.max_batch_size], params, generator)
        return out

    def _generate_batch(self, prompts, params: SamplingParams, generator) -> list[Completion]:
        B = len(prompts)
        # Left padding keeps every row's next token in the last column.
        past, mask_BL, next_pos_B, logits_BV = self._prefill(prompts)
        past = kv_cache(_layers(past))  # appends in place
        stops = torch.tensor(sorted(params.stop_token_ids) or [-1], device=self.device)
        done_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logprobs = [], []
        next_pos_B1 = next_pos_B[:, None]
        for _ in range(params.max_new_tokens):
            temperature = params.temperature if params.temperature > 0 else 1.0
            logp_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
            if params.temperature > 0:
                token_B = torch.multinomial(logp_BV.exp(), 1, generator=generator).squeeze(1)
            else:
                token_B = logp_BV.argmax(-1)
            token_B = torch.where(done_B, torch.full_like(token_B, self.pad_id), token_B)
            tokens.append(token_B)
            logprobs.append(logp_BV.gather(1, token_B[:, None]).squeeze(1))
            tokens_done = torch.isin(token_B, stops)
            if params.stop:
                tokens_done |= self._stop_strings_hit(tokens, done_B, params.stop)
            finished_now = ~done_B & tokens_done
            done_B = done_B | finished_now
            if bool(done_B.all()):
                break
            mask_BL = torch.cat([mask_BL, torch.ones((B, 1), dtype=torch.long, device=self.device)], dim=1)
            out = self.model(
                input_ids=token_B[:, None],
                attention_mask=mask_BL,
                position_ids=next_pos_B1,
                past_key_values=past,
                use_cache=True,
            )
            past, logits_BV = out.past_key_values, out.logits[:, -1].float()
            next_pos_B1 = next_pos_B1 + 1
        return self._collect(tokens, logprobs, set(params.stop_token_ids), B, params.stop)

    def _prefill(self, prompts: list[list[int]]):
        """Prompts through the model: ``(cache, mask_BS, next_position_B, logits_BV)``, next-token
        logits only.

        A row is ``[padding, reused prefix KV, padding, new tokens]``: the longest prompt in the
        prefix cache that starts this one is reused (at most all but the last token), and only
        the rest is computed; the attention mask hides both paddings. Each prompt's KV is then
        cached for the prompts that extend it (a multi-turn context grows by appending).
        """
        hits = [self.prefixes.longest(p) for p in prompts]
        P = max(n for n, _ in hits)
        U = max(len(p) - n for p, (n, _) in zip(prompts, hits))
        B = len(prompts)
        ids_BU = torch.full((B, U), self.pad_id, dtype=torch.long)
        position_BU = torch.zeros((B, U), dtype=torch.long)
        mask_BS = torch.zeros((B, P + U), dtype=torch.long)
        for i, (p, (n, _)) in enumerate(zip(prompts, hits)):
            suffix = p[n:]
            ids_BU[i, U - len(suffix) :] = torch.tensor(suffix)
            position_BU[i, U - len(suffix) :] = torch.arange(n, len(p))
            mask_BS[i, P - n : P] = 1
            mask_BS[i, P + U - len(suffix) :] = 1
        past = None
        if P:
            layers = []
            reused = next(kv for _, kv in hits if kv is not None)
            for layer in range(len(reused)):
                shape = reused[layer][0].shape  # [H, L, D]
                keys = torch.empty((B, shape[0], P + U, shape[2]), dtype=self.prefixes.dtype, device=self.device)
                values = torch.empty_like(keys)
                keys[:, :, :P], values[:, :, :P] = 0.0, 0.0
                for i, (n, kv) in enumerate(hits):
                    if n:
                        keys[i, :, P - n : P] = kv[layer][0][:, :n]
                        values[i, :, P - n : P] = kv[layer][1][:, :n]
                layers.append((keys, values))
            past = kv_cache(layers, length=P)  # the new tokens are written into the room after P
        mask_BS = mask_BS.to(self.device)
        out = self.model(input_ids=ids_BU.to(self.device), attention_mask=mask_BS, position_ids=position_BU.to(self.device),
                         past_key_values=past, use_cache=True, logits_to_keep=1)
        if self.prefixes.capacity_bytes:
            real_BS = mask_BS.bool()
            layers = _layers(out.past_key_values)
            for i, p in enumerate(prompts):
                self.prefixes.put(p, [(k[i][:, real_BS[i]], v[i][:, real_BS[i]]) for k, v in layers])
        next_pos_B = torch.tensor([len(p) for p in prompts], device=self.device)
        return out.past_key_values, mask_BS, next_pos_B, out.logits[:, -1].float()

    def _stop_strings_hit(self, tokens: list[torch.Tensor], done_B: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """``[B]`` True where a live row's text so far contains a stop string."""
        token_BN = torch.stack(tokens, 1).tolist()
        hit = [not done and any(s in self.tokenizer.decode(row, skip_special_tokens=True) for s in stop)
               for row, done in zip(token_BN, done_B.tolist())]
        return torch.tensor(hit, device=self.device)

    def _collect(self, tokens, logprobs, stops: set[int], B: int, stop: tuple[str, ...] = ()) -> list[Completion]:
        token_BN = torch.stack(tokens, 1).tolist()
        logp_BN = torch.stack(logprobs, 1).tolist()
        results = []
        for i in range(B):
            ids, lps, reason = [], [], "length"
            for tok, lp in zip(token_BN[i], logp_BN[i]):
                ids.append(tok)
                lps.append(lp)
                if tok in stops or (stop and any(s in self.tokenizer.decode(ids, skip_special_tokens=True) for s in stop)):
                    reason = "stop"
                    break
            results.append(Completion(response_ids=ids, logprobs=lps, finish_reason=reason))
        return results

    # -- scoring ----------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, requests: list[ScoreRequest], batch_size: int = 16, mode: str = "sampled",
              top_k: int = 0, batch_tokens: int = 0) -> list[TokenScores]:
        """Scores of each request's targets (see :class:`TokenScores`), always at temperature 1:
        the teacher's own distribution is the target, whatever temperature the student samples at.

        A forward takes at most ``batch_size`` requests of similar lengths and, with
        ``batch_tokens > 0``, at most that many padded tokens (see :func:`length_groups`)."""
        results: list[TokenScores | None] = [None] * len(requests)
        for group in length_groups([len(r.input_ids) for r in requests], batch_size, batch_tokens):
            for i, scores in zip(group, self._score_batch([requests[i] for i in group], mode, top_k)):
                results[i] = scores
        return results  # type: ignore[return-value]

    def _score_batch(self, requests: list[ScoreRequest], mode: str, top_k: int) -> list[TokenScores]:
        B = len(requests)
        L = max(len(r.input_ids) for r in requests)
        ids_BL = torch.full((B, L), self.pad_id, dtype=torch.long)
        pos_BL = torch.zeros((B, L), dtype=torch.long)
        branch_BL = torch.zeros((B, L), dtype=torch.long)
        valid_BL = torch.zeros((B, L), dtype=torch.bool)
        for i, r in enumerate(requests):
            n = len(r.input_ids)
            ids_BL[i, :n] = torch.tensor(r.input_ids)
            pos_BL[i, :n] = torch.tensor(r.position_ids)
            branch_BL[i, :n] = torch.tensor(r.branch_ids)
            valid_BL[i, :n] = True
        logits_BLV = packed_forward(self.model, ids_BL.to(self.device), pos_BL, branch_BL, valid_BL)
        results = []
        for i, r in enumerate(requests):
            source = torch.tensor(r.source_index, dtype=torch.long, device=self.device)
            target = ids_BL[i, r.target_index].to(self.device)
            logp_NV = torch.log_softmax(logits_BLV[i, source].float(), dim=-1)
            results.append(scores_from_logprobs(logp_NV, target, mode, top_k))
        return results

    # -- weights ----------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the live model in place (same shapes, no reallocation)."""
        # keep_vars: the live tensors, with tied weights (lm_head / embeddings) under both names.
        params = self.model.state_dict(keep_vars=True)
        missing = [name for name in state_dict if name not in params]
        if missing:
            raise KeyError(f"weights for unknown parameters: {missing[:5]}")
        for name, value in state_dict.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
        self.prefixes.clear()  # KV computed with the old weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


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
        past, mask_BW, next_pos_B, logits_BV = self.engine._prefill(prompts)
        layers, mask_BW = _right_aligned(_layers(past), mask_BW)
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
        self._kv = [(_pad_columns(k, left, right), _pad_columns(v, left, right)) for k, v in self._kv]
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


def _pad_columns(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``[N, heads, S, head_dim]`` with ``left`` / ``right`` zero columns added."""
    return torch.nn.functional.pad(x, (0, 0, left, right))


def _right_aligned(layers, mask_BS: torch.Tensor):
    """Each row's cached positions moved to the right end, in order, padding first; the
    columns that are padding in every row dropped. (A prefill with a reused prefix leaves a
    gap between the prefix and the new tokens; closing it keeps later steps narrow.)"""
    order_BS = torch.sort(mask_BS, dim=1, stable=True).indices  # padding (0) first, then the positions in order
    width = int(mask_BS.sum(1).max())
    order_BS = order_BS[:, mask_BS.shape[1] - width :]
    index = order_BS[:, None, :, None]
    moved = [(k.gather(2, index.expand(-1, k.shape[1], -1, k.shape[3])),
              v.gather(2, index.expand(-1, v.shape[1], -1, v.shape[3]))) for k, v in layers]
    return moved, mask_BS.gather(1, order_BS)


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
        self._bytes = 0
        self.dtype = torch.float32
        self.hits = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def longest(self, prompt: list[int]) -> tuple[int, list | None]:
        """``(n, kv)``: the longest cached prompt that starts ``prompt``, usable for its first
        ``n`` tokens (at most ``len(prompt) - 1``: the last token is computed for its logits);
        ``(0, None)`` when none. A linear scan of the entries (hundreds at most for the
        default budget and a tiny model; a trie would scale further)."""
        best = None
        for key in reversed(self._entries):
            if len(key) <= len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[: len(key)]) == key:
                best = key
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        n = min(len(best), len(prompt) - 1)
        if n <= 0:
            return 0, None
        self.hits += 1
        self.reused_tokens += n
        return n, self._entries[best]

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
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= _nbytes(old)


def _nbytes(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
