"""bench/decision_probe.py: the sequence it rebuilds from stored trajectories and where it probes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from opd.chat import standard_prompt_ids

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("decision_probe", ROOT / "bench" / "decision_probe.py")
decision_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decision_probe)


def _turn(tokenizer, fmt, observation: str, action: str, first: bool) -> dict:
    """A turn as the trajectory parquet stores it: the prompt's text, the response's ids, the action."""
    prompt = tokenizer.decode(standard_prompt_ids(fmt, tokenizer, observation, first=first))
    response = tokenizer.encode(f"<think> State: {observation} Plan: {action}. </think> {action}<|im_end|>",
                                add_special_tokens=False)
    return {"prompt": prompt, "response_ids": response, "action": action}


def test_probes_sit_just_before_each_plans_first_word(tokenizer, fmt):
    observations = ["Around you: left wall, down F.", "Around you: up H, right F.", "Around you: down G."]
    actions = ["down right", "right", "up down"]
    turns = [_turn(tokenizer, fmt, o, a, k == 0) for k, (o, a) in enumerate(zip(observations, actions))]
    ids, probes = decision_probe.episode_probes(turns, tokenizer, fmt)

    plan_ids = tokenizer.encode(" Plan:", add_special_tokens=False)
    assert [word for _, word in probes] == ["down", "right", "up"]
    for pos, word in probes:
        assert ids[pos - len(plan_ids) + 1:pos + 1] == plan_ids
        assert ids[pos + 1] == tokenizer.encode(" " + word, add_special_tokens=False)[0]
    # The rebuilt sequence is the rollout's: each stored prompt, then its response, in order.
    text = tokenizer.decode(ids)
    for turn in turns:
        assert turn["prompt"] in text
    assert text.index(turns[1]["prompt"]) > text.index(" Plan: down right.")
    assert probes[0][0] < probes[1][0] < probes[2][0] < len(ids) - 1
