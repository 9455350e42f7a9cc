"""The engine contract shared by every inference backend.

An engine holds one model and answers three calls, all in token ids (no text crosses it):

- ``generate(prompts, params)``: sample a response for each prompt, with the behaviour logprob
  of every sampled token (needed for the importance ratio of the policy-gradient losses).
- ``score(requests, mode, top_k)``: logprobs of given tokens under given contexts, at
  temperature 1, plus the top-k (``topk``) or the whole distribution (``full``) at each of
  those positions. A request is a *packed* sequence: a trunk with branches that only see the
  trunk before them, so the turns of one trajectory share their common prefix in one forward.
- ``update_weights(state_dict)``: load new weights in place (the trainer's after an update).

Example:
    >>> engine = make_engine("hf", "path/to/model")  # doctest: +SKIP
    >>> out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))  # doctest: +SKIP
    >>> out[0].response_ids, out[0].logprobs  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Hashable
from typing import Protocol

import torch

from opd.schema import SCORING_MODES
from opd.wire import from_wire, to_wire


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: response budget.
        temperature: 0 for greedy; the behaviour logprobs are of softmax(logits / temperature)
            (temperature 1 when greedy).
        stop_token_ids: a response ends right after one of these (it is kept in the response).
        seed: seeds the sampler; the same prompts, params and weights give the same samples.
        seeds: one seed per prompt, in place of ``seed``: each prompt samples from its own
            stream, so its samples do not depend on which other prompts share the call (how a
            step's episodes stay the same whatever the number of rollout replicas).
        n: samples per prompt; ``generate`` returns them prompt-major (``n`` per prompt in a row).
        stop: strings that end a response once its decoded text (special tokens skipped)
            contains one; the response ends with the token that completes it (kept, like a stop
            token, so the ids stay exactly as sampled; its text may run past the string).
    """

    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None

    def prompt_seeds(self, prompts: int) -> list[int] | None:
        """Each of the ``prompts * n`` requests' own seed (prompt-major), or ``None`` without
        :attr:`seeds`."""
        if self.seeds is None:
            return None
        if len(self.seeds) != prompts:
            raise ValueError(f"SamplingParams.seeds has {len(self.seeds)} seeds for {prompts} prompts")
        return [s * 7919 + j if self.n > 1 else s for s in self.seeds for j in range(self.n)]


@dataclass
class Completion:
    """One sampled response: ids, per-token behaviour logprobs, ``stop`` or ``length``."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class ScoreRequest:
    """A packed sequence to score in one forward.

    Token ``i`` attends to token ``j <= i`` when ``branch_ids[j] == 0`` (the trunk) or
    ``branch_ids[j] == branch_ids[i]`` (its own branch). ``position_ids`` restart each branch
    where it leaves the trunk, so a branch is scored exactly as if it followed its trunk prefix
    alone. The answer is ``log p(input_ids[target_index[k]] | ...)`` read from the logits at
    ``source_index[k]``.
    """

    input_ids: list[int]
    position_ids: list[int]
    branch_ids: list[int]
    target_index: list[int]
    source_index: list[int]


@dataclass
class TokenScores:
    """The teacher's scores at the ``N`` target positions of one request.

    Attributes:
        logprobs: ``[N]`` log p(target token): every mode.
        topk_ids, topk_logprobs: ``[N, K]`` the ``K`` most likely ids and their logprobs (``topk``).
        tail_logprob: ``[N]`` log of the mass outside the top-k (``topk``; ``-inf`` if none).
        full_logprobs: ``[N, V]`` the log-softmax over the vocabulary (``full``).
        hidden: ``[N, H]`` the final hidden states that predict the targets (``hidden``): the
            LM head's input, from which the trainer computes ``full``'s distribution with the
            teacher's head (sent once per run, :meth:`opd.generation.hf.HFEngine.output_head`).
    """

    logprobs: list[float]
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    tail_logprob: torch.Tensor | None = None
    full_logprobs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @staticmethod
    def concat(parts: list["TokenScores"]) -> "TokenScores":
        """The scores of consecutive targets, joined (each part with the same fields)."""
        if len(parts) == 1:
            return parts[0]

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return TokenScores([x for p in parts for x in p.logprobs], cat("topk_ids"), cat("topk_logprobs"),
                           cat("tail_logprob"), cat("full_logprobs"), cat("hidden"))

    def __reduce__(self):
        """Pickled with its tensors as numpy arrays (:mod:`opd.wire`): out of band, no copy, through
        Ray's object store from the teacher to the trainer."""
        tensors = (self.topk_ids, self.topk_logprobs, self.tail_logprob, self.full_logprobs, self.hidden)
        return (_scores_from_wire, (self.logprobs, [None if t is None else to_wire(t) for t in tensors]))

    def nbytes(self) -> int:
        """Size of the payload that crosses to the trainer."""
        tensors = (self.topk_ids, self.topk_logprobs, self.tail_logprob, self.full_logprobs, self.hidden)
        return 4 * len(self.logprobs) + sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _scores_from_wire(logprobs: list[float], tensors: list) -> TokenScores:
    return TokenScores(logprobs, *(None if t is None else from_wire(*t) for t in tensors))


def scores_from_logprobs(logp_NV: torch.Tensor, target_N: torch.Tensor, mode: str, top_k: int) -> TokenScores:
    """:class:`TokenScores` from the teacher's log-softmax at the target positions (temperature 1)."""
    picked = logp_NV.gather(1, target_N[:, None]).squeeze(1).tolist()
    if mode == "sampled":
        return TokenScores(picked)
    if mode == "full":
        return TokenScores(picked, full_logprobs=logp_NV.cpu())
    if mode != "topk":
        raise ValueError(f"unknown scoring mode {mode!r}; expected one of {SCORING_MODES}")
    values_NK, ids_NK = logp_NV.topk(min(top_k, logp_NV.shape[-1]), dim=-1)
    # The tail from the remaining entries themselves, not as 1 - sum(top-k): no cancellation.
    tail_N = logp_NV.scatter(1, ids_NK, float("-inf")).logsumexp(-1)
    return TokenScores(picked, topk_ids=ids_NK.cpu(), topk_logprobs=values_NK.cpu(), tail_logprob=tail_N.cpu())


class GenerationStream(Protocol):
    """Continuous batching: requests join and leave between decode steps.

    ``add`` queues a request (it joins the batch at the next ``step``); ``step`` runs one
    decode step over every live request and returns those that finished in it, as
    ``(key, completion)``; ``len`` counts the requests not yet returned. A request's tokens
    are sampled as by ``generate`` (same params, behaviour logprobs, stop rules). ``steps``
    and ``row_steps`` count the steps run and, summed over them, the requests in the batch.
    """

    steps: int
    row_steps: int

    def add(self, key: Hashable, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[tuple[Hashable, Completion]]: ...

    def __len__(self) -> int: ...


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def stream(self, seed: int = 0) -> GenerationStream: ...

    def score(self, requests: list[ScoreRequest], batch_size: int = 16, mode: str = "sampled", top_k: int = 0,
              batch_tokens: int = 0) -> list[TokenScores]: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def branch_attention_mask(branch_ids_BL: torch.Tensor, valid_BL: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` boolean mask (True = attend) for packed trunk+branch sequences.

    Padding rows attend to themselves only, so no softmax row is empty.
    """
    L = branch_ids_BL.shape[1]
    causal_LL = torch.tril(torch.ones(L, L, dtype=torch.bool, device=branch_ids_BL.device))
    key_B1L = branch_ids_BL[:, None, :]
    query_BL1 = branch_ids_BL[:, :, None]
    visible_BLL = (key_B1L == 0) | (key_B1L == query_BL1)
    mask_BLL = causal_LL[None] & visible_BLL & valid_BL[:, None, :] & valid_BL[:, :, None]
    mask_BLL |= torch.eye(L, dtype=torch.bool, device=branch_ids_BL.device)[None]
    return mask_BLL[:, None]

