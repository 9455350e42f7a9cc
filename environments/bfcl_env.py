"""BFCL multi-turn as a text tool-calling environment, executed and graded by ``bfcl_eval`` itself.

Tasks are the multi-turn entries bundled in the ``bfcl-eval`` package (categories ``base``,
``miss_func``, ``miss_param`` and ``long_context``, 200 each). The reset observation holds the
function documentation and the first user request; the model answers in BFCL's Python-call
syntax, e.g. ``[cd(folder='document'), ls()]``; the official backend
(``execute_multi_turn_func_call``) runs the calls on its simulated file system, trading bot,
travel API...; the results are the next observation. A reply of ``[]`` ends the model's turn and
the next user request arrives. After the last request the official ``multi_turn_checker``
(state and response checks against the ground truth) gives reward 1.0 or 0.0.

Where this departs from BFCL's own inference loop, and why:
    * Replies are parsed with ``ast`` and only literal arguments are accepted; each call is
      re-rendered from its literals before the backend (which ``eval``s strings) sees it, so a
      reply cannot run arbitrary code. BFCL's decoder ``eval``s some argument expressions.
    * Literals are bounded: a reply holds at most 65,536 characters, an integer at most 100
      digits, a string at most 16,384 characters, and a float must be finite; anything else is an
      invalid action. Python would raise past 4,300 digits (its int-string conversion limit), and
      ``1e400`` renders as ``inf``, which the backend cannot evaluate.
    * The backend qualifies calls textually: ``_process_method_calls`` puts its instance name
      before every ``name(`` in the call string, string contents included, so
      ``touch(file_name='run ls() then cd(x)')`` would create a file named
      ``'run opd_..._instance.ls() then opd_..._instance.cd(x)'``. The env writes each ``(``
      inside a string literal as ``\\x28`` (``Call.backend_source``), which evaluates to the same
      string and leaves nothing for the substitution to match. The bundled ground truth has no
      ``(`` inside a string, so the checker's own replay of it is unaffected.
    * Only the functions shown to the model may run; another name (a builtin, a held-out
      ``miss_func`` function before it is revealed) is answered with an error and not recorded.
    * A reply that does not parse is an invalid action (an observation and a penalty); BFCL would
      end the turn. Ending the turn is the explicit reply ``[]``.
    * A few backend calls compute without bound on small inputs (exact integer powers,
      arbitrary-precision logarithm and square root); they are refused with an error result, so
      one reply cannot stall the process. Exceptions anywhere in the backend or checker become
      error text / a failed check, never a raised error.
    * Function docs are one compact JSON object per line (BFCL indents them by 4), and very long
      tool results are cut at ``max_result_chars`` (only ``long_context`` produces them).

Example:
    >>> env = BFCLMultiTurnEnv()
    >>> obs, info = env.reset(options={"task": env.task_ids("eval")[0]})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import importlib.resources
import inspect
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
from bfcl_eval.constants.default_prompts import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    OUTPUT_FORMAT_MAPPING,
    PROMPT_STYLE_TEMPLATES,
)
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, MULTI_TURN_FUNC_DOC_FILE_MAPPING
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

from environments.base import TextEnv, check_split

CATEGORIES: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")
SPLITS: tuple[str, ...] = ("train", "eval")
END_TURN = "[]"
_STYLE = PROMPT_STYLE_TEMPLATES["classic"]
# BFCL's classic system prompt, with its turn rule made explicit: here the model ends a turn with [].
INSTRUCTIONS = (
    f"{_STYLE['persona']} {_STYLE['task']}\n\n"
    f"Reply only with function calls, in the format {OUTPUT_FORMAT_MAPPING['python']}. "
    "Argument values must be Python literals. Each reply is executed and you see the results.\n"
    "At each turn, complete the user's request within the turn: keep calling functions until it is done, "
    f"then reply {END_TURN} to end your turn (also when nothing can or should be called); "
    "the user then makes the next request.\n\n"
    "Here is a list of functions in JSON format that you can invoke, one per line.\n"
)
_PYTHON_HINT = " Note that the provided function is in Python 3 syntax."  # BFCL appends it to every description
_DATA_FILE = "BFCL_v4_multi_turn_{}.json"
# The backend classes of the multi-turn categories (BFCL's table also lists web-search and memory ones).
_MULTI_TURN_CLASSES = ("GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot",
                       "TravelAPI", "VehicleControlAPI")
_MAX_POWER_BITS = 100_000  # int ** int with a bigger result is refused (10**(10**9) would run for hours)
_MAX_PRECISION = 1_000  # digits for logarithm / square_root; 10**5 takes seconds, 10**9 never ends
# Reply and literal sizes. The action space's length: a 4 MB reply of small literals builds a 1.9 GB
# syntax tree (15 s here) before any other check could refuse it.
_MAX_REPLY_CHARS = 1 << 16
_MAX_INT_DIGITS = 100  # the bundled ground truth's longest integer has 6 digits; Python refuses past 4,300
_MAX_STR_CHARS = 1 << 14  # its longest string has 6,690 characters


# ----- replies -----
class ActionError(ValueError):
    """A reply that is not a list of function calls with literal arguments; the message says why."""


@dataclass(frozen=True)
class Call:
    """One parsed function call: ``name(*args, **dict(kwargs))`` with literal values."""

    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def render(self) -> str:
        """The call as Python source, e.g. ``mv(source='a.txt', destination='temp')``."""
        parts = [repr(v) for v in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.name}({', '.join(parts)})"

    def backend_source(self) -> str:
        """The call as source for BFCL's executor: ``render()``, with ``(`` in strings written ``\\x28``.

        The executor puts its instance name before every ``name(`` in the text, string contents
        included (see the module docstring); with no ``(`` left inside a string literal, only the
        call itself is qualified, and ``eval`` still gives the exact string.
        """
        parts = [_source(v) for v in self.args] + [f"{k}={_source(v)}" for k, v in self.kwargs]
        return f"{self.name}({', '.join(parts)})"


def _source(value: Any) -> str:
    if isinstance(value, (str, bytes)):
        return repr(value).replace("(", "\\x28")  # repr writes no "(" of its own inside a string
    if isinstance(value, list):
        return "[" + ", ".join(map(_source, value)) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_source, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_source(k)}: {_source(v)}" for k, v in value.items()) + "}"
    if isinstance(value, set):
        return "{" + ", ".join(map(_source, value)) + "}" if value else "set()"
    return repr(value)


def parse_calls(text: Any) -> list[Call]:
    """Parses a reply in BFCL's Python-call syntax; ``[]`` gives an empty list (end of turn).

    Like BFCL's decoder it tolerates surrounding whitespace, a Markdown code fence and missing
    outer brackets (``ls()`` reads as ``[ls()]``). Unlike it, every argument must be a literal
    (``ast.literal_eval``), so nothing is evaluated, and the reply and its literals are bounded
    (65,536 characters; integers of 100 digits, strings of 16,384 characters, finite floats).

    Raises:
        ActionError: If the reply is not such a list; the message names the problem.
    """
    if not isinstance(text, str):
        raise ActionError(f"the reply must be text, got {type(text).__name__}")
    if len(text) > _MAX_REPLY_CHARS:
        raise ActionError(f"it has {len(text)} characters; at most {_MAX_REPLY_CHARS}")
    source = text.strip()
    if source.startswith("```"):  # ```python\n[...]\n```
        source = source.partition("\n")[2] if "\n" in source else source[3:]
        source = source.rstrip().removesuffix("```")
    source = source.strip("`\n ")
    if not source:
        raise ActionError(f"the reply is empty; reply with function calls, or {END_TURN} to end your turn")
    if not source.startswith("["):
        source = "[" + source
    if not source.endswith("]"):
        source = source + "]"
    try:
        body = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        if "integer string conversion" in str(exc):  # a decimal literal past Python's 4,300 digits
            raise ActionError(f"integer literal too long: a number has more than {_MAX_INT_DIGITS} digits") from None
        raise ActionError(f"it is not valid Python call syntax ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, ast.List):
        raise ActionError("it is not a list of function calls")
    return [_parse_call(node) for node in body.elts]


def _parse_call(node: ast.expr) -> Call:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ActionError(f"{_snippet(node)!r} is not a call of a function by its plain name")
    values = []
    for value in [*node.args, *(kw.value for kw in node.keywords)]:
        if isinstance(value, ast.Starred):
            raise ActionError(f"{_snippet(node)!r} unpacks arguments with *; write each one out")
        try:
            values.append(ast.literal_eval(value))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            raise ActionError(
                f"argument {_snippet(value)!r} of {node.func.id} is not a literal (string, number, list, dict...)"
            ) from None
        _check_size(values[-1], node.func.id)
    names = [kw.arg for kw in node.keywords]
    if None in names:
        raise ActionError(f"{_snippet(node)!r} unpacks arguments with **; write each one out")
    if len(set(names)) < len(names):
        raise ActionError(f"{_snippet(node)!r} repeats a keyword argument")
    n_args = len(node.args)
    kwargs = tuple((kw.arg, v) for kw, v in zip(node.keywords, values[n_args:], strict=True))
    return Call(node.func.id, tuple(values[:n_args]), kwargs)


def _check_size(value: Any, function: str) -> None:
    # Iterative: a nested literal as deep as literal_eval allows must not overflow the stack here.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes)) and len(item) > _MAX_STR_CHARS:
            raise ActionError(f"string literal too long: an argument of {function} has {len(item)} characters; "
                              f"at most {_MAX_STR_CHARS}")
        if isinstance(item, int) and abs(item) >= 10**_MAX_INT_DIGITS:  # no str(): it raises past 4,300 digits
            raise ActionError(f"integer literal too long: an argument of {function} has more than "
                              f"{_MAX_INT_DIGITS} digits")
        if (isinstance(item, float) and not math.isfinite(item)) \
                or (isinstance(item, complex) and not (math.isfinite(item.real) and math.isfinite(item.imag))):
            raise ActionError(f"float literal out of range: an argument of {function} is {item!r}; "
                              "numbers must be finite")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)


def _snippet(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except (ValueError, RecursionError):
        text = type(node).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def format_function_docs(docs: Sequence[dict[str, Any]]) -> str:
    """One compact JSON object per function, one per line."""
    return "\n".join(json.dumps(doc, ensure_ascii=False) for doc in docs)


# ----- data -----
@functools.lru_cache(maxsize=1)
def load_entries() -> dict[str, dict[str, Any]]:
    """Every bundled multi-turn entry by id, prepared as BFCL's ``load_dataset_entry`` does.

    Each entry gains ``ground_truth`` (list per user turn of call strings), ``function`` (the docs
    shown from the start, held-out ones removed, BFCL's Python hint appended) and, for
    ``miss_func``, ``missed_function`` as {turn index (str): [docs revealed at that turn]}.
    Cached: every env instance reads the same read-only data.
    """
    data = importlib.resources.files("bfcl_eval") / "data"
    docs_by_class = {
        cls: [json.loads(line) for line in (data / "multi_turn_func_doc" / name).read_text().splitlines() if line]
        for cls, name in MULTI_TURN_FUNC_DOC_FILE_MAPPING.items()
        if cls in _MULTI_TURN_CLASSES
    }
    entries = {}
    for category in CATEGORIES:
        prompts = _read_jsonl(data / _DATA_FILE.format(category))
        answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(data / "possible_answer" / _DATA_FILE.format(category))}
        for entry in prompts:
            docs = [dict(doc, description=doc["description"] + _PYTHON_HINT)
                    for cls in entry["involved_classes"] for doc in docs_by_class[cls]]
            missed = {}
            for turn, names in entry.get("missed_function", {}).items():
                missed[turn] = [doc for doc in docs if doc["name"] in names]
                docs = [doc for doc in docs if doc["name"] not in names]
            entry.update(function=docs, missed_function=missed, ground_truth=answers[entry["id"]])
            entries[entry["id"]] = entry
    return entries


def _read_jsonl(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _scenario_key(entry_id: str) -> str:
    # The four categories are variants of the same 200 scenarios (same index); two base scenarios
    # open with the same request. Keying on the base scenario's first request keeps all of these
    # on one side of the split, so train and eval are disjoint by content, not only by id.
    index = entry_id.rsplit("_", 1)[1]
    return load_entries()[f"multi_turn_base_{index}"]["question"][0][0]["content"]


@functools.lru_cache(maxsize=16)
def split_task_ids(categories: tuple[str, ...], eval_fraction: float, split_seed: int, split: str) -> tuple[str, ...]:
    """Entry ids of ``split``: a scenario is eval when sha256(seed, its first request) falls under
    ``eval_fraction``; ids come in category order, then by index."""
    ids = []
    for category in categories:
        prefix = f"multi_turn_{category}_"
        for index in range(sum(1 for entry_id in load_entries() if entry_id.startswith(prefix))):
            entry_id = f"{prefix}{index}"
            digest = hashlib.sha256(f"{split_seed}:{_scenario_key(entry_id)}".encode()).hexdigest()
            is_eval = int(digest[:12], 16) / 16**12 < eval_fraction
            if is_eval == (split == "eval"):
                ids.append(entry_id)
    return tuple(ids)


# ----- backend -----
def execute_calls(entry: dict[str, Any], instances: dict[str, Any], calls: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Runs call strings on ``instances`` (class name -> backend object) with BFCL's executor.

    ``execute_multi_turn_func_call`` keeps its objects in its module globals under a model name;
    they are placed there under a fresh name for this call only and removed afterwards, so the env
    owns its state (copies and pickles with it) and nothing accumulates in the module.
    ``instances={}`` builds them from the entry's initial config.

    Returns:
        One result string per call, and the (mutated) instances.
    """
    model_name = "opd_" + uuid.uuid4().hex
    namespace = vars(multi_turn_utils)
    for cls, instance in instances.items():
        namespace[f"{model_name}_{entry['id']}_{cls}_instance"] = instance
    try:
        return multi_turn_utils.execute_multi_turn_func_call(
            list(calls), entry["initial_config"], entry["involved_classes"], model_name, entry["id"],
            long_context="long_context" in entry["id"],
        )
    finally:
        _drop_instances(model_name)


def check_episode(entry: dict[str, Any], decoded: list[list[list[str]]]) -> dict[str, Any]:
    """The official ``multi_turn_checker`` verdict on the calls made per turn and step.

    Returns:
        {"valid": bool, "error_type": str, "error_message": str}; a checker exception is a
        failed check with error_type "opd:checker_exception".
    """
    model_name = "opd_" + uuid.uuid4().hex
    try:
        verdict = multi_turn_checker(decoded, entry["ground_truth"], entry, entry["id"].rsplit("_", 1)[0], model_name)
    except Exception as exc:  # noqa: BLE001 - any backend failure is a failed episode, not a crash
        verdict = {"valid": False, "error_type": "opd:checker_exception", "error_message": f"{type(exc).__name__}: {exc}"}
    finally:
        _drop_instances(model_name)
    return {"valid": bool(verdict["valid"]), "error_type": str(verdict.get("error_type", "")),
            "error_message": str(verdict.get("error_message", ""))}


def _drop_instances(model_name: str) -> None:
    namespace = vars(multi_turn_utils)
    for key in [k for k in namespace if k.startswith(model_name + "_")]:
        del namespace[key]


def unbounded_work(call: Call, entry: dict[str, Any]) -> str | None:
    """Why the backend would compute ``call`` without bound, or None if it is safe to run.

    Audited over the bundled backend: only MathAPI's exact integer ``power`` and the precision
    of ``logarithm`` / ``square_root`` grow without limit on a short reply.
    """
    if "MathAPI" not in entry["involved_classes"] or call.name not in ("power", "logarithm", "square_root"):
        return None
    method = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING["MathAPI"]).MathAPI, call.name)
    try:
        bound = inspect.signature(method).bind(None, *call.args, **dict(call.kwargs)).arguments
    except TypeError:
        return None  # the backend reports the bad arguments itself
    if call.name == "power":
        base, exponent = bound.get("base"), bound.get("exponent")
        if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 \
                and abs(exponent) * abs(base).bit_length() > _MAX_POWER_BITS:
            return f"the exact result would exceed {_MAX_POWER_BITS} bits"
    elif isinstance(bound.get("precision"), int) and bound["precision"] > _MAX_PRECISION:
        return f"precision is limited to {_MAX_PRECISION} digits"
    return None


# ----- environment -----
class BFCLMultiTurnEnv(TextEnv):
    """BFCL multi-turn tool calling: fulfil a user's successive requests by calling functions (bfcl_eval's official backend and checker).

    Task ids are BFCL entry ids, e.g. ``"multi_turn_miss_param_17"``. An episode walks through the
    entry's user requests; the model replies with calls and ends each turn with ``[]``.

    Args:
        categories: BFCL multi-turn categories to draw tasks from (subset of ``CATEGORIES``).
        max_turns: Budget of model replies per episode; reaching it before the last request is
            done truncates (reward 0, as a forced quit fails in BFCL).
        eval_fraction: Share of scenarios (all variants of one scenario together) in "eval".
        split_seed: Salt of the scenario hash that assigns splits.
        invalid_action_penalty: Reward subtracted for a reply that does not parse.
        max_result_chars: Each tool result is cut to this many characters (None: never).
        max_calls_per_reply: A reply with more calls is invalid.
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    def __init__(
        self,
        *,
        categories: Sequence[str] = CATEGORIES,
        max_turns: int = 40,
        eval_fraction: float = 0.2,
        split_seed: int = 0,
        invalid_action_penalty: float = 0.1,
        max_result_chars: int | None = 8000,
        max_calls_per_reply: int = 32,
        render_mode: str | None = None,
    ) -> None:
        categories = tuple(categories)
        unknown = [c for c in categories if c not in CATEGORIES]
        if not categories or unknown:
            raise ValueError(f"categories={categories!r} must be a non-empty subset of {CATEGORIES}")
        _check_int("max_turns", max_turns, minimum=1)
        _check_int("split_seed", split_seed, minimum=0)
        _check_int("max_calls_per_reply", max_calls_per_reply, minimum=1)
        if max_result_chars is not None:
            _check_int("max_result_chars", max_result_chars, minimum=16)
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction!r} must be in (0, 1)")
        if isinstance(invalid_action_penalty, bool) or not isinstance(invalid_action_penalty, (int, float)) \
                or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        super().__init__(max_turns=max_turns, render_mode=render_mode, max_observation_chars=1 << 20,
                         max_action_chars=1 << 16)
        self.categories = categories
        self.eval_fraction = float(eval_fraction)
        self.split_seed = split_seed
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.max_result_chars = max_result_chars
        self.max_calls_per_reply = max_calls_per_reply
        self._entry: dict[str, Any] = {}
        self._instances: dict[str, Any] = {}
        self._functions: set[str] = set()
        self._question = 0  # index of the user request being served
        self._turn_calls: list[str] = []  # calls run since that request
        self._decoded: list[list[list[str]]] = []  # per request, per reply: the calls run (checker input)

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Entry ids of ``split`` ("train" or "eval"), same for same kwargs."""
        check_split(split, SPLITS)
        return list(split_task_ids(self.categories, self.eval_fraction, self.split_seed, split))

    def task_entry(self, task_id: str) -> dict[str, Any]:
        """A deep copy of the BFCL entry of ``task_id`` (questions, initial config, ground truth...)."""
        return copy.deepcopy(self._entry_of(task_id))

    def _entry_of(self, task_id: Any) -> dict[str, Any]:
        entry = load_entries().get(task_id) if isinstance(task_id, str) else None
        if entry is None or task_id.rsplit("_", 1)[0].removeprefix("multi_turn_") not in self.categories:
            raise ValueError(f"unknown task id {task_id!r}; expected a BFCL entry id such as "
                             f"'multi_turn_{self.categories[0]}_0' from categories {self.categories}")
        return entry

    # ----- episode -----
    def _start_episode(self, task: str) -> str:
        """Builds the entry's backend from its initial config and shows its first user request."""
        self._entry = self._entry_of(task)
        self._instances = {}
        _, self._instances = execute_calls(self._entry, {}, [])
        self._functions = {doc["name"] for doc in self._entry["function"]}
        self._question, self._turn_calls, self._decoded = 0, [], [[]]
        return INSTRUCTIONS + format_function_docs(self._entry["function"]) + "\n\n" + self._request(0)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Runs the calls of one reply, or moves to the next request on ``[]``; never raises on a bad reply."""
        self._begin_turn()
        reward, terminated, success, valid = 0.0, False, False, True
        verdict: dict[str, Any] | None = None
        try:
            calls = parse_calls(action)
            if len(calls) > self.max_calls_per_reply:
                raise ActionError(f"it has {len(calls)} calls; at most {self.max_calls_per_reply} per reply")
        except ActionError as exc:
            valid, reward = False, -self.invalid_action_penalty
            obs = (f"Invalid reply: {exc}. Reply with calls such as {OUTPUT_FORMAT_MAPPING['python']}, "
                   f"or {END_TURN} to end your turn.")
        else:
            if calls:
                obs = "Tool results:\n" + self._run(calls)
            elif self._question + 1 < len(self._entry["question"]):
                self._question += 1
                self._turn_calls = []
                self._decoded.append([])
                obs = self._request(self._question)
            else:
                verdict = check_episode(self._entry, self._decoded)
                terminated, success = True, verdict["valid"]
                reward = 1.0 if success else 0.0
                obs = "All requests are done. " + ("The checker passed." if success else
                                                   f"The checker failed: {verdict['error_message']}")
        truncated = self._end_turn(obs, terminated=terminated)
        info = self._info(success=success, valid_action=valid)
        if verdict is not None:
            info["checker"] = verdict
        return obs, reward, terminated, truncated, info

    def _request(self, index: int) -> str:
        revealed = self._entry["missed_function"].get(str(index))
        if revealed:  # a miss_func turn: no user text, the held-out functions arrive (BFCL's wording)
            self._functions |= {doc["name"] for doc in revealed}
            return f"User: {format_function_docs(revealed)}\n{DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}"
        return "User: " + "\n".join(m["content"] for m in self._entry["question"][index])

    def _run(self, calls: list[Call]) -> str:
        results: list[str] = []
        runnable: list[tuple[int, str]] = []
        for i, call in enumerate(calls):
            refusal = (f"function {call.name!r} is not one of the functions you were given"
                       if call.name not in self._functions else unbounded_work(call, self._entry))
            results.append(f"Error during execution: {refusal}" if refusal else "")
            if not refusal:
                runnable.append((i, call.backend_source()))
        if runnable:
            try:
                outputs, self._instances = execute_calls(self._entry, self._instances, [c for _, c in runnable])
            except Exception as exc:  # noqa: BLE001 - the executor guards each call; this guards the executor
                outputs = [f"Error during execution: {type(exc).__name__}: {exc}"] * len(runnable)
            for (i, _), output in zip(runnable, outputs, strict=True):
                results[i] = output
            self._turn_calls.extend(calls[i].render() for i, _ in runnable)  # the expert compares renders
            self._decoded[-1].append([c for _, c in runnable])  # the checker replays them through the backend
        return "\n".join(f"{call.render()} -> {self._cut(result)}" for call, result in zip(calls, results, strict=True))

    def _cut(self, text: str) -> str:
        if self.max_result_chars is None or len(text) <= self.max_result_chars:
            return text
        return text[: self.max_result_chars] + f" ...[{len(text) - self.max_result_chars} more characters cut]"

    def expert_action(self) -> str | None:
        """The ground-truth calls of the current request not yet made, ``[]`` once all are made,
        or None once this request's calls have left the ground truth's order (no expert there).
        Assumes earlier requests went as the ground truth."""
        if self._done or not self._entry:
            return None
        truth = _rendered_truth(self._entry["id"], self._question)
        made = len(self._turn_calls)
        if tuple(self._turn_calls) != truth[:made]:
            return None
        rest = truth[made:]
        return "[" + ", ".join(rest) + "]"

    def _state_info(self) -> dict[str, Any]:
        return {
            "request": self._question,
            "n_requests": len(self._entry["question"]),
            "expert_action": self.expert_action(),
        }


@functools.lru_cache(maxsize=4096)
def _rendered_truth(entry_id: str, index: int) -> tuple[str, ...]:
    # Ground-truth calls of one request in the canonical rendering that replies are compared in.
    return tuple(call.render() for s in load_entries()[entry_id]["ground_truth"][index] for call in parse_calls(s))


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


if "opd/BFCLMultiTurn-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/BFCLMultiTurn-v0", entry_point="environments.bfcl_env:BFCLMultiTurnEnv")
