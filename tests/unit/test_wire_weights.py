"""Weights cross Ray's object store as out-of-band buffers (``opd.models.WireWeights``): pickled
with protocol 5, as Ray pickles, the tensors' bytes go out of band once each (a tie once), the
pickle itself stays small, and what arrives equals what left, dtype for dtype."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from opd.models import WireWeights, cpu_copy


def test_weights_travel_out_of_band_and_arrive_equal():
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(300, 64, generator=gen)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed,  # tied: one tensor, two names
             "layer.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
             "layer.bias": torch.randn(64, generator=gen).to(torch.float16),
             "norm.weight": torch.randn(64, generator=gen)}
    wire = WireWeights(cpu_copy(state))
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    distinct = [embed, state["layer.weight"], state["layer.bias"], state["norm.weight"]]
    assert sorted(b.raw().nbytes for b in buffers) == sorted(t.numel() * t.element_size() for t in distinct)
    assert len(payload) < 2_000  # names and dtypes: the bytes went out of band
    back = pickle.loads(payload, buffers=buffers)
    assert type(back) is dict and list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]  # still tied
    # The received tensors are views of the buffers, not copies.
    starts = {np.frombuffer(b.raw(), dtype=np.uint8).ctypes.data for b in buffers}
    assert {back[name].data_ptr() for name in state} == starts


def test_teacher_scores_cross_as_out_of_band_arrays_and_arrive_equal():
    """:class:`TokenScores`' tensors go to the trainer as protocol-5 buffers (not torch.save bytes)."""
    import pickle

    from opd.generation.base import TokenScores

    scores = TokenScores([-0.5, -1.0], topk_ids=torch.tensor([[3, 4], [5, 6]]), topk_logprobs=torch.randn(2, 2),
                         tail_logprob=torch.randn(2), full_logprobs=torch.randn(2, 320).to(torch.bfloat16))
    buffers: list = []
    data = pickle.dumps(scores, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 4 and len(data) < 1_000  # the four tensors out of band
    back = pickle.loads(data, buffers=buffers)
    assert back.logprobs == scores.logprobs and back.hidden is None
    for name in ("topk_ids", "topk_logprobs", "tail_logprob", "full_logprobs"):
        assert getattr(back, name).dtype == getattr(scores, name).dtype
        assert torch.equal(getattr(back, name), getattr(scores, name))
