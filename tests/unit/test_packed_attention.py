"""Split attention on packed rows (trunk causal + branch rows) equals the one-mask forward."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from opd.generation import packed
from opd.generation.base import branch_attention_mask
from opd.supervision.teacher_view import pack_trajectory
from tests.unit.test_chat import ten_turn_trajectory


def _gqa_qwen3(vocab_size: int):
    """A tiny Qwen3 with grouped-query attention (4 query heads on 2 key/value heads), as the
    real students and teachers have."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).train()


def _batch(tokenizer, fmt):
    """Rows of a real packed layout (two views of a ten-turn episode: with branches and all
    trunk) and one row that is all padding but for one token."""
    traj = ten_turn_trajectory(tokenizer, fmt)
    requests = [pack_trajectory(traj, "state_grounded", fmt), pack_trajectory(traj, "full", fmt)]
    assert max(requests[0].branch_ids) > 0 and max(requests[1].branch_ids) == 0
    L = max(len(r.input_ids) for r in requests)
    ids, pos = torch.zeros(3, L, dtype=torch.long), torch.zeros(3, L, dtype=torch.long)
    branch, valid = torch.zeros(3, L, dtype=torch.long), torch.zeros(3, L, dtype=torch.bool)
    for i, r in enumerate(requests):
        n = len(r.input_ids)
        ids[i, :n], pos[i, :n] = torch.tensor(r.input_ids), torch.tensor(r.position_ids)
        branch[i, :n], valid[i, :n] = torch.tensor(r.branch_ids), True
    ids[2, 0], valid[2, 0] = 5, True
    return ids, pos, branch, valid


def _logits_and_grads(model, forward, valid):
    """Logits, and the gradients of a loss over the real (not padding) positions."""
    model.zero_grad()
    logits = forward().float()
    (logits.log_softmax(-1)[..., :7].mul(valid[..., None]).sum() / 1000).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_split_attention_gives_the_masked_forward_and_its_gradients(tokenizer, fmt):
    ids, pos, branch, valid = _batch(tokenizer, fmt)
    model = _gqa_qwen3(len(tokenizer))
    masked, masked_grads = _logits_and_grads(
        model, lambda: model(input_ids=ids, attention_mask=branch_attention_mask(branch, valid), position_ids=pos).logits, valid)
    # Padding positions are not part of the contract: zero them on both sides before comparing.
    split, split_grads = _logits_and_grads(model, lambda: packed.packed_forward(model, ids, pos, branch, valid), valid)
    keep = valid[..., None]
    assert torch.allclose(masked * keep, split * keep, atol=1e-5), (masked - split).abs().mul(keep).max()
    assert masked_grads.keys() == split_grads.keys()
    for name, grad in masked_grads.items():
        assert torch.allclose(grad, split_grads[name], atol=1e-6, rtol=1e-4), name
    assert model.config._attn_implementation == "sdpa", "the model's own attention is restored"


def test_the_split_path_runs_two_attention_calls_per_packed_row(tokenizer, fmt):
    """Not the masked fallback: per layer, a causal trunk call for each row with a trunk and a
    masked call for each row with branches (here 3 trunks, 1 row with branches, 2 layers)."""
    ids, pos, branch, valid = _batch(tokenizer, fmt)
    model = _gqa_qwen3(len(tokenizer)).eval()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with mock.patch.object(packed.F, "scaled_dot_product_attention", wraps=sdpa) as spy, torch.no_grad():
        packed.packed_forward(model, ids, pos, branch, valid)
    causal = [c for c in spy.call_args_list if c.kwargs.get("is_causal")]
    masked = [c for c in spy.call_args_list if c.kwargs.get("attn_mask") is not None]
    assert (len(causal), len(masked)) == (2 * 3, 2 * 1)
    n_branch = int((branch[0] > 0).sum())
    assert all(c.args[0].shape[2] == n_branch for c in masked)  # only branch queries pay for the mask


def test_attention_is_restored_when_the_forward_fails(tokenizer, fmt):
    ids, pos, branch, valid = _batch(tokenizer, fmt)
    model = _gqa_qwen3(len(tokenizer))
    with pytest.raises(IndexError):
        packed.packed_forward(model, ids + len(tokenizer), pos, branch, valid)  # ids past the vocabulary
    assert model.config._attn_implementation == "sdpa"


class _DropsKeywords(torch.nn.Module):
    """A model whose forward does not pass extra keyword arguments on (as some model classes
    do not), so the packed layout never reaches its attention."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, **unused):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_a_model_that_drops_the_layout_gets_the_masked_forward(tokenizer, fmt, caplog):
    ids, pos, branch, valid = _batch(tokenizer, fmt)
    model = _gqa_qwen3(len(tokenizer)).eval()
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=branch_attention_mask(branch, valid), position_ids=pos).logits
        with caplog.at_level("WARNING", logger="opd.generation.packed"):
            fallback = packed.packed_forward(_DropsKeywords(model), ids, pos, branch, valid)
    keep = valid[..., None]
    assert torch.allclose(masked * keep, fallback * keep, atol=1e-6)
    assert "one-mask forward" in caplog.text


def test_right_padded_rows_run_causal_without_the_padding_mask(tokenizer, fmt):
    """Plain rows of different lengths: the logits and gradients at valid positions are the
    masked forward's, and attention runs causal with no mask (the fast path)."""
    ids = torch.randint(5, len(tokenizer), (3, 40))
    valid = torch.arange(40) < torch.tensor([[40], [23], [1]])
    model = _gqa_qwen3(len(tokenizer))
    masked, masked_grads = _logits_and_grads(model, lambda: model(input_ids=ids, attention_mask=valid.long()).logits, valid)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", wraps=sdpa) as spy:
        fast, fast_grads = _logits_and_grads(model, lambda: packed.causal_forward(model, ids, valid), valid)
    keep = valid[..., None]
    assert torch.allclose(masked * keep, fast * keep, atol=1e-5), (masked - fast).abs().mul(keep).max()
    for name, grad in masked_grads.items():
        assert torch.allclose(grad, fast_grads[name], atol=1e-6, rtol=1e-4), name
    assert len(spy.call_args_list) == 2  # one per layer
    assert all(c.kwargs.get("attn_mask") is None and c.kwargs.get("is_causal") for c in spy.call_args_list)


def test_left_padded_rows_keep_the_padding_mask(tokenizer, fmt):
    ids = torch.randint(5, len(tokenizer), (2, 30))
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :12] = False  # left padding: a valid query would see it without the mask
    model = _gqa_qwen3(len(tokenizer)).eval()
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=valid.long()).logits
        plain = model(input_ids=ids).logits
        got = packed.causal_forward(model, ids, valid)
    keep = valid[..., None]
    assert torch.allclose(masked * keep, got * keep, atol=1e-6)
    assert not torch.allclose(masked * keep, plain * keep, atol=1e-3)  # the mask matters here
