"""Tests of the prompt-dataset env on real files in each format (jsonl, parquet, save_to_disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.prompt_data.make_arith import arith_rows
from environments.prompt_dataset import PromptDatasetEnv, default_reward, render_messages
from opd.envs import check_env, make_env

ENV_ID = "opd/PromptDataset-v0"
ROOT = Path(__file__).resolve().parents[2]
ARITH = "environments/prompt_data/arith_tiny.jsonl"
ROWS = [{"prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b), "level": a % 3}
        for a in range(6) for b in range(5)]
CHATS = [{"messages": [{"role": "system", "content": "Answer in one word."},
                       {"role": "user", "content": f"Capital of {country}?"},
                       {"role": "assistant", "content": capital}]}
         for country, capital in [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo")]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def play(env, task: str, response: str):
    obs, info = env.reset(options={"task": task})
    return (obs, info), env.step(response)


@pytest.fixture()
def jsonl(tmp_path) -> Path:
    return write_jsonl(tmp_path / "arith.jsonl", ROWS)


# ----- contract -----
def test_check_env_passes_on_the_shipped_data() -> None:
    check_env(make_env(ENV_ID, path=ARITH))


def test_the_shipped_data_is_what_its_script_writes() -> None:
    rows = [json.loads(line) for line in (ROOT / ARITH).read_text().splitlines()]
    assert rows == arith_rows() and len(rows) > 300
    env = PromptDatasetEnv(path=ARITH)
    assert len(env.task_ids("eval")) == round(0.2 * len(rows))


def test_one_response_ends_the_episode(jsonl) -> None:
    env = PromptDatasetEnv(path=str(jsonl))
    task = env.task_ids("eval")[0]
    (obs, info), (obs2, reward, terminated, truncated, info2) = play(env, task, "\n\n " + env.task(task).answer)
    assert obs == env.task(task).prompt and info["expert_action"] == env.task(task).answer
    assert "admissible_actions" not in info and info["success"] is False
    assert (obs2, reward, terminated, truncated) == ("Correct.", 1.0, True, False)
    assert info2["success"] and info2["valid_action"] and info2["expert_action"] is None and info2["turn"] == 1
    with pytest.raises(RuntimeError, match="is over; call reset"):
        env.step("1")
    assert env.max_turns == 1


@pytest.mark.parametrize("response, says", [("", "empty"), (" \n ", "empty"), ("no idea", "has none"), (None, "empty")])
def test_an_empty_or_numberless_response_is_invalid(jsonl, response, says) -> None:
    env = PromptDatasetEnv(path=str(jsonl))
    _, (obs, reward, terminated, _, info) = play(env, env.task_ids("eval")[0], response)
    assert says in obs and reward == 0.0 and terminated and not info["valid_action"] and not info["success"]


# ----- formats -----
def test_jsonl_parquet_and_save_to_disk_give_the_same_tasks(tmp_path, jsonl) -> None:
    import datasets

    dataset = datasets.Dataset.from_list(ROWS)
    dataset.to_parquet(str(tmp_path / "arith.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "array.json").write_text(json.dumps(ROWS))
    envs = [PromptDatasetEnv(path=str(p)) for p in (jsonl, tmp_path / "arith.parquet", tmp_path / "saved",
                                                      tmp_path / "array.json")]
    envs.append(PromptDatasetEnv(path=str(tmp_path / "dict"), dataset_split="train"))
    for env in envs:
        assert [(t.prompt, t.answer) for t in env._tasks] == [(r["prompt"], r["answer"]) for r in ROWS]
        assert env.task_ids("eval") == envs[0].task_ids("eval") and env.task_ids("train") == envs[0].task_ids("train")
        assert env.task(env.task_ids("train")[0]).row["level"] in (0, 1, 2)
    assert len(PromptDatasetEnv(path=str(tmp_path / "dict"), dataset_split="test").task_ids("train")) == 2


def test_numbers_in_the_data_are_answers_as_text(tmp_path) -> None:
    env = PromptDatasetEnv(path=str(write_jsonl(tmp_path / "n.jsonl", [{"prompt": "1+1?", "answer": 2},
                                                                        {"prompt": "2+2?", "answer": None}])))
    assert [t.answer for t in env._tasks] == ["2", None]


def test_chat_prompts_render_system_then_user_and_a_trailing_assistant_is_the_answer(tmp_path) -> None:
    env = PromptDatasetEnv(path=str(write_jsonl(tmp_path / "chat.jsonl", CHATS)), prompt_column="messages")
    task = env.task("row-00000")
    assert task.prompt == "Answer in one word.\n\nCapital of France?" and task.answer == "Paris"
    _, (obs, reward, _, _, info) = play(env, "row-00000", "  paris\n")
    assert (obs, reward, info["success"]) == ("Correct.", 1.0, True)
    _, (obs, reward, _, _, info) = play(env, "row-00000", "Lyon")
    assert (obs, reward, info["success"], info["valid_action"]) == ("Incorrect.", 0.0, False, True)
    # check_env's garbage action must be invalid, which only a numeric answer makes it (no number).
    sums = [{"messages": [{"role": "user", "content": f"{a} + 1?"}, {"role": "assistant", "content": str(a + 1)}]}
            for a in range(6)]
    check_env(make_env(ENV_ID, path=str(write_jsonl(tmp_path / "sums.jsonl", sums)), prompt_column="messages"), n_steps=4)


def test_a_few_shot_chat_labels_its_turns() -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": [{"type": "text", "text": "3+3?"}]}]
    assert render_messages(messages) == ("User: 2+2?\n\nAssistant: 4\n\nUser: 3+3?", None)
    with pytest.raises(ValueError, match="must end with a user message"):
        render_messages([{"role": "system", "content": "Be brief."}])
    with pytest.raises(ValueError, match="message 0 is"):
        render_messages([{"role": "robot", "content": "hi"}])


# ----- rewards -----
@pytest.mark.parametrize("response, answer, reward", [
    ("42", "42", 1.0), ("\n\n 42", "42", 1.0), ("17 + 25 = 42.", "42", 1.0), ("42 or 43", "42", 0.0),
    ("1,000", "1000", 1.0), ("\\boxed{42}", "42", 1.0), ("-3", "-3", 1.0), ("3", "-3", 0.0),
    ("It is 72", "She earns 9 * 8 = 72.\n#### 72", 1.0),
    ("  The Eiffel   TOWER ", "the eiffel tower", 1.0), ("Eiffel", "the eiffel tower", 0.0), ("anything", None, 0.0),
])
def test_default_reward(response, answer, reward) -> None:
    assert default_reward(response, answer, {}) == reward


def test_without_answers_the_reward_is_zero_and_nothing_succeeds(tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Tell me about {x}."} for x in ("cats", "dogs", "owls")])
    env = PromptDatasetEnv(path=str(path))
    (_, info), (obs, reward, terminated, _, info2) = play(env, "row-00001", "They hoot.")
    assert info["expert_action"] is None and obs == "Response recorded."
    assert (reward, terminated, info2["success"], info2["valid_action"]) == (0.0, True, False, True)
    assert PromptDatasetEnv(path=str(write_jsonl(tmp_path / "a.jsonl", ROWS)), answer_column="")._tasks[0].answer is None


def test_a_custom_reward_fn_gets_the_raw_response_the_answer_and_the_row(tmp_path, monkeypatch, jsonl) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "CALLS = []\n"
        "def length_bonus(response, answer, row):\n"
        "    CALLS.append((response, answer, row))\n"
        "    return 0.5 + 0.1 * row['level']\n"
        "def broken(response, answer, row):\n"
        "    raise KeyError('nope')\n"
        "def not_a_number(response, answer, row):\n"
        "    return 'high'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_rewards

    for name in ("my_rewards:length_bonus", "my_rewards.length_bonus"):
        env = PromptDatasetEnv(path=str(jsonl), reward_fn=name, success_threshold=0.6)
        task = env.task_ids("train")[0]
        _, (obs, reward, _, _, info) = play(env, task, " 7\n")
        level = env.task(task).row["level"]
        assert reward == pytest.approx(0.5 + 0.1 * level) and info["success"] == (level >= 1)
        assert obs == ("Correct." if level >= 1 else "Incorrect.")
        assert my_rewards.CALLS[-1] == (" 7\n", env.task(task).answer, ROWS[int(task[4:])])
    for name, says in (("my_rewards:broken", "raised on task 'row-.*KeyError"),
                       ("my_rewards:not_a_number", "returned 'high'")):
        env = PromptDatasetEnv(path=str(jsonl), reward_fn=name)
        env.reset(options={"task": "row-00000"})
        with pytest.raises(RuntimeError, match=f"reward_fn='{name}' {says}"):
            env.step("5")


# ----- splits -----
def test_splits_are_deterministic_disjoint_by_prompt_and_follow_the_kwargs(tmp_path) -> None:
    rows = ROWS + ROWS[:4]  # four prompts twice: each pair must land in one split
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    first, second = PromptDatasetEnv(path=str(path)), PromptDatasetEnv(path=str(path))
    train, eval_ = first.task_ids("train"), first.task_ids("eval")
    assert (train, eval_) == (second.task_ids("train"), second.task_ids("eval"))
    assert sorted(train + eval_) == [f"row-{i:05d}" for i in range(len(rows))]
    prompts = {split: {first.task(t).prompt for t in first.task_ids(split)} for split in ("train", "eval")}
    assert not prompts["train"] & prompts["eval"] and len(prompts["eval"]) == round(0.2 * len(ROWS))
    assert len(PromptDatasetEnv(path=str(path), eval_fraction=0.5).task_ids("eval")) >= len(ROWS) // 2
    assert PromptDatasetEnv(path=str(path), split_seed=1).task_ids("eval") != eval_
    with pytest.raises(ValueError, match="unknown split 'test'"):
        first.task_ids("test")
    with pytest.raises(ValueError, match="unknown task id 'row-99999'"):
        first.reset(options={"task": "row-99999"})


# ----- errors -----
def test_errors_name_the_kwarg_the_file_and_the_fix(tmp_path, jsonl) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    (tmp_path / "data.csv").write_text("prompt\nhi\n")
    (tmp_path / "not_saved").mkdir()
    cases = [
        ({"path": str(tmp_path / "missing.jsonl")}, r"path='.*missing.jsonl': no such file or directory .* set env\.kwargs\.path"),
        ({"path": str(jsonl), "prompt_column": "question"},
         r"prompt_column='question': '.*arith.jsonl' has no column 'question' \(its columns: 'prompt', 'answer', "
         r"'level'\); set env\.kwargs\.prompt_column"),
        ({"path": str(jsonl), "answer_column": "solution"}, r"answer_column='solution': .* set env\.kwargs\.answer_column"),
        ({"path": str(jsonl), "reward_fn": "no_such_module:score"},
         r"reward_fn='no_such_module:score': cannot import module 'no_such_module' \(ModuleNotFoundError"),
        ({"path": str(jsonl), "reward_fn": "json:no_such_fn"}, r"module 'json' has no attribute 'no_such_fn'; name a function"),
        ({"path": str(jsonl), "reward_fn": "score"}, r"reward_fn='score' is not a dotted path"),
        ({"path": str(tmp_path / "bad.jsonl")}, r"line 2 is not JSON"),
        ({"path": str(tmp_path / "data.csv")}, r"cannot read \.csv; give a \.jsonl, \.json, \.parquet file"),
        ({"path": str(tmp_path / "not_saved")}, r"datasets\.load_from_disk cannot read this directory"),
        ({"path": str(jsonl), "dataset_split": "train"}, r"dataset_split='train' is for a directory"),
        ({"path": str(jsonl), "max_turns": 3}, r"max_turns=3: a prompt-dataset episode is one response"),
        ({"path": str(jsonl), "eval_fraction": 1.0}, r"eval_fraction=1.0 must be in \(0, 1\)"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            PromptDatasetEnv(**kwargs)


def test_a_recipe_with_a_bad_kwarg_is_one_config_error(tmp_path) -> None:
    from opd.config import ConfigError, load_config

    recipe = ROOT / "recipes" / "prompt_dataset.yaml"
    with pytest.raises(ConfigError, match=r"key 'env': prompt_column='question': .*set env\.kwargs\.prompt_column"):
        load_config(recipe, ["env.kwargs.prompt_column=question"])
    with pytest.raises(ConfigError, match=r"key 'env': path='nowhere.jsonl': no such file"):
        load_config(recipe, ["env.kwargs.path=nowhere.jsonl"])


# ----- the CPU bootstrap -----
def test_the_bootstrap_learns_answers_from_the_expert_and_its_tokenizer_spells_numbers(tmp_path) -> None:
    from omegaconf import OmegaConf

    from opd.bootstrap.rows import scripted_episode, scripted_policy
    from opd.bootstrap.tokenizer import build_tokenizer
    from opd.schema import EnvConfig

    env = PromptDatasetEnv(path=ARITH)
    task = env.task_ids("train")[0]
    steps = scripted_episode(env, task, scripted_policy("expert", None), seed=0)
    assert steps == [(env.task(task).prompt, env.task(task).answer, True), ("Correct.", "", False)]
    env_cfg = OmegaConf.structured(EnvConfig(id=ENV_ID, kwargs={"path": ARITH}))
    tokenizer = build_tokenizer(env_cfg, vocab_size=320, cache_root=tmp_path, corpus_episodes=20)
    for text in ("What is 17 + 25? Answer with the number.", "42", "-7", "1234"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
