"""The HF engine: behaviour logprobs, seeded sampling, left padding and in-place weight updates."""

from __future__ import annotations

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
        rescored = engine.score([request])[0]
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
