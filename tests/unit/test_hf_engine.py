"""The HF engine: behaviour logprobs, seeded sampling, left padding and in-place weight updates."""

from __future__ import annotations

import pytest
import torch

from opd.generation.base import SamplingParams, ScoreRequest
from opd.generation.hf import HFEngine


def _prompts(tokenizer):
    texts = ["Reach G without stepping on H.", "S F\nF G", "up", "Invalid action 'x'. Answer with one of: left"]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_behaviour_logprobs_match_rescoring_despite_left_padding(tokenizer, fmt, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(fmt.im_end_id,), seed=1))
    for prompt, completion in zip(prompts, out):
        ids = prompt + completion.response_ids
        n = len(ids)
        request = ScoreRequest(ids, list(range(n)), [0] * n, list(range(len(prompt), n)), list(range(len(prompt) - 1, n - 1)))
        rescored = engine.score([request])[0].logprobs
        assert len(completion.logprobs) == len(completion.response_ids) >= 1
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(rescored), atol=1e-4, rtol=0)
        if completion.finish_reason == "stop":
            assert completion.response_ids[-1] == fmt.im_end_id
        else:
            assert len(completion.response_ids) == 6


def test_seeded_sampling_is_reproducible_and_seed_sensitive(tokenizer, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer)
    run = lambda seed: [c.response_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=seed))]  # noqa: E731
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_greedy_picks_the_argmax(tokenizer, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompt = _prompts(tokenizer)[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0))[0]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt])).logits[0, -1]
    assert out.response_ids == [int(logits.argmax())]
    assert out.logprobs[0] == torch.log_softmax(logits, -1).max().item()


def test_update_weights_in_place(tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    before = engine.state_dict()
    target = {k: v + 0.01 for k, v in before.items()}
    pointer = engine.model.model.embed_tokens.weight.data_ptr()
    engine.update_weights(target)
    after = engine.state_dict()
    assert all(torch.equal(after[k], target[k]) for k in target)
    assert engine.model.model.embed_tokens.weight.data_ptr() == pointer  # no reallocation


@pytest.mark.parametrize("temperature", [0.7, 0.05])
def test_trainer_logprobs_at_the_rollout_temperature_equal_behaviour_logprobs(tokenizer, fmt, tiny_model_dir, temperature):
    """The importance ratio pi_S / mu is 1 on policy only if the trainer scores at the sampling
    temperature: checked on real samples, including the very peaked 0.05."""
    from opd.models import load_model
    from opd.trajectory import TokenBatch
    from opd.training.trainer import student_logprobs

    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=temperature, stop_token_ids=(fmt.im_end_id,), seed=3))
    rows = [{"input_ids": p + c.response_ids, "attention_mask": [1] * (len(p) + len(c.response_ids)),
             "loss_mask": [0.0] * len(p) + [1.0] * len(c.response_ids)} for p, c in zip(prompts, out)]
    batch = TokenBatch.from_rows(rows, fmt.pad_id)
    picked_BT, full_BTV = student_logprobs(load_model(tiny_model_dir), batch, temperature)
    for i, (p, c) in enumerate(zip(prompts, out)):
        got = picked_BT[i, len(p) : len(p) + len(c.response_ids)]
        torch.testing.assert_close(got, torch.tensor(c.logprobs), atol=2e-4, rtol=0)
    assert torch.isfinite(full_BTV).all()
    torch.testing.assert_close(full_BTV[:, 1:].exp().sum(-1), torch.ones_like(full_BTV[:, 1:, 0]), atol=1e-4, rtol=0)


def test_stop_strings_end_each_response_at_the_completing_token(tokenizer, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer) * 4
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=3))
    texts = [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in free]
    stop = max({t[i : i + 2] for t in texts for i in range(len(t) - 1)},
               key=lambda s: sum(s in t for t in texts))  # the commonest pair of characters
    out = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=3, stop=(stop,)))
    stopped = 0
    for before, after in zip(free, out):
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        # Same seed, same samples up to the stop: the stopped response is a prefix of the free one.
        assert after.response_ids == before.response_ids[: len(after.response_ids)]
        assert after.logprobs == before.logprobs[: len(after.logprobs)]
        if after.finish_reason == "stop":
            stopped += 1
            assert stop in decode(after.response_ids) and stop not in decode(after.response_ids[:-1])
        else:
            assert stop not in decode(after.response_ids) and len(after.response_ids) == 24
    assert stopped >= 2


def test_stop_strings_need_a_tokenizer(tokenizer, fmt, tiny_model_dir):
    engine = HFEngine(HFEngine.from_pretrained(tiny_model_dir).model, pad_id=fmt.pad_id)
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=4, stop=("up",)))
