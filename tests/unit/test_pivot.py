"""Pivot finding: the judge's prompt, the judgement parser (with a fuzzer), the heuristics and
the pivot statistics."""

from __future__ import annotations

import inspect
import json
import math
import random

import pytest

from opd.supervision.pivot import (
    MAX_ACTION_CHARS,
    Judgement,
    PivotStats,
    judge_messages,
    judge_prompt_ids,
    parse_judgement,
    pivot_by_expert,
    pivot_by_max_kl,
    pivot_by_min_logprob,
)
from opd.supervision.pivot import _parse  # the parser without its last-resort guard

NAN = float("nan")
CANONICAL = '{"pivot_turn": 2, "gold_action": "go to drawer 1", "recovery_actions": ["open drawer 1", "take key 1 from drawer 1"]}'
EXPECTED = Judgement(2, "go to drawer 1", ("open drawer 1", "take key 1 from drawer 1"))


def test_public_signatures_are_pinned():
    assert list(inspect.signature(judge_messages).parameters) == ["task", "steps", "recovery_turns"]
    assert list(inspect.signature(judge_prompt_ids).parameters) == ["fmt", "tokenizer", "task", "steps", "recovery_turns"]
    assert list(inspect.signature(parse_judgement).parameters) == ["text", "num_turns", "recovery_turns"]
    assert list(inspect.signature(pivot_by_expert).parameters) == ["actions", "expert_actions", "normalise"]
    assert [f for f in Judgement.__dataclass_fields__] == ["pivot_turn", "gold_action", "recovery_actions"]


# --- parsing: accepted formats -------------------------------------------------------------

@pytest.mark.parametrize("text", [
    CANONICAL,
    f"```json\n{CANONICAL}\n```",
    f"```\n{CANONICAL}\n```\nThe agent should have searched the drawer first.",
    f"<think>\nTurn 0 looks fine. {{not json}} Turn 2 walked away.\n</think>\nHere is my verdict: {CANONICAL}",
    f"Looking at the transcript, turn 2 is where it failed.\n\n{CANONICAL}\n",
    CANONICAL.replace('"pivot_turn": 2', '"pivot_turn": "2"'),
    CANONICAL.replace('"pivot_turn": 2', '"Pivot_Turn": " 2 "'),
    '{"pivot": 2, "gold": "  go to drawer 1 ", "recovery": "open drawer 1 | take key 1 from drawer 1"}',
    "PIVOT: 2\nGOLD: go to drawer 1\nRECOVERY: open drawer 1 | take key 1 from drawer 1",
    "<think>hmm</think>\n**Pivot turn:** 2\n**Gold action:** `go to drawer 1`\n- recovery: open drawer 1 | take key 1 from drawer 1\n",
    "pivot_turn = turn 2.\ngold_action = \"go to drawer 1\"\nrecovery_actions = open drawer 1|take key 1 from drawer 1",
])
def test_parse_accepts_canonical_and_variants(text):
    assert parse_judgement(text, num_turns=5, recovery_turns=3) == EXPECTED


def test_parse_prefers_the_last_valid_object_and_skips_invalid_ones():
    draft = '{"pivot_turn": 0, "gold_action": "look"}'
    invalid = '{"pivot_turn": 9, "gold_action": "inventory"}'
    assert parse_judgement(f"First guess {draft}. Final: {CANONICAL} {invalid}", 5, 3) == EXPECTED
    # A JSON answer beats the line format; the line format is only a fallback.
    assert parse_judgement(f"PIVOT: 4\nGOLD: look\n{CANONICAL}", 5, 3) == EXPECTED


def test_parse_truncates_recovery_and_long_actions():
    text = json.dumps({"pivot_turn": 1, "gold_action": "x" * 500 + "   ", "recovery_actions": ["a", "b", "c", "d"]})
    judgement = parse_judgement(text, num_turns=3, recovery_turns=2)
    assert judgement == Judgement(1, "x" * MAX_ACTION_CHARS, ("a", "b"))
    assert parse_judgement(text, num_turns=3, recovery_turns=0).recovery_actions == ()
    # Recovery stops at the first empty action; missing recovery is none.
    gap = json.dumps({"pivot_turn": 1, "gold_action": "go", "recovery_actions": ["a", "  ", "c"]})
    assert parse_judgement(gap, 3, 3).recovery_actions == ("a",)
    assert parse_judgement('{"pivot_turn": 0, "gold_action": "go"}', 1, 3) == Judgement(0, "go", ())
    assert parse_judgement("PIVOT: 0\nGOLD: go\nRECOVERY: none", 1, 3) == Judgement(0, "go", ())


def test_parse_edges_of_the_turn_range():
    assert parse_judgement('{"pivot_turn": 4, "gold_action": "go"}', 5, 2).pivot_turn == 4
    assert parse_judgement('{"pivot_turn": 0, "gold_action": "go"}', 5, 2).pivot_turn == 0


# --- parsing: rejections --------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "",
    "   \n",
    "I cannot tell which turn was the mistake.",
    '{"pivot_turn": 5, "gold_action": "go"}',  # out of range for 5 turns
    '{"pivot_turn": -1, "gold_action": "go"}',
    '{"pivot_turn": "-1", "gold_action": "go"}',
    '{"pivot_turn": 2, "recovery_actions": ["a"]}',  # no gold action
    '{"pivot_turn": 2, "gold_action": "   "}',
    '{"pivot_turn": 2, "gold_action": null}',
    '{"pivot_turn": 2, "gold_action": 7}',
    '{"pivot_turn": 2.0, "gold_action": "go"}',
    '{"pivot_turn": "2.0", "gold_action": "go"}',
    '{"pivot_turn": "two", "gold_action": "go"}',
    '{"pivot_turn": true, "gold_action": "go"}',
    '{"pivot_turn": NaN, "gold_action": "go"}',
    '{"pivot_turn": [2], "gold_action": "go"}',
    '{"pivot_turn": "٢", "gold_action": "go"}',  # a non-ASCII digit
    '{"pivot_turn": 2, "gold_action": "go", "recovery_actions": ["a", 3]}',
    '{"pivot_turn": 2, "gold_action": "go", "recovery_actions": {"a": 1}}',
    '{"gold_action": "go"}',
    '{"pivot_turn": 2, "gold_action": "go"',  # truncated
    f'<think>the pivot is... {CANONICAL}',  # cut off while thinking
    "PIVOT: 7\nGOLD: go",
    "PIVOT: 2.5\nGOLD: go",
    "PIVOT: 2\nGOLD:",
    "GOLD: go\nRECOVERY: a | b",
])
def test_parse_rejects(text):
    assert parse_judgement(text, num_turns=5, recovery_turns=2) is None


def test_parse_rejects_non_strings_without_raising():
    for value in (None, b'{"pivot_turn": 1}', 3, ["x"]):
        assert parse_judgement(value, 5, 2) is None  # type: ignore[arg-type]


# --- parsing: fuzz --------------------------------------------------------------------------

_VALID_ANSWERS = [
    CANONICAL,
    f"```json\n{CANONICAL}\n```",
    f"<think>turn 2 was bad</think>\nVerdict:\n{CANONICAL}",
    "PIVOT: 2\nGOLD: go to drawer 1\nRECOVERY: open drawer 1 | take key 1 from drawer 1",
    '{"pivot": "3", "gold": "open fridge", "recovery": "take apple | close fridge"}',
]
_INJECTIONS = [
    "NaN", "Infinity", "-Infinity", "-1", "1e999", "0x10", "9" * 5000, "{" * 3000, "[" * 5000,
    '{"a":' * 2000, '"pivot_turn": ' + "9" * 400, "x" * 60_000, "</think>", "<think>", "```", "\x00",
    "\u200b", "\ufeff", "\ud800", "🙂" * 50, "ß̶͟", "\r\n", "\t", "PIVOT: 1\n", "GOLD: \n", "|" * 100,
    '"gold_action": ' + json.dumps("y" * 1000), '"recovery_actions": [' + ",".join(['"r"'] * 500) + "]",
    "\\", '\\"', "null", "true", "[]", "{}", ":", ",",
]
_CHARS = '{}[]":,\\ \n\t|0123456789-.eE' + "abcxyzPIVOTGOLD" + "\x00\x01\x1b\x7f" + "é漢🙂\u2028\ud800"


def _mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randint(0, len(text))
        if op == 0 and text:  # delete a run
            text = text[:i] + text[i + rng.randint(1, 8):]
        elif op == 1:  # insert characters
            text = text[:i] + "".join(rng.choice(_CHARS) for _ in range(rng.randint(1, 5))) + text[i:]
        elif op == 2 and len(text) > 1:  # swap two neighbours
            i = min(i, len(text) - 2)
            text = text[:i] + text[i + 1] + text[i] + text[i + 2:]
        elif op == 3:  # truncate
            text = text[:i]
        elif op == 4:  # inject a nasty token
            text = text[:i] + rng.choice(_INJECTIONS) + text[i:]
        else:  # duplicate a slice
            j = rng.randint(i, len(text))
            text = text[:j] + text[i:j] + text[j:]
    return text


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    return [
        lambda: rng.randint(-10, 10),
        lambda: rng.choice([NAN, math.inf, 2.0, 1e300, 10 ** 30]),
        lambda: "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 12))),
        lambda: str(rng.randint(-3, 12)),
        lambda: rng.choice([None, True, False]),
        lambda: " " * rng.randint(0, 3) + "go north" + " " * rng.randint(0, 3),
        lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))],
        lambda: {"pivot_turn": _random_value(rng, depth + 1)},
        lambda: [rng.choice(["a", " b ", "", "c" * 300]) for _ in range(rng.randint(0, 6))],
    ][kind]()


def _random_judgement_json(rng: random.Random) -> str:
    keys = ["pivot_turn", "gold_action", "recovery_actions", "pivot", "gold", "recovery", "PIVOT_TURN", "other"]
    obj = {"pivot_turn": rng.randint(0, 4), "gold_action": "go north", "recovery_actions": ["open door", "go east"]}
    for _ in range(rng.randint(0, 3)):  # replace or add a field: most objects end up invalid
        obj[rng.choice(keys)] = _random_value(rng)
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5)  # allow_nan: NaN/Infinity literals appear


def _check_invariants(result, num_turns: int, recovery_turns: int) -> None:
    if result is None:
        return
    assert isinstance(result, Judgement)
    assert type(result.pivot_turn) is int and 0 <= result.pivot_turn < num_turns
    for action in (result.gold_action, *result.recovery_actions):
        assert type(action) is str and action and action == action.strip() and len(action) <= MAX_ACTION_CHARS
    assert isinstance(result.recovery_actions, tuple) and len(result.recovery_actions) <= recovery_turns


def test_parse_survives_fuzzing():
    rng = random.Random(1234)
    parsed = 0
    cases = 10_000
    for case in range(cases):
        source = case % 3
        if source == 0:
            text = _mutate(rng.choice(_VALID_ANSWERS), rng)
        elif source == 1:
            text = _mutate(_random_judgement_json(rng), rng) if rng.random() < 0.5 else _random_judgement_json(rng)
        else:
            text = "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 200)))
        num_turns, recovery_turns = rng.choice([0, 1, 3, 5, 8, 8]), rng.randint(0, 4)
        result = _parse(text, num_turns, recovery_turns)  # unguarded: an exception fails the test
        assert parse_judgement(text, num_turns, recovery_turns) == result
        _check_invariants(result, num_turns, recovery_turns)
        parsed += result is not None
    # The fuzzer must exercise both outcomes, not only reject everything.
    assert 1000 < parsed < cases - 1000, parsed


@pytest.mark.parametrize("text", [
    "{" * 200_000,
    '{"a":' * 100_000,
    "[" * 200_000 + CANONICAL,
    '{"pivot_turn": ' + "9" * 100_000 + ', "gold_action": "go"}',
    '{"x": "' + "a" * 1_000_000,
    "PIVOT: " + "1" * 100_000 + "\nGOLD: go",
    "*" * 200_000 + "PIVOT",
    "<think>" + "x" * 1_000_000 + "</think>" + CANONICAL,
])
@pytest.mark.timeout(60)  # a parser that backtracks or recurses on these would take hours or crash, not seconds
def test_parse_is_safe_on_huge_inputs(text):
    result = _parse(text, num_turns=5, recovery_turns=3)
    assert result in (None, EXPECTED)


def test_parse_reads_an_answer_after_a_huge_reasoning_block():
    assert parse_judgement("<think>" + "x" * 1_000_000 + "</think>" + CANONICAL, 5, 3) == EXPECTED


# --- heuristics -----------------------------------------------------------------------------

def test_pivot_by_min_logprob():
    assert pivot_by_min_logprob([-0.5, -3.0, -1.0]) == 1
    assert pivot_by_min_logprob([-2.0, -5.0, -5.0, -1.0]) == 1  # tie: the earliest turn
    assert pivot_by_min_logprob([NAN, -1.0, NAN, -0.5]) == 1  # NaN is skipped
    assert pivot_by_min_logprob([-1.0, -math.inf, -2.0]) == 1  # an impossible action is the pivot
    assert pivot_by_min_logprob([NAN, NAN]) is None
    assert pivot_by_min_logprob([]) is None
    assert pivot_by_min_logprob([0.0]) == 0


def test_pivot_by_max_kl():
    assert pivot_by_max_kl([0.1, 0.4, 2.5, 0.3]) == 2
    assert pivot_by_max_kl([0.0, 1.0, 1.0]) == 1  # tie: the earliest turn
    assert pivot_by_max_kl([NAN, 0.2, NAN, 0.1]) == 1
    assert pivot_by_max_kl([0.0, 0.0]) == 0
    assert pivot_by_max_kl([NAN]) is None
    assert pivot_by_max_kl([]) is None


def test_pivot_by_expert():
    actions = ["go north", "Open Door.", "take key", "go west"]
    assert pivot_by_expert(actions, ["go north", "open  door", "take lamp", "go east"]) == 2
    assert pivot_by_expert(actions, [None, None, "take key", "go east"]) == 3  # None turns are skipped
    assert pivot_by_expert(actions, ["go north", "open door", "take key", "go west"]) is None
    assert pivot_by_expert(actions, [None] * 4) is None
    assert pivot_by_expert([], []) is None
    # The comparison is the caller's to define.
    assert pivot_by_expert(actions, ["go north", "open door", "take key", "go west"], normalise=str) == 1
    with pytest.raises(ValueError, match="3 actions but 2 expert actions"):
        pivot_by_expert(["a", "b", "c"], ["a", "b"])


# --- statistics -----------------------------------------------------------------------------

def test_pivot_stats_metrics():
    assert PivotStats().as_metrics() == {
        "pivot/found_rate": 0.0, "pivot/mean_turn": 0.0,
        "pivot/judge_parse_failure_rate": 0.0, "pivot/expert_agreement": 0.0,
    }
    stats = PivotStats()
    stats.record(2, judge_parsed=True, expert_turn=2)  # judge agrees with the expert
    stats.record(4, judge_parsed=False, expert_turn=1)  # judge failed, heuristic found 4; expert says 1
    stats.record(None, judge_parsed=False)  # nothing found
    stats.record(3, expert_turn=None)  # heuristic only, no expert disagreement to compare with
    assert (stats.failures, stats.pivots_found, stats.judged, stats.judge_parse_failures) == (4, 3, 3, 2)
    assert (stats.pivot_turn_sum, stats.expert_comparable, stats.expert_agreements) == (9, 2, 1)
    assert stats.as_metrics() == {
        "pivot/found_rate": 0.75,
        "pivot/mean_turn": 3.0,
        "pivot/judge_parse_failure_rate": 2 / 3,
        "pivot/expert_agreement": 0.5,
    }


# --- the judge's prompt ---------------------------------------------------------------------

STEPS = [
    ("go to cabinet 1", "You arrive at cabinet 1. It is closed."),
    ("open cabinet 1", "You open cabinet 1. It is empty."),
    ("go to fridge 1", "Nothing happens."),
]


def test_judge_messages_holds_the_transcript_and_the_format():
    task = "Your task is to: put a cool apple in the microwave."
    text = judge_messages(task, STEPS, recovery_turns=2)
    assert task in text
    cursor = text.index(task)
    for i, (action, observation) in enumerate(STEPS):  # every step, in order, numbered from 0
        cursor = text.index(f"[turn {i}] action: {action}", cursor)
        cursor = text.index(f"[turn {i}] observation: {observation}", cursor)
    assert '"pivot_turn": <integer from 0 to 2>' in text and '"gold_action"' in text
    assert "up to 2 actions" in text
    assert '"recovery_actions": []' in judge_messages(task, STEPS, recovery_turns=0)
    # An answer in the format the prompt shows parses.
    answer = '{"pivot_turn": 2, "gold_action": "go to countertop 1", "recovery_actions": ["take apple 1"]}'
    assert parse_judgement(answer, len(STEPS), 2) == Judgement(2, "go to countertop 1", ("take apple 1",))


def test_judge_prompt_ids_is_one_user_message_then_the_assistant_header(tokenizer, fmt):
    task = "Reach the goal without falling into a hole."
    ids = judge_prompt_ids(fmt, tokenizer, task, STEPS, recovery_turns=2)
    content = tokenizer.encode(judge_messages(task, STEPS, 2), add_special_tokens=False)
    assert ids == fmt.message_ids("user", content) + fmt.assistant_header_ids()
    assert tokenizer.decode(content) == judge_messages(task, STEPS, 2)
