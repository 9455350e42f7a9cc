"""The engine contract shared by every inference backend.

An engine holds one model and answers three calls, all in token ids (no text crosses it):

- ``generate(prompts, params)``: sample a response for each prompt, with the behaviour logprob
  of every sampled token (needed for the importance ratio of the policy-gradient losses).
- ``score(requests)``: logprobs of given tokens under given contexts, at temperature 1. A
  request is a *packed* sequence: a trunk with branches that only see the trunk before them,
  so the turns of one trajectory share their common prefix in a single forward.
- ``update_weights(state_dict)``: load new weights in place (the trainer's after an update).

Example:
    >>> engine = make_engine("hf", "path/to/model")  # doctest: +SKIP
    >>> out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))  # doctest: +SKIP
    >>> out[0].response_ids, out[0].logprobs  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: response budget.
        temperature: 0 for greedy; the behaviour logprobs are of softmax(logits / temperature)
            (temperature 1 when greedy).
        stop_token_ids: a response ends right after one of these (it is kept in the response).
        seed: seeds the sampler; the same prompts, params and weights give the same samples.
    """

    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


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
    meta: dict = field(default_factory=dict)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def score(self, requests: list[ScoreRequest]) -> list[list[float]]: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def branch_attention_mask(branch_ids_BL: torch.Tensor, valid_BL: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` boolean mask (True = attend) for packed trunk+branch sequences.

    Padding rows attend to themselves only, so no softmax row is empty.
    """
    L = branch_ids_BL.shape[1]
    causal_LL = torch.tril(torch.ones(L, L, dtype=torch.bool))
    key_B1L = branch_ids_BL[:, None, :]
    query_BL1 = branch_ids_BL[:, :, None]
    visible_BLL = (key_B1L == 0) | (key_B1L == query_BL1)
    mask_BLL = causal_LL[None] & visible_BLL & valid_BL[:, None, :] & valid_BL[:, :, None]
    mask_BLL |= torch.eye(L, dtype=torch.bool)[None]
    return mask_BLL[:, None]
