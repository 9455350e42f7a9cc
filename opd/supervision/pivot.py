"""Finding the pivotal mistake of a failed episode: the teacher as judge, or a heuristic.

PivotOPD trains hardest on the turn where a failed episode went wrong (the *pivot*) and on the
``k`` turns after it. The pivot comes from one of two sources:

- **Teacher as judge.** :func:`judge_messages` writes the state-grounded transcript (the task,
  then each turn's executed action and observation, no reasoning) and asks for a JSON answer;
  :func:`parse_judgement` reads back a :class:`Judgement` (pivot turn, gold action, recovery
  actions) or ``None``. The parser never raises: a malformed answer is a ``None`` that the
  algorithm counts (:class:`PivotStats`) and replaces with a heuristic.
- **Heuristics.** :func:`pivot_by_min_logprob` (the executed action the teacher finds least
  likely), :func:`pivot_by_max_kl` (the turn where the per-turn KL peaks) and
  :func:`pivot_by_expert` (the first turn where the environment's expert would have acted
  differently). Ties go to the earliest turn: the first of equally suspicious turns is the one
  the later turns inherit.

Departures from the paper: the judge's answer format is ours (one JSON object, with a
``PIVOT:`` / ``GOLD:`` / ``RECOVERY:`` line format accepted as a fallback), and turns are numbered
from 0 in the transcript so the judge's index is the trajectory's turn index.

Example:
    >>> steps = [("go north", "You see a door."), ("open chest", "It is locked.")]
    >>> prompt = judge_messages("Find the key.", steps, recovery_turns=2)
    >>> "[turn 1] action: open chest" in prompt
    True
    >>> answer = ('<think>north was fine</think> {"pivot_turn": 1, "gold_action": "open door", '
    ...           '"recovery_actions": ["go east", "take key", "go west"]}')
    >>> parse_judgement(answer, num_turns=2, recovery_turns=2)
    Judgement(pivot_turn=1, gold_action='open door', recovery_actions=('go east', 'take key'))
    >>> parse_judgement("I am not sure.", num_turns=2, recovery_turns=2) is None
    True
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opd.chat import ChatFormat, first_prompt_ids

MAX_ACTION_CHARS = 200
"""Longer gold or recovery actions are cut to this many characters (a hint, not an essay)."""

_MAX_ANSWER_CHARS = 50_000  # the judge's answer after its reasoning; the rest is ignored
_MAX_JSON_ATTEMPTS = 64  # '{' positions tried, bounding the work on adversarial text
_TURN_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII only: int() would also take '٣' and '1_0'
_LINE = re.compile(
    r"^[ \t*#>-]*(pivot(?:[ _]turn)?|gold(?:[ _]action)?|recovery(?:[ _]actions)?)[ \t*]*[:=][ \t*]*(.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_LINE_TURN = re.compile(r"(?:turn[ \t]*)?#?([0-9]{1,9})(?![0-9]|\.[0-9])", re.IGNORECASE)
_NO_RECOVERY = {"", "none", "n/a", "-", "[]"}
_KEYS = {
    "pivot_turn": "pivot_turn", "pivot": "pivot_turn", "pivot turn": "pivot_turn",
    "gold_action": "gold_action", "gold": "gold_action", "gold action": "gold_action",
    "recovery_actions": "recovery_actions", "recovery": "recovery_actions", "recovery actions": "recovery_actions",
}


@dataclass(frozen=True)
class Judgement:
    """The teacher's verdict on one failed episode.

    Attributes:
        pivot_turn: 0-based index of the turn with the pivotal mistake, in ``[0, num_turns)``.
        gold_action: what the agent should have done at ``pivot_turn`` (stripped, non-empty, at
            most :data:`MAX_ACTION_CHARS` characters).
        recovery_actions: actions for the turns ``pivot_turn + 1, pivot_turn + 2, ...``, at most
            ``recovery_turns`` of them (possibly none), each as clean as ``gold_action``.
    """

    pivot_turn: int
    gold_action: str
    recovery_actions: tuple[str, ...]


def hint_text(pivot_turn: int, gold_action: str, recovery_action: str) -> str:
    """The line PivotOPD appends to a recovery turn's observation for the hinted self-teacher.

    Example:
        >>> hint_text(2, "down", "right")
        'Hint: at turn 2 the right action was down. Now do: right'
    """
    return f"Hint: at turn {pivot_turn} the right action was {gold_action}. Now do: {recovery_action}"


def judge_messages(task: str, steps: list[tuple[str, str]], recovery_turns: int) -> str:
    """The user message the judge reads: a failed episode's state-grounded transcript and the
    answer format.

    Args:
        task: the task text (the episode's first observation).
        steps: ``(action, observation)`` of each turn, in order; turn ``i`` is ``steps[i]``.
        recovery_turns: ``k``, the number of recovery actions asked for after the pivot.

    Returns:
        The message text; :func:`parse_judgement` reads the answer it asks for.
    """
    lines = [
        "An agent failed the task below. Find its pivotal mistake: the earliest turn whose action "
        "made the failure likely and that a better action at that turn would have avoided.",
        "",
        "## Task",
        task.strip(),
        "",
        f"## Transcript ({len(steps)} turns, numbered from 0)",
    ]
    for i, (action, observation) in enumerate(steps):
        lines += [f"[turn {i}] action: {action.strip()}", f"[turn {i}] observation: {observation.strip()}"]
    last = max(len(steps) - 1, 0)
    if recovery_turns > 0:
        recovery = (f'"recovery_actions": [<up to {recovery_turns} actions for the turns right after '
                    "the pivot, in order>]")
    else:
        recovery = '"recovery_actions": []'
    lines += [
        "",
        "## Answer",
        "Reply with this JSON object and nothing else; write each action exactly as the agent "
        "would send it to the environment:",
        f'{{"pivot_turn": <integer from 0 to {last}>, "gold_action": "<the action the agent should '
        f'have taken at the pivot turn>", {recovery}}}',
    ]
    return "\n".join(lines)


def judge_prompt_ids(fmt: ChatFormat, tokenizer, task: str, steps: list[tuple[str, str]],
                     recovery_turns: int) -> list[int]:
    """The judge's prompt as ChatML ids: the :func:`judge_messages` user message, then the
    assistant header that opens the answer."""
    return first_prompt_ids(fmt, tokenizer, judge_messages(task, steps, recovery_turns))


def parse_judgement(text: str, num_turns: int, recovery_turns: int) -> Judgement | None:
    """Read the judge's answer; ``None`` when it holds no valid judgement. Never raises.

    The answer is what follows the last ``</think>`` (an unclosed ``<think>`` means the judge was
    cut off while reasoning: ``None``). In it, the last JSON object that makes a valid judgement
    wins (inside a code fence or prose, keys case-insensitive, ``pivot``/``gold``/``recovery``
    accepted as short keys); failing that, ``PIVOT: 3`` / ``GOLD: open door`` /
    ``RECOVERY: go east | take key`` lines (the last of each key).

    Rules:
        - ``pivot_turn`` is an int (or a string of ASCII digits) in ``[0, num_turns)``; bools,
          floats, negatives and numerals like ``"3.0"`` are refused.
        - ``gold_action`` is a non-empty string; whitespace and wrapping quotes or backticks are
          stripped and it is cut to :data:`MAX_ACTION_CHARS`.
        - ``recovery_actions`` is a list of strings or one ``|``-separated string, missing means
          none; it stops at the first empty action (the ones after it would no longer line up
          with their turns) and is cut to ``recovery_turns``. A non-string entry refuses the
          object.

    Args:
        text: the judge's decoded answer (any string).
        num_turns: the number of turns of the judged episode.
        recovery_turns: ``k``, the most recovery actions kept.
    """
    try:
        return _parse(text, num_turns, recovery_turns)
    except Exception:  # noqa: BLE001 - a last guard (the fuzz test runs _parse unguarded): a judge's
        return None  # answer must never stop training, and a None is counted as a parse failure


def _parse(text: str, num_turns: int, recovery_turns: int) -> Judgement | None:
    answer = _answer_part(text)
    if answer is None:
        return None
    found = None
    for obj in _json_objects(answer):
        found = _from_fields(obj, num_turns, recovery_turns) or found
    return found or _from_fields(_line_fields(answer), num_turns, recovery_turns)


def _answer_part(text: str) -> str | None:
    if not isinstance(text, str):
        return None
    close = text.rfind("</think>")
    if close >= 0:
        text = text[close + len("</think>"):]
    elif "<think>" in text:
        return None
    return text[:_MAX_ANSWER_CHARS]


def _json_objects(text: str):
    """The JSON objects embedded in ``text``, in order (outermost only)."""
    decoder = json.JSONDecoder()
    start, attempts = text.find("{"), 0
    while start >= 0 and attempts < _MAX_JSON_ATTEMPTS:
        attempts += 1
        try:
            obj, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):  # not JSON here, too deep, or an oversized integer
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            yield obj
        start = text.find("{", end)


def _line_fields(text: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for match in _LINE.finditer(text):
        key = _KEYS[" ".join(match.group(1).lower().replace("_", " ").split())]
        value = match.group(2).strip()
        if key == "pivot_turn":
            turn = _LINE_TURN.match(value)
            fields[key] = turn.group(1) if turn else None
        elif key == "recovery_actions":
            fields[key] = [] if value.lower() in _NO_RECOVERY else value
        else:
            fields[key] = value
    return fields


def _from_fields(obj: dict, num_turns: int, recovery_turns: int) -> Judgement | None:
    fields = {}
    for key, value in obj.items():
        name = _KEYS.get(" ".join(key.lower().replace("_", " ").split())) if isinstance(key, str) else None
        if name is not None:
            fields[name] = value
    turn = _as_turn(fields.get("pivot_turn"))
    if turn is None or not 0 <= turn < num_turns:
        return None
    gold = _clean_action(fields.get("gold_action"))
    if not gold:
        return None
    raw = fields.get("recovery_actions", [])
    if isinstance(raw, str):
        raw = raw.split("|")
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        return None
    recovery = []
    for action in raw[: max(recovery_turns, 0)]:
        action = _clean_action(action)
        if not action:
            break
        recovery.append(action)
    return Judgement(turn, gold, tuple(recovery))


def _as_turn(value: Any) -> int | None:
    if isinstance(value, bool):  # bool is an int subclass; "true" is no turn
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _TURN_DIGITS.fullmatch(value.strip()):
        return int(value.strip())
    return None


def _clean_action(value: Any) -> str:
    if not isinstance(value, str):
        return ""
    action = value.strip()
    while len(action) >= 2 and action[0] == action[-1] and action[0] in "`\"'":
        action = action[1:-1].strip()
    return action[:MAX_ACTION_CHARS].strip()


def pivot_by_min_logprob(action_logprobs: Sequence[float]) -> int | None:
    """The turn whose executed action the teacher finds least likely.

    Args:
        action_logprobs: per turn, the sum of the teacher's logprobs of the action's tokens.
            NaN entries (a turn that could not be scored) are skipped.

    Returns:
        The argmin (the earliest on a tie), or ``None`` when there is no number to compare.
    """
    return _arg_best(action_logprobs, lower=True)


def pivot_by_max_kl(turn_kl: Sequence[float]) -> int | None:
    """The turn where the per-turn KL estimate (student to teacher) peaks; NaN entries are
    skipped, the earliest turn wins a tie, ``None`` when there is no number to compare."""
    return _arg_best(turn_kl, lower=False)


def _arg_best(values: Sequence[float], lower: bool) -> int | None:
    best, best_value = None, 0.0
    for i, value in enumerate(values):
        value = float(value)
        if math.isnan(value):
            continue
        if best is None or (value < best_value if lower else value > best_value):
            best, best_value = i, value
    return best


def _normalise_action(action: str) -> str:
    """Case, runs of whitespace and a trailing full stop do not make two actions differ."""
    return " ".join(action.lower().split()).rstrip(".").rstrip()


def pivot_by_expert(actions: Sequence[str], expert_actions: Sequence[str | None],
                    normalise: Callable[[str], str] = _normalise_action) -> int | None:
    """The first turn whose executed action differs from the environment expert's.

    Args:
        actions: the executed action of each turn.
        expert_actions: the expert's action at the state each turn acted in: the
            ``expert_action`` of the info returned by the ``reset`` (turn 0) or ``step`` (turn
            ``i``: ``turns[i - 1].info``) that led to it. ``None`` where the expert offers none;
            such turns are skipped.
        normalise: maps an action to the form in which two actions are compared.

    Returns:
        The turn index, or ``None`` when the episode agrees with the expert wherever it speaks.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(actions) != len(expert_actions):
        raise ValueError(f"pivot_by_expert got {len(actions)} actions but {len(expert_actions)} expert actions; "
                         "pass one expert action (or None) per turn.")
    for i, (action, expert) in enumerate(zip(actions, expert_actions)):
        if expert is not None and normalise(action) != normalise(expert):
            return i
    return None


@dataclass
class PivotStats:
    """Pivot-finding counts over one training step, and their rates as metrics.

    Attributes:
        failures: failed episodes examined.
        pivots_found: of those, episodes given a pivot (by the judge or by a fallback heuristic).
        judged: judge answers read.
        judge_parse_failures: judge answers with no valid judgement.
        pivot_turn_sum: sum of the pivot turns found.
        expert_comparable: episodes with a pivot and an expert disagreement to compare it with.
        expert_agreements: of those, episodes whose pivot is the first expert disagreement.

    Example:
        >>> stats = PivotStats()
        >>> stats.record(2, judge_parsed=True, expert_turn=2)
        >>> stats.record(None, judge_parsed=False)
        >>> stats.as_metrics()["pivot/found_rate"]
        0.5
    """

    failures: int = 0
    pivots_found: int = 0
    judged: int = 0
    judge_parse_failures: int = 0
    pivot_turn_sum: int = 0
    expert_comparable: int = 0
    expert_agreements: int = 0

    def record(self, pivot_turn: int | None, judge_parsed: bool | None = None, expert_turn: int | None = None) -> None:
        """Count one failed episode.

        Args:
            pivot_turn: the pivot finally used, ``None`` if none was found.
            judge_parsed: whether the judge's answer parsed; ``None`` when no judge was asked.
            expert_turn: :func:`pivot_by_expert` of the episode (``None``: no disagreement, or
                no expert).
        """
        self.failures += 1
        if judge_parsed is not None:
            self.judged += 1
            self.judge_parse_failures += int(not judge_parsed)
        if pivot_turn is not None:
            self.pivots_found += 1
            self.pivot_turn_sum += pivot_turn
            if expert_turn is not None:
                self.expert_comparable += 1
                self.expert_agreements += int(pivot_turn == expert_turn)

    def as_metrics(self) -> dict[str, float]:
        """The rates, each 0.0 when its denominator is zero (no failures, no pivot, no judge
        answer, nothing comparable with an expert); read the counts to tell that 0.0 from a
        measured one.

        Returns:
            ``pivot/found_rate`` (pivots_found / failures), ``pivot/mean_turn`` (pivot_turn_sum /
            pivots_found), ``pivot/judge_parse_failure_rate`` (judge_parse_failures / judged) and
            ``pivot/expert_agreement`` (expert_agreements / expert_comparable).
        """

        def rate(num: int, den: int) -> float:
            return num / den if den else 0.0

        return {
            "pivot/found_rate": rate(self.pivots_found, self.failures),
            "pivot/mean_turn": rate(self.pivot_turn_sum, self.pivots_found),
            "pivot/judge_parse_failure_rate": rate(self.judge_parse_failures, self.judged),
            "pivot/expert_agreement": rate(self.expert_agreements, self.expert_comparable),
        }
