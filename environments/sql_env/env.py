"""Text-to-SQL in the InterCode-SQL style, without Docker: query SQLite databases the project generates.

Three schemas (``shop``, ``school``, ``flights``) are filled with synthetic rows drawn from a
seed, written once to ``~/.cache/opd/envs/sql`` (atomically) and opened read-only. Questions
and gold queries come from templates over the schema whose parameters are drawn from the data
(hundreds of tasks). Each turn the model sends one SQL query and sees the result table (cut to a
few rows) or SQLite's error; ``submit`` ends the episode. Success: the last query that ran
returned the gold query's result set (as a multiset of rows; as a sequence when the gold query
has ORDER BY).

Departures from InterCode-SQL, and why:
    * SQLite instead of MySQL in Docker, so it runs anywhere; databases are generated, not Spider's.
    * Reward is the success bit (InterCode scores a partial-overlap reward); a reply that does not
      run (empty, refused or an SQLite error) costs ``invalid_action_penalty``.
    * Queries are guarded: read-only URI, an authorizer that allows reading only (no PRAGMA,
      ATTACH, writes) and only the SQL functions in ``ALLOWED_FUNCTIONS``, SQLite limits on the
      size of one value, one row and one statement, a wall-clock limit through SQLite's progress
      handler, and caps on the rows and the bytes read back.
    * Gold answers never depend on ties: a template instance is dropped when its gold result
      changes under ``PRAGMA reverse_unordered_selects`` (ties broken by row order).

Example:
    >>> env = SQLTextEnv()
    >>> obs, info = env.reset(options={"task": env.task_ids("eval")[0]})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])  # the gold query
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])  # "submit"
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import sqlite3
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from environments.base import TextEnv, check_split
from environments.sql_env.data import SCHEMAS, TEMPLATES, Template

SPLITS: tuple[str, ...] = ("train", "eval")
SUBMIT = "submit"
DEFAULT_CACHE_DIR = "~/.cache/opd/envs/sql"
DATA_VERSION = 1  # bump when generated rows or templates change: it names the cached files
INSTRUCTION = (
    "Answer the question by querying the SQLite database below. Reply with exactly one SQL query "
    "(SQLite dialect) per turn; you will see its result. When the result of your last query answers "
    f"the question exactly (the right columns, rows and, if asked, order), reply {SUBMIT}.\n"
)
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# The SQL functions a query may call: what text-to-SQL over these schemas uses, all deterministic
# and bounded by the limits below. An allow-list, because the build's function set is not ours to
# audit (Debian's SQLite compiles in fts3_tokenizer(), which returns a process address and, with
# two arguments, installs a function pointer). Left out on purpose, among others:
#   random, randomblob: break same-seed determinism (randomblob is also a memory bomb);
#   zeroblob: only builds big values, which nothing here needs;
#   printf, format: pad inside one VM step, so the progress handler cannot stop
#     printf('%.*c', 1000000000, 'x') (6.5 s here even under the value limit);
#   fts3_tokenizer, load_extension, readfile, writefile: native code and files;
#   current_date, current_time, current_timestamp: results that change with the day;
#   sqlite_version, sqlite_compileoption_*, changes, json_*: no use on these tasks.
ALLOWED_FUNCTIONS: frozenset[str] = frozenset({
    # scalar
    "abs", "char", "coalesce", "glob", "hex", "ifnull", "iif", "instr", "length", "like", "likelihood",
    "likely", "lower", "ltrim", "max", "min", "nullif", "octet_length", "quote", "replace", "round", "rtrim",
    "sign", "substr", "substring", "trim", "typeof", "unicode", "unlikely", "upper",
    # date and time (date('now') is still possible: the authorizer sees names, not arguments)
    "date", "datetime", "julianday", "strftime", "time", "timediff", "unixepoch",
    # aggregate (max and min above)
    "avg", "count", "group_concat", "string_agg", "sum", "total",
    # window
    "cume_dist", "dense_rank", "first_value", "lag", "last_value", "lead", "nth_value", "ntile",
    "percent_rank", "rank", "row_number",
    # math (SQLITE_ENABLE_MATH_FUNCTIONS)
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos", "cosh", "degrees",
    "exp", "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow", "power", "radians", "sin", "sinh", "sqrt",
    "tan", "tanh", "trunc",
})
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)
# Per-connection SQLite limits (sqlite3_limit). They bound what SQLite itself allocates during a
# query: one value (and so any string a recursive CTE, replace() or group_concat() builds), one
# row, the statement and its compiled program. Sorts, DISTINCT and CTE queues spill to temp files
# past the page cache (``PRAGMA temp_store = FILE``). No heap limit: sqlite3_hard_heap_limit64 is
# process-wide and can only be lowered, so it would also fail every other SQLite user in the
# process.
_SQLITE_LIMITS = {
    sqlite3.SQLITE_LIMIT_LENGTH: 100_000,  # bytes in one value: zeroblob(10**9), s || s... fail at once
    sqlite3.SQLITE_LIMIT_COLUMN: 64,  # columns of a result row: one row holds at most 64 x 100 kB
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: 1 << 16,  # bytes of a statement, as the env's action space
    sqlite3.SQLITE_LIMIT_VDBE_OP: 100_000,  # instructions of the compiled program (gold queries: < 200)
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 200,  # LIKE/GLOB patterns are matched inside one VM step too
    sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER: 0,  # no bound parameters; ?250000 would allocate 250,000 slots
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,  # the authorizer refuses ATTACH already
}
_PROGRESS_OPS = 1_000  # SQLite VM instructions between two clock checks
_NUMBER_BYTES = 8  # what a number or NULL counts towards the byte cap


# ----- queries -----
@dataclass(frozen=True)
class QueryResult:
    """What one query gave: columns and rows (``rows`` stops at the read-back cap), or an error."""

    columns: tuple[str, ...] = ()
    rows: tuple[tuple[Any, ...], ...] = ()
    complete: bool = True  # False: more rows than the cap, so never equal to a gold result
    error: str | None = None


def open_readonly(path: Path) -> sqlite3.Connection:
    """A connection that can only read ``path``: ``mode=ro`` URI, SQLite limits and an authorizer.

    The authorizer allows SELECT, table reads, recursive CTEs and the functions in
    ``ALLOWED_FUNCTIONS``; everything else (writes, PRAGMA, ATTACH, transactions, ``random()``,
    ``printf()``, ``fts3_tokenizer()``...) fails at prepare time. A value is limited to 100 kB, a
    result row to 64 columns, a statement to 64 kB and LIKE patterns to 200 characters.
    """
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    for limit, value in _SQLITE_LIMITS.items():
        conn.setlimit(limit, value)
    conn.execute("PRAGMA temp_store = FILE")  # before the authorizer, which refuses PRAGMA
    conn.set_authorizer(_authorize_reading)
    return conn


def _authorize_reading(action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None) -> int:
    # For SQLITE_FUNCTION, arg2 is the function's name (count(*) -> "count", x LIKE y -> "like").
    if action not in _ALLOWED or (action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in ALLOWED_FUNCTIONS):
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def run_query(conn: sqlite3.Connection, sql: str, *, time_limit_s: float, max_rows: int,
              max_bytes: int | None = None) -> QueryResult:
    """Runs one statement under a wall-clock limit; never raises for a bad query.

    Rows are read one at a time, so a result past ``max_bytes`` (text as UTF-8, blobs as they
    are, 8 bytes a number or NULL) stops being read within one row of the cap; SQLite's limits
    keep a row under 64 values of 100 kB.

    Returns:
        The columns and at most ``max_rows`` rows, or ``error``: SQLite's message
        (``"interrupted: ..."`` when the time limit stopped it), or ``"result too large: ..."``.
    """
    deadline = time.monotonic() + time_limit_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_OPS)
    try:
        cursor = conn.execute(sql)
        columns = tuple(d[0] for d in cursor.description or ())
        rows, size = [], 0
        for row in cursor:
            size += sum(_cell_bytes(value) for value in row)
            if max_bytes is not None and size > max_bytes:
                cursor.close()
                n = len(rows) + 1
                return QueryResult(error=f"result too large: over {max_bytes} bytes (max_result_bytes) after {n} "
                                         f"row{'s' if n != 1 else ''}; select fewer rows or columns, shorter "
                                         "values, or aggregate")
            rows.append(row)
            if len(rows) > max_rows:
                break
        cursor.close()
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as exc:
        message = str(exc)
        if message == "interrupted":
            message = f"interrupted: the query ran past the {time_limit_s:g} s limit"
        elif message.startswith("not authorized to use function: "):
            message += " (allowed: common scalar, date and time, math, aggregate and window functions)"
        elif isinstance(exc, MemoryError):  # SQLITE_NOMEM: a program past SQLITE_LIMIT_VDBE_OP, or a failed malloc
            message = "out of memory: the statement needs more memory than this environment allows"
        return QueryResult(error=message or type(exc).__name__)
    finally:
        conn.set_progress_handler(None, 0)
    return QueryResult(columns, tuple(rows[:max_rows]), complete=len(rows) <= max_rows)


def _cell_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes):
        return len(value)
    return _NUMBER_BYTES


def same_result(got: QueryResult, gold: QueryResult, *, ordered: bool) -> bool:
    """Whether ``got`` has the gold rows: as a sequence if ``ordered``, else as a multiset.

    Column names are ignored (as in InterCode); floats are compared to 6 decimals so that two
    summation orders agree; 3 equals 3.0.
    """
    if got.error is not None or not got.complete:
        return False
    a, b = [_normal_row(r) for r in got.rows], [_normal_row(r) for r in gold.rows]
    return a == b if ordered else Counter(a) == Counter(b)


def _normal_row(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def render_result(result: QueryResult, *, max_rows: int, max_cell_chars: int = 60) -> str:
    """The result as ``col | col`` lines, at most ``max_rows`` rows, with a row count line."""
    if result.error is not None:
        return f"Error: {result.error}"
    if not result.columns:
        return "The statement returned no table."

    def cell(value: Any) -> str:
        text = "NULL" if value is None else str(value)
        text = text.replace("\n", " ")
        return text if len(text) <= max_cell_chars else text[: max_cell_chars - 3] + "..."

    lines = [" | ".join(result.columns)] + [" | ".join(map(cell, row)) for row in result.rows[:max_rows]]
    n = len(result.rows)
    if not result.complete:
        lines.append(f"(more than {n} rows; first {min(n, max_rows)} shown)")
    elif n > max_rows:
        lines.append(f"({n} rows; first {max_rows} shown)")
    else:
        lines.append(f"({n} row{'s' if n != 1 else ''})")
    return "\n".join(lines)


def sql_literal(value: Any) -> str:
    """``value`` as an SQLite literal: 'text' with quotes doubled, or a number."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    raise TypeError(f"template parameter {value!r} is neither text nor a number")


# ----- databases -----
def database_path(schema: str, db_seed: int, cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR) -> Path:
    """Path of the generated database, built (atomically: temp file, then rename) if missing."""
    if schema not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}; known: {', '.join(SCHEMAS)}")
    directory = Path(os.path.expanduser(cache_dir))
    path = directory / f"{schema}-seed{db_seed}-v{DATA_VERSION}.sqlite"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    ddl, fill = SCHEMAS[schema]
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            conn.executescript(ddl)
            fill(conn, random.Random(f"{schema}:{db_seed}"))
            conn.commit()
        finally:
            conn.close()
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared like any other
        os.replace(tmp, path)  # concurrent builders write identical files; the last rename wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# ----- tasks -----
@dataclass(frozen=True)
class SQLTask:
    """One question: ``task_id`` like ``"shop.count_city.3"`` (schema.template.instance)."""

    task_id: str
    schema: str
    question: str
    gold_sql: str
    ordered: bool  # the gold query sorts its output, so row order counts


@functools.lru_cache(maxsize=8)
def all_tasks(db_seed: int, cache_dir: str, per_template: int) -> tuple[SQLTask, ...]:
    """Every task: each template with up to ``per_template`` parameter rows drawn from its data.

    Instances whose gold result is empty, longer than 50 rows, an error, or changed by reversed
    row order (a tie) are dropped, and so is a question that repeats an earlier one. A pure
    function of its arguments, cached because every env instance asks for the same list.
    """
    tasks, questions = [], set()
    connections: dict[str, sqlite3.Connection] = {}
    try:
        for template in TEMPLATES:
            if template.schema not in connections:
                connections[template.schema] = open_readonly(database_path(template.schema, db_seed, cache_dir))
            conn = connections[template.schema]
            for index, params in enumerate(_draw_params(conn, template, per_template)):
                question = template.question.format(*params)
                gold_sql = template.sql.format(*map(sql_literal, params))
                if question in questions or not _unambiguous(conn, gold_sql):
                    continue
                questions.add(question)
                tasks.append(SQLTask(f"{template.schema}.{template.name}.{index}", template.schema, question,
                                     gold_sql, bool(_ORDER_BY.search(gold_sql))))
    finally:
        for conn in connections.values():
            conn.close()
    return tuple(tasks)


def _draw_params(conn: sqlite3.Connection, template: Template, per_template: int) -> list[tuple[Any, ...]]:
    candidates = run_query(conn, template.params_sql, time_limit_s=10.0, max_rows=100_000)
    if candidates.error is not None:
        raise RuntimeError(f"template {template.name!r}: its parameter query failed: {candidates.error}")
    rows = list(candidates.rows)
    if len(rows) > per_template:  # a seeded sample, kept in the query's order
        keep = set(random.Random(f"params:{template.schema}.{template.name}").sample(range(len(rows)), per_template))
        rows = [row for i, row in enumerate(rows) if i in keep]
    return rows


def _unambiguous(conn: sqlite3.Connection, gold_sql: str) -> bool:
    # The gold query runs under the same guards as a model's, so a template that needs a function
    # outside ALLOWED_FUNCTIONS fails here, loudly, rather than as an unsolvable task.
    results = []
    try:
        for reverse in (0, 1):
            _reverse_unordered_selects(conn, reverse)
            results.append(run_query(conn, gold_sql, time_limit_s=10.0, max_rows=51))
    finally:
        _reverse_unordered_selects(conn, 0)
    first, second = results
    if first.error is not None:
        raise RuntimeError(f"gold query failed: {first.error}\n{gold_sql}")
    if not first.rows or not first.complete or len(first.rows) > 50:
        return False
    return same_result(second, first, ordered=True) or (
        not _ORDER_BY.search(gold_sql) and same_result(second, first, ordered=False))


def _reverse_unordered_selects(conn: sqlite3.Connection, value: int) -> None:
    # A PRAGMA, which the read-only authorizer refuses; lifted for this one statement only.
    # Setting an authorizer expires every prepared statement, so the cached copy of this one is
    # checked again, and refused, if a query repeats it.
    conn.set_authorizer(None)
    try:
        conn.execute(f"PRAGMA reverse_unordered_selects = {value}")
    finally:
        conn.set_authorizer(_authorize_reading)


@functools.lru_cache(maxsize=16)
def split_tasks(db_seed: int, cache_dir: str, per_template: int, eval_fraction: float, split_seed: int,
                split: str) -> tuple[SQLTask, ...]:
    """Tasks of ``split``: eval when sha256(seed, question) falls under ``eval_fraction``.

    Questions are unique, so the splits share no question (nor gold query: it fixes the question).
    """
    chosen = []
    for task in all_tasks(db_seed, cache_dir, per_template):
        digest = hashlib.sha256(f"{split_seed}:{task.question}".encode()).hexdigest()
        if (int(digest[:12], 16) / 16**12 < eval_fraction) == (split == "eval"):
            chosen.append(task)
    return tuple(chosen)


def schema_text(conn: sqlite3.Connection) -> str:
    """The CREATE TABLE statements of the database, as stored in ``sqlite_master``."""
    rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' ORDER BY rowid").fetchall()
    return "\n".join(" ".join(sql.split()) + ";" for (sql,) in rows)


def parse_reply(text: Any) -> str | None:
    """The SQL (or ``submit``) in a reply: whitespace and a Markdown code fence are removed.

    Returns None for a non-string or an empty reply.
    """
    if not isinstance(text, str):
        return None
    reply = text.strip()
    fenced = _FENCE.match(reply)
    if fenced:
        reply = fenced.group(1).strip()
    return reply or None


# ----- environment -----
class SQLTextEnv(TextEnv):
    """Text-to-SQL: answer a question by querying a generated SQLite database, then submit (InterCode-SQL style).

    Task ids look like ``"shop.count_city.3"``. Each step runs one query (read-only, time-limited)
    and shows its result; ``submit`` ends the episode and succeeds when the last query that ran
    returned the gold query's rows.

    Args:
        max_turns: Budget of replies; reaching it without ``submit`` truncates (reward 0).
        db_seed: Seed of the generated rows (and so of the tasks drawn from them).
        per_template: Instances drawn per question template (before dropping empty or tied ones).
        eval_fraction: Share of questions in "eval" (by a hash of the question).
        split_seed: Salt of that hash.
        invalid_action_penalty: Reward subtracted for a reply that does not run (empty, refused,
            an SQLite error, a timeout or a result past ``max_result_bytes``).
        time_limit_s: Wall-clock limit of one query.
        max_rows_shown: Rows of a result shown in the observation.
        max_rows_read: Rows read back from a query; a bigger result never matches the gold.
        max_result_bytes: Bytes read back from a query (the sum of its cells: text as UTF-8, 8
            per number); a query past it is refused as "result too large" (an invalid reply).
        cache_dir: Where the generated databases are kept.
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    def __init__(
        self,
        *,
        max_turns: int = 10,
        db_seed: int = 0,
        per_template: int = 16,
        eval_fraction: float = 0.2,
        split_seed: int = 0,
        invalid_action_penalty: float = 0.1,
        time_limit_s: float = 1.0,
        max_rows_shown: int = 20,
        max_rows_read: int = 10_000,
        max_result_bytes: int = 1 << 20,
        cache_dir: str = DEFAULT_CACHE_DIR,
        render_mode: str | None = None,
    ) -> None:
        for name, value, minimum in (("max_turns", max_turns, 1), ("db_seed", db_seed, 0), ("per_template", per_template, 1),
                                     ("split_seed", split_seed, 0), ("max_rows_shown", max_rows_shown, 1),
                                     ("max_rows_read", max_rows_read, 1), ("max_result_bytes", max_result_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction!r} must be in (0, 1)")
        if isinstance(invalid_action_penalty, bool) or not isinstance(invalid_action_penalty, (int, float)) \
                or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
            raise ValueError(f"time_limit_s={time_limit_s!r} must be > 0")
        super().__init__(max_turns=max_turns, render_mode=render_mode, max_observation_chars=1 << 16,
                         max_action_chars=1 << 16)
        self.db_seed = db_seed
        self.per_template = per_template
        self.eval_fraction = float(eval_fraction)
        self.split_seed = split_seed
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.time_limit_s = float(time_limit_s)
        self.max_rows_shown = max_rows_shown
        self.max_rows_read = max_rows_read
        self.max_result_bytes = max_result_bytes
        self.cache_dir = str(cache_dir)
        self._conn: sqlite3.Connection | None = None
        self._conn_schema = ""
        self._sql_task: SQLTask | None = None
        self._gold = QueryResult()
        self._last = QueryResult(error="no query has run yet")  # the last query that ran without error

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids of every task in ``split`` ("train" or "eval"), same for same kwargs."""
        return [task.task_id for task in self._split(split)]

    def task(self, task_id: str) -> SQLTask:
        """The question and gold query of ``task_id``."""
        for split in SPLITS:
            for task in self._split(split):
                if task.task_id == task_id:
                    return task
        raise ValueError(f"unknown task id {task_id!r}; expected an id from task_ids('train') or task_ids('eval'), "
                         "e.g. 'shop.count_city.0'")

    def _split(self, split: str) -> tuple[SQLTask, ...]:
        check_split(split, SPLITS)
        return split_tasks(self.db_seed, self.cache_dir, self.per_template, self.eval_fraction, self.split_seed, split)

    # ----- episode -----
    def _start_episode(self, task: str) -> str:
        """Runs ``task``'s gold query and shows the schema and the question."""
        self._sql_task = self.task(task)
        conn = self._database()
        self._gold = run_query(conn, self._sql_task.gold_sql, time_limit_s=10.0, max_rows=self.max_rows_read)
        self._last = QueryResult(error="no query has run yet")
        return f"{INSTRUCTION}\nDatabase schema:\n{schema_text(conn)}\n\nQuestion: {self._sql_task.question}"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Runs one query, or ends the episode on ``submit``; a bad reply costs the penalty, never raises."""
        self._begin_turn()
        reply = parse_reply(action)
        terminated = success = False
        reward = 0.0
        if reply is None:
            valid = False
            obs = f"Invalid reply: it is empty. Reply with one SQL query, or {SUBMIT}."
        elif reply.lower().rstrip(";. ") == SUBMIT:
            valid, terminated = True, True
            success = same_result(self._last, self._gold, ordered=self._sql_task.ordered)
            reward = 1.0 if success else 0.0
            obs = "Submitted: " + ("correct." if success else "the last result does not answer the question.")
        else:
            result = run_query(self._database(), reply, time_limit_s=self.time_limit_s, max_rows=self.max_rows_read,
                               max_bytes=self.max_result_bytes)
            valid = result.error is None
            if valid:
                self._last = result
            obs = render_result(result, max_rows=self.max_rows_shown)
        if not valid:
            reward = -self.invalid_action_penalty
        truncated = self._end_turn(obs, terminated=terminated)
        return obs, reward, terminated, truncated, self._info(success=success, valid_action=valid)

    def close(self) -> None:
        """Closes the database connection (the next query reopens it)."""
        if self._conn is not None:
            self._conn.close()
        self._conn, self._conn_schema = None, ""

    def __getstate__(self) -> dict[str, Any]:
        # A connection cannot be copied or pickled; the copy reopens the (read-only) file when needed.
        state = dict(self.__dict__)
        state["_conn"], state["_conn_schema"] = None, ""
        return state

    def _database(self) -> sqlite3.Connection:
        assert self._sql_task is not None
        if self._conn is None or self._conn_schema != self._sql_task.schema:
            self.close()
            self._conn = open_readonly(database_path(self._sql_task.schema, self.db_seed, self.cache_dir))
            self._conn_schema = self._sql_task.schema
        return self._conn

    def _state_info(self) -> dict[str, Any]:
        assert self._sql_task is not None
        if self._done:
            expert = None
        elif same_result(self._last, self._gold, ordered=self._sql_task.ordered):
            expert = SUBMIT
        else:
            expert = self._sql_task.gold_sql
        return {"expert_action": expert}
