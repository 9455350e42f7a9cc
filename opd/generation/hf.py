"""The Hugging Face transformers engine: batched sampling with behaviour logprobs, packed
prefix-shared scoring, and in-place weight updates. The CPU default; it runs on GPU unchanged.

Sampling is a short explicit loop over a KV cache rather than ``model.generate``: the
behaviour logprobs must be those of the exact distribution sampled from (``generate``'s
default processors, such as a top-k of 50 from a model's generation config, would silently
change it), and a private ``torch.Generator`` makes a call reproducible without touching the
global RNG.

Continuous batching (``HFEngine.stream``) lives in :mod:`opd.generation.hf_stream`, the
growing KV cache and the prefix cache in :mod:`opd.generation.kv_cache`; both build on
:meth:`HFEngine.prefill`.

Example:
    >>> engine = HFEngine.from_pretrained("path/to/model")  # doctest: +SKIP
    >>> engine.score([request])  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from opd.generation.base import Completion, SamplingParams, ScoreRequest, TokenScores, scores_from_logprobs
from opd.generation.hf_stream import HFStream
from opd.generation.kv_cache import PrefixCache, kv_cache, kv_layers, pad_columns
from opd.generation.packed import causal_forward, head_hidden_at, packed_forward
from opd.models import load_model, load_tokenizer
from opd.trajectory import LinearHead, length_groups


class HFEngine:
    """One causal LM behind the engine contract (see :mod:`opd.generation.base`)."""

    def __init__(self, model, pad_id: int, max_batch_size: int = 64, device: str | None = None, tokenizer=None,
                 prefix_cache_mb: float = 0.0, max_prefill_scores: int = 2**26):
        """``max_prefill_scores``: the most attention scores (rows x heads x new columns x all
        columns) one prefill forward computes; a longer prefill runs in column chunks (see
        :meth:`prefill`). The default, 64M, is 256 MB of float32 scores a layer."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval()
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.max_prefill_scores = max_prefill_scores
        self.prefill_forwards = 0  # forwards run by prefill, chunks counted
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
        seeds = params.prompt_seeds(len(prompts))
        # One stream for the call, or (with params.seeds) one per request: its samples then do
        # not depend on the other prompts of the call.
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        prompts = [p for p in prompts for _ in range(params.n)]
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = slice(start, start + self.max_batch_size)
            own = None if seeds is None else [torch.Generator(device=self.device).manual_seed(s) for s in seeds[chunk]]
            out += self._generate_batch(prompts[chunk], params, own or generator)
        return out

    def _generate_batch(self, prompts, params: SamplingParams, generator) -> list[Completion]:
        """``generator``: one for the batch, or a list of one per row."""
        B = len(prompts)
        # Left padding keeps every row's next token in the last column.
        past, mask_BL, next_pos_B, logits_BV = self.prefill(prompts)
        past = kv_cache(kv_layers(past))  # appends in place
        stops = torch.tensor(sorted(params.stop_token_ids) or [-1], device=self.device)
        done_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logprobs = [], []
        next_pos_B1 = next_pos_B[:, None]
        for _ in range(params.max_new_tokens):
            temperature = params.temperature if params.temperature > 0 else 1.0
            logp_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
            if params.temperature > 0:
                if isinstance(generator, list):
                    probs_BV = logp_BV.exp()
                    token_B = torch.cat([torch.multinomial(probs_BV[b], 1, generator=g) for b, g in enumerate(generator)])
                else:
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

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompts through the model: ``(cache, mask_BS, next_position_B, logits_BV)``, next-token
        logits only. The first step of :meth:`generate` and of every join in an :class:`HFStream`.

        A row is ``[padding, reused prefix KV, padding, new tokens]``: the longest prompt in the
        prefix cache that starts this one is reused (at most all but the last token), and only
        the rest is computed; the attention mask hides both paddings. Each prompt's KV is then
        cached for the prompts that extend it (a multi-turn context grows by appending).

        The new columns go through the model in chunks, each of at most ``max_prefill_scores``
        attention scores (and as many mask entries): a forward's memory grows with rows x new
        columns x all columns, which for 48 prompts of 10k uncached tokens is tens of GB in one
        go. The chunks' results equal one forward's up to float rounding.

        Args:
            prompts: token ids, one non-empty list per row.

        Returns:
            ``cache``: per layer keys and values ``[B, heads, S, head_dim]`` (``S`` columns,
            padding included); ``mask_BS``: 1 on a row's real columns; ``next_position_B``: the
            position id of each row's next token (its prompt length); ``logits_BV``: float32
            logits of the next token.

        Example:
            >>> cache, mask_BS, next_pos_B, logits_BV = engine.prefill([[1, 2, 3], [4, 5]])  # doctest: +SKIP
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
        mask_BS, ids_BU, position_BU = mask_BS.to(self.device), ids_BU.to(self.device), position_BU.to(self.device)
        heads = getattr(self.model.config, "num_attention_heads", 1) or 1
        columns = max(1, self.max_prefill_scores // (B * heads * (P + U)))
        for start in range(0, U, columns):
            end = min(U, start + columns)
            out = self.model(input_ids=ids_BU[:, start:end], attention_mask=mask_BS[:, : P + end],
                             position_ids=position_BU[:, start:end], past_key_values=past, use_cache=True,
                             logits_to_keep=1)
            past = out.past_key_values
            if start == 0 and not P and end < U:  # room for the other chunks at once: no copy per chunk
                past = kv_cache([(pad_columns(k, 0, U - end), pad_columns(v, 0, U - end)) for k, v in kv_layers(past)],
                                length=end)
            self.prefill_forwards += 1
        if self.prefixes.capacity_bytes:
            layers = kv_layers(past)
            for i, (p, (n, _)) in enumerate(zip(prompts, hits)):
                if self.prefixes.wants(p):  # a row's real columns: its reused prefix, then its new tokens
                    real = slice(P + U - (len(p) - n), P + U)
                    self.prefixes.put(p, [(_joined(k[i], P - n, P, real), _joined(v[i], P - n, P, real))
                                          for k, v in layers])
        next_pos_B = torch.tensor([len(p) for p in prompts], device=self.device)
        return past, mask_BS, next_pos_B, out.logits[:, -1].float()

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
        plain = not branch_BL.any() and torch.equal(pos_BL, torch.arange(L).expand(B, L) * valid_BL)
        ids_BL = ids_BL.to(self.device)
        # The LM head only at the source positions: [N, V] logits, not [B, L, V].
        rows_N = torch.cat([torch.full((len(r.source_index),), i, dtype=torch.long) for i, r in enumerate(requests)])
        source_N = torch.cat([torch.tensor(r.source_index, dtype=torch.long) for r in requests])
        # No branches (single-turn rows, the full view): one causal forward, no packed layout.
        layout = (None, None) if plain else (pos_BL, branch_BL)
        found = head_hidden_at(self.model, ids_BL, valid_BL, rows_N.to(self.device), source_N.to(self.device),
                               *layout)
        if found is None:  # a head that is not a plain linear map: every position's logits
            if mode == "hidden":
                raise ValueError(f"scoring: hidden needs a teacher whose LM head is a plain linear map of its last "
                                 f"hidden state; {type(self.model).__name__}'s is not (soft-capped or scaled logits): "
                                 "use supervision.scoring: full")
            logits_BLV = (causal_forward(self.model, ids_BL, valid_BL) if plain
                          else packed_forward(self.model, ids_BL, pos_BL, branch_BL, valid_BL))
            logits_NV = logits_BLV[rows_N.to(self.device), source_N.to(self.device)]
            hidden_NH, head, vocab_size = logits_NV, (lambda x: x), logits_NV.shape[-1]
        else:
            hidden_NH, head, vocab_size = found
        # The LM head and the log-softmax a chunk of rows at a time (128 MiB of float32 rows): the
        # teacher never holds [N, V] for a whole forward's N, only what the mode returns.
        chunk = max(1, 2**25 // vocab_size)
        results, start = [], 0
        for i, r in enumerate(requests):
            n = len(r.source_index)
            hidden = hidden_NH[start : start + n]
            target_N = ids_BL[i, r.target_index]
            start += n
            parts = [scores_from_logprobs(torch.log_softmax(head(hidden[c : c + chunk]).float(), dim=-1),
                                          target_N[c : c + chunk], "sampled" if mode == "hidden" else mode, top_k)
                     for c in range(0, max(n, 1), chunk)]  # an empty request still answers
            scores = TokenScores.concat(parts)
            if mode == "hidden":  # full's distribution as the head's input, in the model's dtype
                scores.hidden = hidden.detach().cpu()
            results.append(scores)
        return results

    def output_head(self) -> LinearHead:
        """The LM head as :class:`~opd.trajectory.LinearHead` (a CPU copy): what turns the final
        hidden states of ``scoring: hidden`` into logits, sent to the trainer once per run."""
        head = self.model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(f"scoring: hidden needs an LM head that is a linear layer; {type(self.model).__name__}'s "
                             f"is a {type(head).__name__}: use supervision.scoring: full")
        bias = None if head.bias is None else head.bias.detach().cpu().clone()
        return LinearHead(head.weight.detach().cpu().clone(), bias)

    # -- weights ----------------------------------------------------------------------------
    partial_updates = True  # update_weights takes any subset of the weights (a LoRA student's adapted layers)

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the live model in place (same shapes, no reallocation); the
        weights not named keep their values."""
        # keep_vars: the live tensors, with tied weights (lm_head / embeddings) under both names.
        params = self.model.state_dict(keep_vars=True)
        missing = [name for name in state_dict if name not in params]
        if missing:
            raise KeyError(f"weights for unknown parameters: {missing[:5]}")
        copied: set[tuple[int, int]] = set()
        for name, value in state_dict.items():
            target = params[name]
            if (id(value), target.data_ptr()) in copied:  # a tied tensor, sent once under both names
                continue
            copied.add((id(value), target.data_ptr()))
            target.copy_(value.to(target.device, target.dtype))
        self.prefixes.clear()  # KV computed with the old weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


def _joined(x_HSD: torch.Tensor, start: int, end: int, new: slice) -> torch.Tensor:
    """Columns ``start:end`` (a reused prefix, none when equal) and then ``new`` of ``[H, S, D]``."""
    if start == end:
        return x_HSD[:, new]
    return torch.cat([x_HSD[:, start:end], x_HSD[:, new]], dim=1)
