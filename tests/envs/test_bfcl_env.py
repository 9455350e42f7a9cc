"""Tests of the BFCL multi-turn env on the real bfcl_eval data, backend and checker (no mocks)."""

from __future__ import annotations

import ast

import pytest

pytest.importorskip("bfcl_eval", reason="the BFCL env needs `pip install --no-deps bfcl-eval`")

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402

from environments.bfcl_env import (  # noqa: E402
    CATEGORIES,
    END_TURN,
    ActionError,
    BFCLMultiTurnEnv,
    Call,
    load_entries,
    parse_calls,
)
from opd.envs import check_env, make_env  # noqa: E402

ENV_ID = "opd/BFCLMultiTurn-v0"


def play_expert(env: BFCLMultiTurnEnv, task: str) -> tuple[float, dict, int]:
    """Runs the env's expert to the end; returns (last reward, last info, steps)."""
    _, info = env.reset(options={"task": task})
    steps = 0
    while True:
        _, reward, terminated, truncated, info = env.step(info["expert_action"])
        steps += 1
        if terminated or truncated:
            return reward, info, steps


# ----- contract -----
def test_check_env_passes() -> None:
    check_env(ENV_ID)


def test_same_actions_give_same_trajectory() -> None:
    task = "multi_turn_base_0"
    actions = ["[cd(folder='document')]", "@@ junk", "[ls(), mkdir(dir_name='temp')]", END_TURN,
               "[cd(folder='temp'), grep(file_name='x.pdf', pattern='a')]", END_TURN, END_TURN, END_TURN]
    runs = []
    for _ in range(2):
        env = make_env(ENV_ID)
        trace = [env.reset(seed=3, options={"task": task})]
        trace += [env.step(a) for a in actions]
        runs.append(trace)
    assert runs[0] == runs[1]
    assert runs[0][-1][2] is True  # all four requests answered: terminated


@pytest.mark.parametrize("action", ["", "   ", "@@ not an action @@", "ls(", "[1, 2]", "import os", None, 42])
def test_bad_reply_is_an_observation(action) -> None:
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": "multi_turn_base_0"})
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith("Invalid reply: ") and END_TURN in obs
    assert (reward, terminated, truncated, info["valid_action"], info["success"]) == (-0.1, False, False, False, False)
    assert info["request"] == 0  # a bad reply does not end the turn


@pytest.mark.parametrize(("action", "why"), [
    ("[exec('import os')]", "function 'exec' is not one of the functions you were given"),
    ("[__import__('os').system('true')]", "is not a call of a function by its plain name"),
    ("[cd(folder=open('/etc/passwd').read())]", "is not a literal"),
    ("[echo(content='x' * 10**9, file_name='f')]", "is not a literal"),
    ("[cd(**{'folder': 'x'})]", "unpacks arguments with **"),
    ("[ls(a=True, a=False)]", "repeats a keyword argument"),
])
def test_unsafe_replies_run_nothing(action, why) -> None:
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": "multi_turn_base_0"})
    obs, _, _, _, info = env.step(action)
    assert why in obs
    assert env._decoded == [[]]  # nothing reached the backend or the checker's record


@pytest.mark.parametrize(("action", "why"), [
    # 4,000 hex digits parse, but repr() of the value raised past Python's 4,300-digit limit.
    ("[ls(a=0x" + "f" * 4000 + ")]", "integer literal too long: an argument of ls has more than 100 digits"),
    ("[ls(a=" + "9" * 4000 + ")]", "integer literal too long: an argument of ls has more than 100 digits"),
    ("[ls(a=" + "9" * 10_000 + ")]", "integer literal too long: a number has more than 100 digits"),
    ("[ls(a=[1, {'k': -" + "9" * 101 + "}])]", "integer literal too long: an argument of ls has more than 100 digits"),
    ("[ls(a=1e400)]", "float literal out of range: an argument of ls is inf; numbers must be finite"),
    ("[ls(a=1" + "0" * 5000 + ".0)]", "float literal out of range: an argument of ls is inf; numbers must be finite"),
    ("[echo(content='" + "x" * 20_000 + "', file_name='f')]",
     "string literal too long: an argument of echo has 20000 characters; at most 16384"),
    ("[ls(a=[" + "0," * 40_000 + "])]", "it has 80010 characters; at most 65536"),
])
def test_oversized_literals_are_invalid_actions(action, why) -> None:
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": "multi_turn_base_0"})
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith(f"Invalid reply: {why}. ")
    assert (reward, terminated, truncated, info["valid_action"]) == (-0.1, False, False, False)
    assert env._decoded == [[]]
    assert env.step("[ls(a=" + "9" * 100 + ")]")[4]["valid_action"]  # 100 digits are fine; the episode goes on


def test_string_arguments_reach_the_backend_unchanged() -> None:
    # BFCL's executor prefixes every "name(" in the call text with its instance name, inside
    # strings too; the env's rendering leaves no "(" in a string for it to match.
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": "multi_turn_base_0"})
    names = ["run ls() then cd(x)", "a(b", "it's (\n) ok"]
    obs, _, _, _, info = env.step("[" + ", ".join(f"touch(file_name={n!r})" for n in names) + ", ls()]")
    assert info["valid_action"] and "_instance" not in obs
    assert obs.splitlines()[-1] == ('ls() -> {"current_directory_content": ["document", "archive", '
                                    '"run ls() then cd(x)", "a(b", "it\'s (\\n) ok"]}')
    assert obs.splitlines()[1] == "touch(file_name='run ls() then cd(x)') -> None"  # shown as written
    call = Call("f", ("g(1)",), (("x", [{"h(": b"i("}, ("j(",)]),))
    qualified = multi_turn_utils._process_method_calls(call.backend_source(), {"f": "inst", "g": "inst", "h": "inst"})
    assert qualified.startswith("inst.f(") and "inst" not in qualified[len("inst.f("):]
    node = ast.parse(qualified, mode="eval").body
    assert [ast.literal_eval(a) for a in node.args] == list(call.args)
    assert [(k.arg, ast.literal_eval(k.value)) for k in node.keywords] == list(call.kwargs)


@pytest.mark.timeout(60)  # computed, 10^(10^12) would take the machine's memory and hours
def test_unbounded_math_is_refused() -> None:
    env = BFCLMultiTurnEnv()
    task = next(i for i, e in load_entries().items() if "MathAPI" in e["involved_classes"])
    env.reset(options={"task": task})
    obs, _, _, _, info = env.step("[power(base=10, exponent=1000000000000), logarithm(value=10, base=2, "
                                  "precision=1000000000), power(base=2, exponent=10)]")
    lines = obs.splitlines()
    assert lines[1].endswith("Error during execution: the exact result would exceed 100000 bits")
    assert lines[2].endswith("Error during execution: precision is limited to 1000 digits")
    assert lines[3] == 'power(base=2, exponent=10) -> {"result": 1024}'
    assert info["valid_action"]


# ----- expert, reward, checker -----
@pytest.mark.parametrize("category", CATEGORIES)
def test_expert_solves_eval_tasks(category) -> None:
    env = BFCLMultiTurnEnv(categories=(category,))
    for task in env.task_ids("eval")[:4]:
        reward, info, steps = play_expert(env, task)
        truth = load_entries()[task]["ground_truth"]
        # One reply with the turn's calls plus one [] per request (just [] where nothing is due).
        assert steps == len(truth) + sum(1 for turn in truth if turn)
        assert (reward, info["success"], info["checker"]["valid"]) == (1.0, True, True)


def test_ending_every_turn_at_once_fails_the_checker() -> None:
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": "multi_turn_base_0"})
    for _ in range(3):
        obs, reward, terminated, _, info = env.step(END_TURN)
        assert (reward, terminated) == (0.0, False) and obs.startswith("User: ")
    obs, reward, terminated, _, info = env.step(END_TURN)
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    assert info["checker"]["error_type"] == "multi_turn:empty_turn_model_response"
    assert obs.startswith("All requests are done. The checker failed: Model response list is empty for turn 0")


def test_reset_observation_and_first_step() -> None:
    env = BFCLMultiTurnEnv()
    obs, info = env.reset(options={"task": "multi_turn_base_0"})
    assert obs.startswith("You are an expert in composing functions.")
    assert '{"name": "cd", "description": "This tool belongs to the Gorilla file system.' in obs
    assert obs.endswith("User: Move 'final_report.pdf' within document directory to 'temp' directory in document. "
                        "Make sure to create the directory")
    assert info == {"success": False, "valid_action": True, "task": "multi_turn_base_0", "turn": 0, "request": 0,
                    "n_requests": 4, "expert_action": "[cd(folder='document'), mkdir(dir_name='temp'), "
                                                      "mv(source='final_report.pdf', destination='temp')]"}
    obs, reward, _, _, info = env.step("[cd(folder='document')]")
    assert obs == 'Tool results:\ncd(folder=\'document\') -> {"current_working_directory": "document"}'
    assert reward == 0.0
    # The expert continues from the calls already made; after a detour it has no advice.
    assert info["expert_action"] == "[mkdir(dir_name='temp'), mv(source='final_report.pdf', destination='temp')]"
    _, _, _, _, info = env.step("[ls()]")
    assert info["expert_action"] is None


def test_miss_func_reveals_the_held_out_function_at_its_turn() -> None:
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": "multi_turn_miss_func_0"})  # "sort" is held out until request 3
    assert '"name": "sort"' not in env.render()
    obs, _, _, _, _ = env.step("[sort(file_name='final_report.pdf')]")
    assert "function 'sort' is not one of the functions you were given" in obs
    for _ in range(3):
        obs, _, _, _, info = env.step(END_TURN)
    assert info["request"] == 3
    assert obs.startswith('User: {"name": "sort"')
    assert obs.endswith("I have updated some more functions you can choose from. What about now?")
    obs, _, _, _, _ = env.step("[sort(file_name='nothing.txt')]")
    assert "not one of the functions" not in obs


def test_turn_budget_truncates() -> None:
    env = BFCLMultiTurnEnv(max_turns=2)
    env.reset(options={"task": "multi_turn_base_0"})
    assert env.step("[ls()]")[3] is False
    _, reward, terminated, truncated, info = env.step("[ls()]")
    assert (reward, terminated, truncated, info["success"]) == (0.0, False, True, False)
    with pytest.raises(RuntimeError, match="is over"):
        env.step(END_TURN)


def test_long_results_are_cut() -> None:
    env = BFCLMultiTurnEnv(categories=("long_context",), max_result_chars=100)
    task = "multi_turn_long_context_104"
    _, info = env.reset(options={"task": task})
    obs = ""
    while "more characters cut]" not in obs:
        obs, _, terminated, _, info = env.step(info["expert_action"])
        assert not terminated
    assert max(len(line) for line in obs.splitlines()) < 300


def test_backend_objects_do_not_accumulate() -> None:
    env = BFCLMultiTurnEnv()
    before = {k for k in vars(multi_turn_utils) if k.startswith("opd_")}
    for task in env.task_ids("eval")[:3]:
        play_expert(env, task)
    assert {k for k in vars(multi_turn_utils) if k.startswith("opd_")} == before == set()


# ----- splits -----
def test_splits_are_disjoint_by_scenario_and_sized() -> None:
    env = BFCLMultiTurnEnv()
    train, evals = env.task_ids("train"), env.task_ids("eval")
    assert (len(train), len(evals)) == (632, 168)
    assert train == BFCLMultiTurnEnv().task_ids("train") and evals == BFCLMultiTurnEnv().task_ids("eval")
    scenario = {t: t.rsplit("_", 1)[1] for t in train + evals}
    first_request = {t: load_entries()[f"multi_turn_base_{scenario[t]}"]["question"][0][0]["content"] for t in scenario}
    assert not {scenario[t] for t in train} & {scenario[t] for t in evals}
    assert not {first_request[t] for t in train} & {first_request[t] for t in evals}
    # Every scenario has its four variants on the same side.
    assert len(evals) == 4 * len({scenario[t] for t in evals})
    base_only = BFCLMultiTurnEnv(categories=("base",))
    assert base_only.task_ids("eval") == [t for t in evals if t.startswith("multi_turn_base_")]
    assert BFCLMultiTurnEnv(split_seed=1).task_ids("eval") != evals


def test_unknown_split_and_task_raise() -> None:
    env = BFCLMultiTurnEnv(categories=("base",))
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.task_ids("test")
    with pytest.raises(ValueError, match="unknown task id 'multi_turn_miss_param_0'"):
        env.reset(options={"task": "multi_turn_miss_param_0"})
    with pytest.raises(ValueError, match="categories"):
        BFCLMultiTurnEnv(categories=("memory",))


def test_seeded_reset_picks_train_tasks() -> None:
    a, b = BFCLMultiTurnEnv(), BFCLMultiTurnEnv()
    tasks = [a.reset(seed=s)[1]["task"] for s in range(5)]
    assert tasks == [b.reset(seed=s)[1]["task"] for s in range(5)]
    assert set(tasks) <= set(a.task_ids("train")) and len(set(tasks)) > 1


# ----- reply parsing -----
@pytest.mark.parametrize(("text", "calls"), [
    ("[]", []),
    ("ls()", [Call("ls", (), ())]),
    ("```python\n[cd(folder='a'), ls(a=True)]\n```", [Call("cd", (), (("folder", "a"),)), Call("ls", (), (("a", True),))]),
    ("  [sort('f.txt'), mean(numbers=[1, -2.5])]  ", [Call("sort", ("f.txt",), ()), Call("mean", (), (("numbers", [1, -2.5]),))]),
])
def test_parse_calls(text, calls) -> None:
    assert parse_calls(text) == calls


def test_call_renders_as_source_the_backend_can_run() -> None:
    call = Call("echo", ("it's\n",), (("file_name", "a.txt"), ("n", None)))
    assert call.render() == "echo(\"it's\\n\", file_name='a.txt', n=None)"
    assert parse_calls(call.render()) == [call]


def test_parse_calls_rejects_expressions() -> None:
    with pytest.raises(ActionError, match="not a literal"):
        parse_calls("[cd(folder=x)]")
