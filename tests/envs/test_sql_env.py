"""Tests of the SQL env on its real generated SQLite databases (no mocks)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys

import pytest

from environments.sql_env import SQLTextEnv
from environments.sql_env.data import TEMPLATES
from environments.sql_env.env import (
    ALLOWED_FUNCTIONS,
    SUBMIT,
    QueryResult,
    all_tasks,
    database_path,
    open_readonly,
    render_result,
    run_query,
    same_result,
)
from opd.envs import check_env, make_env

ENV_ID = "opd/SQLText-v0"
REFUSED = " (allowed: common scalar, date and time, math, aggregate and window functions)"
# A 81,920-byte string x from a doubling CTE, built with allowed functions only.
BIG_X = ("WITH RECURSIVE d(i, x) AS (SELECT 1, 'xxxxxxxxxx' UNION ALL SELECT i + 1, x || x FROM d WHERE i < 14), "
         "b(x) AS (SELECT x FROM d WHERE i = 14), r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 10000) ")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sql-cache"))


@pytest.fixture(scope="module")
def env(cache) -> SQLTextEnv:
    return SQLTextEnv(cache_dir=cache)


def task_of(env: SQLTextEnv, template: str) -> str:
    """The first task id (either split) made from ``template``, e.g. "shop.products_by_price"."""
    return next(t for t in env.task_ids("train") + env.task_ids("eval") if t.startswith(template + "."))


def run(env: SQLTextEnv, task: str, *actions: str):
    env.reset(options={"task": task})
    return [env.step(a) for a in actions]


# ----- contract -----
def test_check_env_passes(cache) -> None:
    check_env(make_env(ENV_ID, cache_dir=cache))


def test_same_actions_give_same_trajectory(cache) -> None:
    actions = ["SELECT * FROM customers", "SELEC nonsense", "SELECT COUNT(*) FROM orders", "", SUBMIT]
    runs = []
    for _ in range(2):
        e = make_env(ENV_ID, cache_dir=cache)
        trace = [e.reset(seed=7)]
        trace += [e.step(a) for a in actions]
        runs.append(trace)
    assert runs[0] == runs[1]
    assert runs[0][-1][2] is True  # submitted


@pytest.mark.parametrize("action", ["", "  \n", "@@ not an action @@", "SELECT * FROM nowhere", "SELECT 1; SELECT 2",
                                    None, 42])
def test_bad_reply_is_an_observation(env, action) -> None:
    env.reset(options={"task": env.task_ids("eval")[0]})
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith(("Error: ", "Invalid reply: "))
    assert (reward, terminated, truncated, info["valid_action"], info["success"]) == (-0.1, False, False, False, False)


@pytest.mark.parametrize(("query", "error"), [
    ("DELETE FROM customers", "not authorized"),
    ("DROP TABLE orders", "not authorized"),
    ("UPDATE products SET price = 0", "not authorized"),
    ("CREATE TABLE t (x)", "not authorized"),
    ("PRAGMA query_only = 0", "not authorized"),
    ("ATTACH DATABASE 'other.db' AS other", "not authorized"),
    ("SELECT random()", "not authorized to use function: random" + REFUSED),
    ("SELECT printf('%.*c', 1000000000, 'x')", "not authorized to use function: printf" + REFUSED),
    ("SELECT zeroblob(300000000)", "not authorized to use function: zeroblob" + REFUSED),
    ("SELECT length(randomblob(300000000))", "not authorized to use function: randomblob" + REFUSED),
    ("SELECT hex(fts3_tokenizer('simple'))", "not authorized to use function: fts3_tokenizer" + REFUSED),
    ("SELECT load_extension('/tmp/x.so')", "not authorized to use function: load_extension" + REFUSED),
    ("SELECT current_date", "not authorized to use function: current_date" + REFUSED),
    # Growth through allowed functions stops at SQLite's limits.
    ("WITH RECURSIVE r(i, s) AS (SELECT 1, 'x' UNION ALL SELECT i + 1, s || s FROM r WHERE i < 29) SELECT length(s) FROM r",
     "string or blob too big"),
    ("SELECT length(" + "replace(" * 8 + "'xxxxxxxxxx'" + ", 'x', 'xxxxxxxxxx')" * 8 + ")", "string or blob too big"),
    ("SELECT " + ", ".join(["1"] * 65), "too many columns in result set"),
    ("SELECT ?250000", "variable number must be between ?1 and ?0"),
])
def test_queries_cannot_write_or_blow_up(env, cache, query, error) -> None:
    path = database_path("shop", 0, cache)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    [(obs, _, _, _, info)] = run(env, task_of(env, "shop.count_city"), query)
    assert obs == f"Error: {error}" and not info["valid_action"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_fts3_tokenizer_is_refused_and_the_episode_goes_on(env) -> None:
    # fts3_tokenizer('simple') returns a process address; with two arguments it installs a pointer.
    task = task_of(env, "shop.count_city")
    gold = env.task(task).gold_sql
    steps = run(env, task, gold, "SELECT fts3_tokenizer('simple', x'0000000000000000')", SUBMIT)
    obs, reward, terminated, truncated, info = steps[1]
    assert obs == "Error: not authorized to use function: fts3_tokenizer" + REFUSED
    assert (reward, terminated, truncated, info["valid_action"]) == (-0.1, False, False, False)
    assert steps[2][1:3] == (1.0, True)  # the refused query did not replace the gold result


def test_result_bytes_are_capped(cache) -> None:
    env = SQLTextEnv(cache_dir=cache, max_result_bytes=100)
    task = task_of(env, "shop.count_city")
    gold = env.task(task).gold_sql
    steps = run(env, task, gold, "SELECT id, name FROM customers", SUBMIT)
    obs, reward, terminated, _, info = steps[1]
    assert obs.startswith("Error: result too large: over 100 bytes (max_result_bytes) after ")
    assert (reward, terminated, info["valid_action"]) == (-0.1, False, False)
    assert steps[2][1] == 1.0  # gold results are read without the cap, and the refused query did not count
    [(obs, _, _, _, info)] = run(SQLTextEnv(cache_dir=cache), task, "SELECT id, name FROM customers")
    assert info["valid_action"] and obs.endswith("(120 rows; first 20 shown)")


@pytest.mark.timeout(60)  # reading all 800 MB would take minutes and the memory with it
def test_a_big_result_stops_at_the_byte_cap(env) -> None:
    # 10,000 rows of 80 kB (800 MB) from allowed functions: reading stops after 13 rows (1 MB).
    [(obs, reward, _, _, info)] = run(env, task_of(env, "shop.count_city"), BIG_X + "SELECT x FROM r, b")
    assert obs == ("Error: result too large: over 1048576 bytes (max_result_bytes) after 13 rows; select fewer rows "
                   "or columns, shorter values, or aggregate")
    assert (reward, info["valid_action"]) == (-0.1, False)


_MEASURE_BOMBS = """
import json, resource, sys
from environments.sql_env import SQLTextEnv
env = SQLTextEnv(cache_dir=sys.argv[1], time_limit_s=0.3)
env.reset(options={"task": env.task_ids("eval")[0]})
env.step("SELECT 1")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
observations = {name: env.step(sql)[0] for name, sql in json.loads(sys.argv[2]).items()}
growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"growth_mb": growth_mb, "observations": observations}))
"""


def test_memory_bombs_keep_the_process_small(cache) -> None:
    # Peak RSS (ru_maxrss) in a fresh process, so earlier tests' peaks hide nothing. Without the
    # guards each of these holds 0.5-2 GB; the widest row the limits allow (64 x 80 kB) is the
    # biggest allocation left, about 10 MB measured alone.
    bombs = {
        "zeroblob": "SELECT zeroblob(300000000)",
        "doubling CTE": "WITH RECURSIVE r(i, s) AS (SELECT 1, 'x' UNION ALL SELECT i + 1, s || s FROM r WHERE i < 29) "
                        "SELECT length(s) FROM r",
        "replace": "SELECT length(" + "replace(" * 8 + "'xxxxxxxxxx'" + ", 'x', 'xxxxxxxxxx')" * 8 + ")",
        "group_concat": BIG_X + "SELECT length(group_concat(x)) FROM r, b",
        "many rows": BIG_X + "SELECT x FROM r, b",
        "wide row": BIG_X + "SELECT " + ", ".join(["x"] * 64) + " FROM b",
        "sort": BIG_X + "SELECT i FROM r, b ORDER BY x || i DESC",
    }
    out = subprocess.run([sys.executable, "-c", _MEASURE_BOMBS, cache, json.dumps(bombs)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    measured = json.loads(out)
    for name, obs in measured["observations"].items():
        assert obs.startswith("Error: "), (name, obs)
    assert measured["growth_mb"] < 32, measured


def test_every_gold_query_runs_under_the_guards(cache) -> None:
    # Every template keeps instances, and each gold query (train and eval) runs under the
    # allow-list and limits on a model's connection, with a full result under the byte cap.
    tasks = all_tasks(0, cache, 16)
    assert {t.task_id.rsplit(".", 1)[0] for t in tasks} == {f"{t.schema}.{t.name}" for t in TEMPLATES}
    connections = {schema: open_readonly(database_path(schema, 0, cache)) for schema in ("shop", "school", "flights")}
    try:
        for task in tasks:
            result = run_query(connections[task.schema], task.gold_sql, time_limit_s=10.0, max_rows=10_000,
                               max_bytes=1 << 20)
            assert result.error is None and result.complete and result.rows, (task.task_id, result.error)
    finally:
        for conn in connections.values():
            conn.close()
    assert {"count", "sum", "avg", "min", "max", "round", "substr", "date"} <= ALLOWED_FUNCTIONS


@pytest.mark.timeout(60)  # uninterrupted, the query never ends
def test_runaway_query_is_interrupted(cache) -> None:
    env = SQLTextEnv(cache_dir=cache, time_limit_s=0.2)
    [(obs, reward, _, _, info)] = run(env, task_of(env, "shop.count_city"),
                                      "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT COUNT(*) FROM n")
    assert obs == "Error: interrupted: the query ran past the 0.2 s limit"
    assert (reward, info["valid_action"]) == (-0.1, False)


# ----- expert, reward, success -----
def test_expert_solves_every_eval_task(env) -> None:
    for task in env.task_ids("eval"):
        obs, info = env.reset(options={"task": task})
        assert info["expert_action"] == env.task(task).gold_sql
        _, reward, terminated, _, info = env.step(info["expert_action"])
        assert (reward, terminated, info["expert_action"]) == (0.0, False, SUBMIT)
        obs, reward, terminated, _, info = env.step(info["expert_action"])
        assert (obs, reward, terminated, info["success"]) == ("Submitted: correct.", 1.0, True, True), task


def test_reset_observation_shows_schema_and_question(env) -> None:
    task = task_of(env, "shop.count_city")
    obs, info = env.reset(options={"task": task})
    assert obs.startswith("Answer the question by querying the SQLite database below.")
    assert "CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id)," in obs
    assert obs.endswith(f"\n\nQuestion: {env.task(task).question}")
    assert info == {"success": False, "valid_action": True, "task": task, "turn": 0,
                    "expert_action": env.task(task).gold_sql}


def test_row_order_counts_only_when_the_gold_query_sorts(env) -> None:
    unordered = task_of(env, "shop.customers_country")
    gold = env.task(unordered).gold_sql
    assert not env.task(unordered).ordered
    assert run(env, unordered, gold + " ORDER BY name DESC", SUBMIT)[-1][1] == 1.0
    assert run(env, unordered, gold.replace("SELECT name", "SELECT name AS who"), SUBMIT)[-1][1] == 1.0  # names ignored
    assert run(env, unordered, gold.replace("SELECT name", "SELECT name, city"), SUBMIT)[-1][1] == 0.0
    ordered = task_of(env, "shop.products_by_price")
    gold = env.task(ordered).gold_sql
    assert env.task(ordered).ordered
    assert run(env, ordered, gold, SUBMIT)[-1][1] == 1.0
    obs, reward, terminated, _, info = run(env, ordered, gold + " DESC", SUBMIT)[-1]
    assert (obs, reward, terminated, info["success"]) == (
        "Submitted: the last result does not answer the question.", 0.0, True, False)


def test_the_last_query_that_ran_is_judged(env) -> None:
    task = task_of(env, "school.count_year")
    gold = env.task(task).gold_sql
    steps = run(env, task, gold, "SELECT nonsense FROM", SUBMIT)
    assert steps[-1][1] == 1.0  # a failed query does not replace the last result
    assert run(env, task, gold, "SELECT 1", SUBMIT)[-1][1] == 0.0
    assert run(env, task, SUBMIT)[-1][1:3] == (0.0, True)  # nothing ran


def test_expert_recovers_after_a_wrong_query(env) -> None:
    task = task_of(env, "flights.cheapest_route")
    [(_, _, _, _, info)] = run(env, task, "SELECT 1")
    assert info["expert_action"] == env.task(task).gold_sql


def test_turn_budget_truncates(cache) -> None:
    env = SQLTextEnv(cache_dir=cache, max_turns=2)
    steps = run(env, task_of(env, "shop.count_city"), "SELECT 1", "SELECT 2")
    assert steps[0][3] is False
    _, reward, terminated, truncated, info = steps[1]
    assert (reward, terminated, truncated, info["success"], info["expert_action"]) == (0.0, False, True, False, None)
    with pytest.raises(RuntimeError, match="is over"):
        env.step(SUBMIT)


def test_results_are_shown_cut_to_a_few_rows(env) -> None:
    [(obs, _, _, _, _)] = run(env, task_of(env, "shop.count_city"), "SELECT id, name FROM customers ORDER BY id")
    lines = obs.splitlines()
    assert lines[0] == "id | name" and lines[1].startswith("1 | ")
    assert len(lines) == 22 and lines[-1] == "(120 rows; first 20 shown)"
    assert render_result(QueryResult(("n",), ((None,),)), max_rows=5) == "n\nNULL\n(1 row)"


def test_same_result_compares_rows_not_names() -> None:
    gold = QueryResult(("a", "b"), ((1, 2.0), (3, 4.5)))
    assert same_result(QueryResult(("x", "y"), ((3, 4.5000000001), (1, 2))), gold, ordered=False)
    assert not same_result(QueryResult(("x", "y"), ((3, 4.5), (1, 2))), gold, ordered=True)
    assert not same_result(QueryResult(("a", "b"), gold.rows, complete=False), gold, ordered=False)


# ----- data and splits -----
def test_splits_are_disjoint_by_content_and_sized(env, cache) -> None:
    train, evals = env.task_ids("train"), env.task_ids("eval")
    assert (len(train), len(evals)) == (387, 104)
    assert train == SQLTextEnv(cache_dir=cache).task_ids("train")
    for field in ("question", "gold_sql"):
        assert not {getattr(env.task(t), field) for t in train} & {getattr(env.task(t), field) for t in evals}
    assert {env.task(t).schema for t in evals} == {"shop", "school", "flights"}
    assert SQLTextEnv(cache_dir=cache, split_seed=1).task_ids("eval") != evals


def test_databases_are_built_once_atomically_and_deterministically(tmp_path) -> None:
    first = database_path("flights", 3, tmp_path / "a")
    assert first.name == "flights-seed3-v1.sqlite"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left behind
    mtime = first.stat().st_mtime_ns
    assert database_path("flights", 3, tmp_path / "a").stat().st_mtime_ns == mtime  # reused, not rebuilt

    def dump(path):
        with sqlite3.connect(path) as conn:
            return list(conn.iterdump())

    assert dump(database_path("flights", 3, tmp_path / "b")) == dump(first)
    assert dump(database_path("flights", 4, tmp_path / "b")) != dump(first)


def test_unknown_split_task_and_kwargs_raise(env) -> None:
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.task_ids("test")
    with pytest.raises(ValueError, match="unknown task id 'shop.nope.0'"):
        env.reset(options={"task": "shop.nope.0"})
    with pytest.raises(ValueError, match="time_limit_s=0"):
        SQLTextEnv(time_limit_s=0)
    with pytest.raises(ValueError, match="max_turns=0"):
        SQLTextEnv(max_turns=0)
    with pytest.raises(ValueError, match="max_result_bytes=0"):
        SQLTextEnv(max_result_bytes=0)
