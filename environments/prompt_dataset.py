"""Single-turn prompts from a dataset file: one response per episode, graded against a reference answer.

Most on-policy distillation is done single-turn on a prompt dataset (TRL's GKD trainer,
Thinking Machines' on-policy distillation recipe): the student answers a prompt, the teacher
grades every token of the answer. This environment serves such a dataset to opd's loop: each
task is one row, the observation is its prompt, the one ``step`` takes the response and ends
the episode (``terminated=True``). A multi-turn machinery with one turn is exactly that
recipe: ``vanilla_opd`` with the ``reverse_kl`` loss is GKD with lambda = 1 (all student
generations) and the reverse KL; ``grpo`` with ``ppo_clip`` is plain GRPO on the rewards below.

The data: a ``.jsonl`` (or ``.json``) file, a ``.parquet`` file, or a directory written by
``datasets``' ``save_to_disk``, read locally (jsonl and parquet directly, a directory with
``datasets.load_from_disk``; nothing is downloaded). A relative ``path`` is looked up in the
working directory, then beside the ``environments`` package, so the shipped
``environments/prompt_data/arith_tiny.jsonl`` is found from anywhere.

A prompt (``prompt_column``) is plain text or a chat, a list of ``{"role", "content"}``
messages (:func:`render_messages`); a trailing assistant message is the reference answer
when there is no answer column (TRL's conversational format). The reward is ``reward_fn``'s,
or by default :func:`default_reward` (exact match after normalising, or the same final
number for a numeric answer); with neither an answer nor a ``reward_fn`` it is 0: the
teacher's grades are the only signal (pure distillation).

Departures from an environment proper, and why:
    * ``valid_action`` is False for an empty response and, when the answer is a number, for a
      response with no number in it: a format failure the metrics should count (and what
      ``opd.envs.check_env`` asks of a garbage action). Anything else is valid.
    * ``expert_action`` is the reference answer itself, so the CPU bootstrap's ``policy:
      expert`` builds a teacher that knows the answers of the train split; there are no
      ``admissible_actions``.

Example:
    >>> env = PromptDatasetEnv(path="environments/prompt_data/arith_tiny.jsonl")
    >>> obs, info = env.reset(options={"task": env.task_ids("eval")[0]})
    >>> obs, reward, terminated, truncated, info = env.step(" " + info["expert_action"])
    >>> reward, terminated, info["success"]
    (1.0, True, True)
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from environments.base import TextEnv, check_split

SPLITS: tuple[str, ...] = ("train", "eval")
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # holds environments/, so shipped data resolves anywhere
SUFFIXES = (".jsonl", ".json", ".parquet")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_GSM8K_FINAL = re.compile(r"####\s*(\S+)\s*$")
_TASK_RE = re.compile(r"row-(\d+)")
ROLES = ("system", "user", "assistant")


# ----- answers and rewards -----
def normalise(text: str) -> str:
    """Lower case, stripped, runs of whitespace made one space: ``" The  Answer\\n"`` -> ``"the answer"``."""
    return " ".join(str(text).split()).lower()


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (``-12``, ``1,000``, ``3.5``), or None: ``"so 7."`` -> 7."""
    found = _NUMBER.findall(str(text))
    return _as_number(found[-1]) if found else None


def answer_number(answer: str | None) -> Decimal | None:
    """The number a math-style answer stands for, else None.

    Math-style: the whole answer is a number (``"42"``, ``"-3.5"``, ``"1,000"``), or it ends
    with GSM8K's ``#### 42``.
    """
    if answer is None:
        return None
    text = str(answer).strip()
    final = _GSM8K_FINAL.search(text)
    if final:
        text = final.group(1)
    return _as_number(text) if _NUMBER.fullmatch(text) else None


def default_reward(response: str, answer: str | None, row: Mapping[str, Any] | None = None) -> float:
    """1.0 when the response matches the reference answer, else 0.0 (0.0 without an answer).

    A match: equal after :func:`normalise`, or, for a math-style answer (:func:`answer_number`),
    the last number in the response equals the answer's (``"17 + 25 = 42"`` for ``"42"``).
    """
    del row  # the signature of a reward_fn
    if answer is None:
        return 0.0
    if normalise(response) == normalise(answer):
        return 1.0
    target = answer_number(answer)
    return float(target is not None and last_number(response) == target)


def load_reward_fn(dotted: str) -> Callable[[str, str | None, dict], float]:
    """The function ``pkg.module:function`` (or ``pkg.module.function``) names; ValueError saying why not."""
    module_name, sep, attr = dotted.partition(":")
    if not sep:
        module_name, _, attr = dotted.rpartition(".")
    fix = ("name a function as 'pkg.module:function' (or 'pkg.module.function') in a module on the Python "
           "path, e.g. one in the directory you run opd from; it is called fn(response_text, answer, row) -> float")
    if not module_name or not attr:
        raise ValueError(f"reward_fn={dotted!r} is not a dotted path; {fix}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or the module's own error at import
        raise ValueError(f"reward_fn={dotted!r}: cannot import module {module_name!r} "
                         f"({type(exc).__name__}: {exc}); {fix}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "has no attribute" if fn is None else "has a non-callable"
        raise ValueError(f"reward_fn={dotted!r}: module {module_name!r} {what} {attr!r}; {fix}")
    return fn


# ----- prompts -----
def render_messages(messages: list[Any]) -> tuple[str, str | None]:
    """A chat prompt as one observation text, and its trailing assistant message (the answer) if any.

    Each message's content, in order, separated by a blank line: a system message's first, as
    an instruction paragraph, then the user's. When the chat has earlier assistant turns (a
    few-shot prompt) the user and assistant messages are labelled ``User: ...`` and
    ``Assistant: ...`` so their turns stay apart. A last assistant message is not part of the
    prompt: it is returned as the reference answer.

    Example:
        >>> render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        ...                  {"role": "assistant", "content": "4"}])
        ('Be brief.\\n\\n2+2?', '4')
    """
    checked = []
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(str(part.get("text", "")) for part in content
                              if isinstance(part, Mapping) and part.get("type") == "text")
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"message {k} is {message!r:.120}; a chat prompt is a list of "
                             f"{{'role': one of {', '.join(ROLES)}, 'content': text}}")
        checked.append((role, content))
    answer = None
    if checked and checked[-1][0] == "assistant":
        answer = checked.pop()[1]
    if not checked or checked[-1][0] != "user":
        raise ValueError("a chat prompt must end with a user message (or a user message and the assistant's answer)")
    labelled = any(role == "assistant" for role, _ in checked)
    parts = [content if role == "system" or not labelled else f"{role.capitalize()}: {content}"
             for role, content in checked]
    return "\n\n".join(parts), answer


# ----- data -----
def resolve_data_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as given, or a relative one found beside the ``environments`` package; ValueError if neither."""
    given = Path(os.path.expanduser(str(path)))
    candidates = [given] if given.is_absolute() else [given, PACKAGE_ROOT / given]
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    looked = " and ".join(str(c.absolute()) for c in candidates)
    raise ValueError(f"path={str(path)!r}: no such file or directory (looked for {looked}); set env.kwargs.path to "
                     "a .jsonl, .json or .parquet file, or a directory written by datasets' save_to_disk")


def read_rows(path: Path, dataset_split: str = "") -> list[dict[str, Any]]:
    """The rows of a dataset file or ``save_to_disk`` directory, as dicts; ValueError naming the problem."""
    if path.is_dir():
        return _read_saved_dataset(path, dataset_split)
    if dataset_split:
        raise ValueError(f"dataset_split={dataset_split!r} is for a directory holding a DatasetDict, but "
                         f"path={str(path)!r} is a file; remove dataset_split")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"path={str(path)!r} is not a readable Parquet file ({exc})") from None
    elif suffix in (".jsonl", ".json"):
        rows = _read_json_rows(path)
    else:
        raise ValueError(f"path={str(path)!r}: cannot read {suffix or 'a file without a suffix'}; give a "
                         f"{', '.join(SUFFIXES)} file or a directory written by datasets' save_to_disk")
    for k, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"path={str(path)!r}: row {k} is {type(row).__name__}, not an object of columns")
    return rows


def _read_json_rows(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # one JSON array of rows
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"path={str(path)!r} is not valid JSON ({exc})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"path={str(path)!r}: line {number} is not JSON ({exc.msg}); a .jsonl file holds "
                                 "one JSON object per line") from None
    return rows


def _read_saved_dataset(path: Path, dataset_split: str) -> list[dict[str, Any]]:
    # load_from_disk reads the directory's Arrow files; it never goes to the network.
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # FileNotFoundError for a directory save_to_disk did not write, and others
        raise ValueError(f"path={str(path)!r}: datasets.load_from_disk cannot read this directory "
                         f"({type(exc).__name__}: {exc}); give a directory written by Dataset.save_to_disk, "
                         "or a .jsonl or .parquet file") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if not dataset_split and len(names) == 1:
            dataset_split = names[0]
        if dataset_split not in loaded:
            raise ValueError(f"dataset_split={dataset_split!r}: {str(path)!r} holds a DatasetDict with splits "
                             f"{', '.join(map(repr, names))}; set env.kwargs.dataset_split to the one to read")
        loaded = loaded[dataset_split]
    elif dataset_split:
        raise ValueError(f"dataset_split={dataset_split!r}: {str(path)!r} holds one Dataset, not a DatasetDict; "
                         "remove dataset_split")
    return loaded.to_list()


@dataclass(frozen=True)
class PromptTask:
    """One row: ``task_id`` ``"row-00017"`` (its index in the data), the observation text, the answer."""

    task_id: str
    prompt: str
    answer: str | None
    row: dict[str, Any]


@functools.lru_cache(maxsize=8)
def load_tasks(path: Path, mtime_ns: int, size: int, prompt_column: str, answer_column: str | None,
               dataset_split: str) -> tuple[PromptTask, ...]:
    """Every row of the data as a task: a pure function of its arguments (the file's mtime and
    size among them, so an edited file is read again), cached because every env instance (one
    per episode slot) asks for the same rows."""
    del mtime_ns, size  # part of the cache key only
    rows = read_rows(path, dataset_split)
    if not rows:
        raise ValueError(f"path={str(path)!r} holds no rows")
    columns = list(rows[0])
    if prompt_column not in rows[0]:
        raise ValueError(f"prompt_column={prompt_column!r}: {str(path)!r} has no column {prompt_column!r} (its "
                         f"columns: {', '.join(map(repr, columns))}); set env.kwargs.prompt_column to the column "
                         "holding the prompts")
    if answer_column is None:  # the default: 'answer' where the data has it
        answer_column = "answer" if "answer" in rows[0] else ""
    elif answer_column and answer_column not in rows[0]:
        raise ValueError(f"answer_column={answer_column!r}: {str(path)!r} has no column {answer_column!r} (its "
                         f"columns: {', '.join(map(repr, columns))}); set env.kwargs.answer_column to the column "
                         "holding the reference answers, or to \"\" for none")
    width = max(5, len(str(len(rows) - 1)))
    tasks = []
    for index, row in enumerate(rows):
        value = row.get(prompt_column)
        try:
            if isinstance(value, str):
                prompt, trailing = value, None
            elif isinstance(value, list):
                prompt, trailing = render_messages(value)
            else:
                raise ValueError(f"it is {type(value).__name__}, neither text nor a list of chat messages")
        except ValueError as exc:
            raise ValueError(f"prompt_column={prompt_column!r}: row {index} of {str(path)!r}: {exc}") from None
        answer = row.get(answer_column) if answer_column else trailing
        if isinstance(answer, float) and math.isnan(answer):  # a missing value in a Parquet or pandas column
            answer = None
        tasks.append(PromptTask(f"row-{index:0{width}d}", prompt, None if answer is None else str(answer), row))
    return tuple(tasks)


@functools.lru_cache(maxsize=8)
def split_ids(data_key: tuple[Any, ...], eval_fraction: float, split_seed: int) -> dict[str, tuple[str, ...]]:
    """Task ids of each split of the tasks ``load_tasks(*data_key)``: the distinct prompts ordered by
    sha256(split_seed, prompt), the first ``eval_fraction`` of them (at least one) in "eval", the
    rest in "train"; ids in row order.

    By prompt, not by row: repeats of a prompt fall in the same split, so the splits share no prompt.
    """
    tasks = load_tasks(*data_key)
    prompts = sorted({t.prompt for t in tasks}, key=lambda p: hashlib.sha256(f"{split_seed}:{p}".encode()).hexdigest())
    if len(prompts) < 2:
        raise ValueError(f"the data has {len(prompts)} distinct prompt(s); a train and an eval split need at least 2")
    n_eval = min(len(prompts) - 1, max(1, round(eval_fraction * len(prompts))))
    held_out = set(prompts[:n_eval])
    return {"train": tuple(t.task_id for t in tasks if t.prompt not in held_out),
            "eval": tuple(t.task_id for t in tasks if t.prompt in held_out)}


# ----- environment -----
class PromptDatasetEnv(TextEnv):
    """Single-turn prompts from a dataset file (jsonl, parquet or save_to_disk): one graded response per episode.

    Task ids are ``"row-00017"``, the row's index in the data. ``reset`` shows the row's prompt;
    the one ``step`` grades the response and ends the episode.

    Args:
        path: A ``.jsonl``/``.json`` file, a ``.parquet`` file, or a ``save_to_disk`` directory; a
            relative path is looked up in the working directory, then beside the ``environments``
            package.
        prompt_column: The column of prompts: text, or a list of chat messages (:func:`render_messages`).
        answer_column: The column of reference answers; None: ``answer`` if the data has one, else a
            chat's trailing assistant message; ``""``: no answers.
        reward_fn: ``pkg.module:function`` (or ``pkg.module.function``) called
            ``fn(response_text, answer, row) -> float`` with the response as ``step`` got it
            (unstripped), the answer (str or None) and the row's dict; ``""``: :func:`default_reward`.
        success_threshold: An episode succeeds when its reward is at least this.
        eval_fraction: Share of the distinct prompts held out in "eval".
        split_seed: Salt of the hash that orders the prompts for the split.
        dataset_split: For a directory holding a DatasetDict, the split to read (by default its only one).
        where: Keep only the rows whose columns hold these values (``{"source": "math"}``, or a list of
            values ``{"source": ["math", "gsm"]}``); the splits are cut before, so a row keeps its split.
            A run routes a dataset's rows to teachers by a column with one ``env.mix`` entry per value
            (docs/teachers.md).
        max_turns: 1; a prompt is answered once (``opd eval`` passes it).
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    def __init__(
        self,
        *,
        path: str,
        prompt_column: str = "prompt",
        answer_column: str | None = None,
        reward_fn: str = "",
        success_threshold: float = 1.0,
        eval_fraction: float = 0.2,
        split_seed: int = 0,
        dataset_split: str = "",
        where: Mapping[str, Any] | None = None,
        max_turns: int = 1,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path={path!r} must be a non-empty string: the data's file or directory")
        if not isinstance(prompt_column, str) or not prompt_column:
            raise ValueError(f"prompt_column={prompt_column!r} must be a column name")
        for name, value in (("reward_fn", reward_fn), ("dataset_split", dataset_split)):
            if not isinstance(value, str):
                raise ValueError(f"{name}={value!r} must be a string (\"\": none)")
        if answer_column is not None and not isinstance(answer_column, str):
            raise ValueError(f"answer_column={answer_column!r} must be a column name, \"\" (no answers) or null "
                             "(the default)")
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, (int, float)) \
                or not math.isfinite(success_threshold):
            raise ValueError(f"success_threshold={success_threshold!r} must be a finite number")
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction!r} must be in (0, 1)")
        if isinstance(split_seed, bool) or not isinstance(split_seed, int) or split_seed < 0:
            raise ValueError(f"split_seed={split_seed!r} must be an integer >= 0")
        if max_turns != 1 or isinstance(max_turns, bool):
            raise ValueError(f"max_turns={max_turns!r}: a prompt-dataset episode is one response; use 1 (the default)")
        super().__init__(max_turns=1, render_mode=render_mode, max_observation_chars=1 << 16, max_action_chars=1 << 16)
        self.path = str(path)
        self.prompt_column = prompt_column
        self.answer_column = answer_column
        self.reward_fn = reward_fn
        self.success_threshold = float(success_threshold)
        self.eval_fraction = float(eval_fraction)
        self.split_seed = split_seed
        self.dataset_split = dataset_split
        self._reward = load_reward_fn(reward_fn) if reward_fn else None
        data = resolve_data_path(path)
        stat = data.stat()
        data_key = (data, stat.st_mtime_ns, stat.st_size, prompt_column, answer_column, dataset_split)
        self._tasks = load_tasks(*data_key)
        self._splits = split_ids(data_key, self.eval_fraction, split_seed)
        if where:
            self._splits = {name: self._where(ids, where) for name, ids in self._splits.items()}
        self._current: PromptTask | None = None

    def _where(self, ids: Any, where: Mapping[str, Any]) -> tuple[str, ...]:
        """Of ``ids``, those whose row's columns hold ``where``'s values."""
        if not isinstance(where, Mapping):
            raise ValueError(f"where={where!r} must map column names to a value or a list of values")
        columns = set(self._tasks[0].row) if self._tasks else set()
        for column in where:
            if column not in columns:
                raise ValueError(f"where names column {column!r}, which {self.path!r} does not have; its columns: "
                                 f"{', '.join(sorted(columns))}")
        wanted = {c: (list(v) if isinstance(v, (list, tuple)) else [v]) for c, v in where.items()}
        return tuple(i for i in ids if all(self.task(i).row.get(c) in values for c, values in wanted.items()))

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids of every task in ``split`` ("train" or "eval"), same for the same data and kwargs."""
        check_split(split, SPLITS)
        return list(self._splits[split])

    def task(self, task_id: str) -> PromptTask:
        """The prompt, answer and row of ``task_id``."""
        match = _TASK_RE.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None or int(match.group(1)) >= len(self._tasks):
            raise ValueError(f"unknown task id {task_id!r}; expected 'row-N' for a row N < {len(self._tasks)} "
                             f"of {self.path!r}, e.g. {self._tasks[0].task_id!r}")
        return self._tasks[int(match.group(1))]

    # ----- episode -----
    def _start_episode(self, task: str) -> str:
        """Shows the row's prompt."""
        self._current = self.task(task)
        return self._current.prompt

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Grades the one response and ends the episode; an empty one is invalid (reward 0), never raises."""
        self._begin_turn()
        task = self._current
        assert task is not None
        text = action if isinstance(action, str) else ""
        numeric = answer_number(task.answer) is not None
        valid = bool(text.strip()) and (not numeric or last_number(text) is not None)
        if self._reward is not None:
            reward = self._call_reward_fn(text, task)
        else:
            reward = default_reward(text, task.answer) if valid else 0.0
        success = reward >= self.success_threshold and (self._reward is not None or task.answer is not None)
        if not text.strip():
            obs = "Invalid response: it is empty."
        elif not valid:
            obs = "Invalid response: the answer is a number, and the response has none."
        elif self._reward is None and task.answer is None:
            obs = "Response recorded."
        else:
            obs = "Correct." if success else "Incorrect."
        self._end_turn(obs, terminated=True)
        return obs, reward, True, False, self._info(success=success, valid_action=valid)

    def _call_reward_fn(self, text: str, task: PromptTask) -> float:
        # The user's function: its failure is an environment error of this episode (the pool
        # reports it with this message), not a bad action.
        try:
            reward = self._reward(text, task.answer, dict(task.row))
        except Exception as exc:
            raise RuntimeError(f"reward_fn={self.reward_fn!r} raised on task {task.task_id!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RuntimeError(f"reward_fn={self.reward_fn!r} returned {reward!r} on task {task.task_id!r}; "
                               "it must return a finite float")
        return float(reward)

    def _state_info(self) -> dict[str, Any]:
        answer = self._current.answer if self._current is not None and not self._done else None
        return {"expert_action": answer}
