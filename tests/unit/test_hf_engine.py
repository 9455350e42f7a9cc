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


# -- the stream (continuous batching) ---------------------------------------------------------
def _run_stream(stream, arrivals):
    """``arrivals[k]``: the (key, prompt, params) added before step k; steps until all finished."""
    out, k = {}, 0
    while stream or k < len(arrivals):
        for key, prompt, params in arrivals[k] if k < len(arrivals) else []:
            stream.add(key, prompt, params)
        k += 1
        out.update(stream.step())
    return out


def test_stream_rows_that_join_mid_flight_decode_exactly_as_alone(tokenizer, fmt, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer) + [list(range(5, 70))]
    budgets = [9, 3, 12, 6, 10]
    greedy = [SamplingParams(max_new_tokens=b, temperature=0, stop_token_ids=(fmt.im_end_id,)) for b in budgets]
    # Rows arrive at steps 0, 0, 2, 5 and 6: each joins a batch of another width and cache length.
    arrivals = [[(0, prompts[0], greedy[0]), (1, prompts[1], greedy[1])], [], [(2, prompts[2], greedy[2])], [], [],
                [(3, prompts[3], greedy[3])], [(4, prompts[4], greedy[4])]]
    stream = engine.stream()
    out = _run_stream(stream, arrivals)
    assert sorted(out) == [0, 1, 2, 3, 4] and len(stream) == 0
    for i, (prompt, params) in enumerate(zip(prompts, greedy)):
        alone = engine.generate([prompt], params)[0]
        assert out[i].response_ids == alone.response_ids and out[i].finish_reason == alone.finish_reason
        torch.testing.assert_close(torch.tensor(out[i].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert stream.row_steps > stream.steps  # rows shared steps


def test_stream_samples_are_reproducible_with_behaviour_logprobs(tokenizer, fmt, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, stop_token_ids=(fmt.im_end_id,))
    arrivals = [[(i, p, params)] for i, p in enumerate(prompts)]  # one joins per step
    first, again, other = (_run_stream(engine.stream(seed), arrivals) for seed in (3, 3, 4))
    assert {k: c.response_ids for k, c in first.items()} == {k: c.response_ids for k, c in again.items()}
    assert {k: c.response_ids for k, c in first.items()} != {k: c.response_ids for k, c in other.items()}
    for i, prompt in enumerate(prompts):
        completion = first[i]
        ids = prompt + completion.response_ids
        n = len(ids)
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, len(prompt) - 1 : n - 1]
        picked = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(completion.response_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(completion.logprobs), picked, atol=1e-4, rtol=0)


def test_stream_stop_strings_and_bad_requests(tokenizer, tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir)
    prompt = _prompts(tokenizer)[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0))[0]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    k = next(k for k in range(3, 16) if len(decode(free.response_ids[:k])) > len(decode(free.response_ids[: k - 1])))
    stop = decode(free.response_ids[:k])  # first completed by token k
    stream = engine.stream()
    stream.add("s", prompt, SamplingParams(max_new_tokens=16, temperature=0, stop=(stop,)))
    (key, completion), = _drain(stream).items()
    assert key == "s" and completion.finish_reason == "stop"
    assert completion.response_ids == free.response_ids[:k]
    with pytest.raises(ValueError, match="n=2"):
        stream.add("n", prompt, SamplingParams(max_new_tokens=4, n=2))
    with pytest.raises(ValueError, match="empty prompt"):
        stream.add("e", [], SamplingParams(max_new_tokens=4))


def _drain(stream):
    out = {}
    while stream:
        out.update(stream.step())
    return out


def test_prefix_cache_reuses_the_kv_of_prompts_that_a_prompt_extends(tokenizer, fmt, tiny_model_dir):
    cold = HFEngine.from_pretrained(tiny_model_dir)
    warm = HFEngine.from_pretrained(tiny_model_dir, prefix_cache_mb=16)
    base = [list(range(5, 40)), list(range(50, 90)), list(range(100, 120))]
    longer = [base[0] + [7, 8, 9], base[1] + list(range(3, 30)), list(range(200, 230)), base[2]]  # extends, extends, new, same
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    warm.generate(base, greedy)
    assert len(warm.prefixes) == 3 and warm.prefixes.hits == 0
    out = warm.generate(longer, greedy)
    assert warm.prefixes.hits == 3  # the new prompt had nothing to reuse
    assert warm.prefixes.reused_tokens == len(base[0]) + len(base[1]) + len(base[2]) - 1  # the same prompt: all but its last
    for got, want in zip(out, cold.generate(longer, greedy)):
        assert got.response_ids == want.response_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    # New weights make the cached KV stale: the cache is dropped.
    warm.update_weights({k: v + 0.01 for k, v in warm.state_dict().items() if k.endswith("norm.weight")})
    assert len(warm.prefixes) == 0


def test_prefix_cache_keeps_within_its_budget(tiny_model_dir):
    engine = HFEngine.from_pretrained(tiny_model_dir, prefix_cache_mb=0.05)  # ~52 KB: a few 40-token prompts
    for start in range(0, 2000, 40):
        engine.generate([list(range(start % 250 + 3, start % 250 + 43))], SamplingParams(max_new_tokens=1))
    assert 0 < len(engine.prefixes) < 50 and engine.prefixes._bytes <= 0.05 * 2**20


@pytest.mark.parametrize("cache_mb", [0, 16], ids=["cold", "prefix-cache"])
def test_a_prefill_over_its_score_budget_runs_in_chunks_with_the_same_results(tokenizer, fmt, tiny_model_dir, cache_mb):
    """A budget of 2,000 scores splits every prefill here into chunks of 1-3 columns (left padding
    leaves some rows all padding in a chunk); greedy tokens and logprobs, in ``generate`` and in
    a stream, equal those of one forward per prefill."""
    whole = HFEngine.from_pretrained(tiny_model_dir, prefix_cache_mb=cache_mb)
    chunked = HFEngine.from_pretrained(tiny_model_dir, prefix_cache_mb=cache_mb)
    chunked.max_prefill_scores = 2_000
    base = [list(range(5, 40)), list(range(50, 140)), [7, 8]]
    longer = [base[0] + [7, 8, 9], base[1] + list(range(3, 30)), list(range(200, 230)), base[2]]
    greedy = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(fmt.im_end_id,))
    for prompts in (base, longer):  # the second call reuses the first's KV where the cache is on
        before = chunked.prefill_forwards, whole.prefill_forwards
        for got, want in zip(chunked.generate(prompts, greedy), whole.generate(prompts, greedy)):
            assert got.response_ids == want.response_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
        assert whole.prefill_forwards - before[1] == 1
        assert chunked.prefill_forwards - before[0] >= 2
    stream = chunked.stream()
    for k, prompt in enumerate(longer):
        stream.add(k, prompt, greedy)
    out = _drain(stream)
    for k, prompt in enumerate(longer):
        assert out[k].response_ids == whole.generate([prompt], greedy)[0].response_ids


def test_stream_under_churn_grows_and_compacts_without_changing_any_result(fmt, tiny_model_dir):
    """40 requests of 3-150 prompt tokens joining at random steps: the buffer gains slots,
    room on the left (a prompt longer than any before) and on the right, and compacts when
    most slots are free; every greedy result still equals the request decoded alone."""
    import random

    engine = HFEngine.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    requests = [(k, [rng.randrange(3, 290) for _ in range(rng.choice([3, 20, 60, 150]))],
                 SamplingParams(max_new_tokens=rng.choice([1, 4, 30]), temperature=0)) for k in range(40)]
    arrivals = [[] for _ in range(60)]
    for request in requests:
        arrivals[0 if request[0] < 24 else rng.randrange(1, 60)].append(request)
    stream = engine.stream()
    out = _run_stream(stream, arrivals)
    assert sorted(out) == list(range(40))
    for key, prompt, params in requests:
        alone = engine.generate([prompt], params)[0]
        assert out[key].response_ids == alone.response_ids, key
        torch.testing.assert_close(torch.tensor(out[key].logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_scores_equal_a_plain_forwards_log_softmax(tokenizer, tiny_model_dir, packed):
    """The engine runs the LM head only at the scored positions; its full distributions are those
    of the model's own forward over every position (packed: with the branch mask)."""
    from opd.generation.base import branch_attention_mask

    engine = HFEngine.from_pretrained(tiny_model_dir)
    requests = []
    for prompt in _prompts(tokenizer):
        n = len(prompt)
        sources = list(range(n - 1))
        if packed and n >= 4:  # the last two tokens as two one-token branches at the same position
            positions, branches = list(range(n - 1)) + [n - 2], [0] * (n - 2) + [1, 2]
            sources = list(range(n - 2)) + [n - 3]  # both branches continue the trunk's last token
        else:
            positions, branches = list(range(n)), [0] * n
        requests.append(ScoreRequest(prompt, positions, branches, list(range(1, n)), sources))
    got = engine.score(requests, mode="full")
    for request, scores in zip(requests, got):
        ids_1L = torch.tensor([request.input_ids])
        with torch.no_grad():
            if packed:
                mask = branch_attention_mask(torch.tensor([request.branch_ids]), torch.ones_like(ids_1L, dtype=torch.bool))
                logits_LV = engine.model(input_ids=ids_1L, position_ids=torch.tensor([request.position_ids]),
                                         attention_mask=mask).logits[0]
            else:
                logits_LV = engine.model(input_ids=ids_1L).logits[0]
        expected_NV = torch.log_softmax(logits_LV[request.source_index].float(), -1)
        assert scores.full_logprobs.shape == expected_NV.shape
        torch.testing.assert_close(scores.full_logprobs, expected_NV, atol=1e-4, rtol=0)
        targets_N = torch.tensor([request.input_ids[j] for j in request.target_index])
        torch.testing.assert_close(torch.tensor(scores.logprobs), expected_NV.gather(1, targets_N[:, None]).squeeze(1),
                                   atol=1e-4, rtol=0)


def test_the_prefix_cache_finds_the_longest_cached_prompt_by_its_lengths_and_forgets_evicted_ones():
    from opd.generation.kv_cache import PrefixCache

    def kv(n):  # one layer's keys and values for n tokens: 2 heads x n x 4, 64 bytes a token
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]

    cache = PrefixCache(capacity_bytes=64 * 100)
    base = list(range(100, 140))
    for n in (16, 20, 30):
        cache.put(base[:n], kv(n))
    cache.put(list(range(200, 220)), kv(20))  # the same length, another prompt
    assert not cache.wants(base[:20]) and cache.wants(base[:25]) and not cache.wants(base[:5])
    assert cache.longest(base)[0] == 30
    assert cache.longest(base[:30])[0] == 29  # the last token is computed for its logits
    assert cache.longest(base[:25])[0] == 20
    assert cache.longest([7] + base) == (0, None)
    cache.put(base[:40], kv(40))  # over the budget: the least recently used go first
    assert len(cache) == 3 and cache._lengths == [20, 30, 40]  # the 16-token prompt and the other one went
    assert cache.longest(base[:18]) == (0, None) and cache.longest(list(range(200, 221))) == (0, None)
    assert cache.longest(base[:35])[0] == 30
    cache.clear()
    assert cache._lengths == [] and cache.longest(base) == (0, None)
