"""Reference trajectories: the expert's, the teacher's and a user's; stored as a ``datasets``
dataset, keyed by content, filtered to the successful ones, and loaded back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.frozenlake import FrozenLakeTextEnv
from opd.config import ConfigError, load_config
from opd.rollout.references import (META_FILE, Reference, build_references, dataset_references, expert_reference,
                                    load_references, read_references, references_dir, save_references,
                                    trajectory_reference)

TINY = Path(__file__).resolve().parents[1] / "data" / "actfirst_tiny.yaml"
SMALL_ENV = "env.kwargs={map_size: 4, max_turns: 6, n_train_tasks: 12, n_eval_tasks: 4}"


def _cfg(tmp_path, *overrides):
    cache = tmp_path / "cache" / "bootstrap"
    return load_config(TINY, [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}", SMALL_ENV,
                              *overrides])


def test_expert_reference_replays_to_the_same_observations():
    env = FrozenLakeTextEnv(n_train_tasks=12, n_eval_tasks=4)
    task = env.task_ids("train")[3]
    ref = expert_reference(env, task, seed=0)
    assert ref.success and len(ref.actions) == len(ref.observations) >= 6
    env.reset(seed=0, options={"task": task})
    assert [env.step(a)[0] for a in ref.actions] == list(ref.observations)
    assert ref.observations[-1].startswith("You reached the goal!")
    short = FrozenLakeTextEnv(n_train_tasks=12, n_eval_tasks=4, max_turns=3)
    assert not expert_reference(short, task, seed=0).success  # truncated before the goal


@pytest.mark.parametrize("datasets_installed", [True, False], ids=["datasets", "json-lines"])
def test_save_and_read_roundtrip(tmp_path, monkeypatch, datasets_installed):
    import sys

    if not datasets_installed:  # a bare machine (opd.optional): stored as JSON lines instead
        monkeypatch.setitem(sys.modules, "datasets", None)
    refs = [Reference("a", ("down", "right"), ("o1", "o2\nline"), True), Reference("b", (), (), False),
            Reference("a", ("up",), ("other",), True)]
    save_references(tmp_path / "refs", refs, {"note": 1})
    assert (tmp_path / "refs" / "references.jsonl").is_file() is not datasets_installed
    assert json.loads((tmp_path / "refs" / META_FILE).read_text()) == {"note": 1}
    assert not list(tmp_path.glob(".partial-*"))
    back = read_references(tmp_path / "refs")
    assert back == {"a": refs[0], "b": refs[1]}  # the first row of a task wins
    assert read_references(tmp_path / "refs", ["b", "zzz"]) == {"b": refs[1]}
    with pytest.raises(ValueError, match="2 actions but 1 observations"):
        Reference("c", ("x", "y"), ("o",))


def test_build_keeps_only_successful_references_unless_asked(tmp_path):
    rows = [{"task": "fl4-train-00000", "actions": ["down"], "observations": ["o"], "success": False},
            {"task": "fl4-train-00001", "actions": ["right", "down"], "observations": ["p", "q"], "success": True},
            {"task": "fl4-train-00002", "actions": ["up"], "observations": ["r"]}]  # success defaults to true
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = ["actfirst.reference_source=dataset", f"actfirst.reference_dataset={path}"]
    kept = load_references(_cfg(tmp_path, *source), log=lambda _: None)
    assert sorted(kept) == ["fl4-train-00001", "fl4-train-00002"]
    assert kept["fl4-train-00001"] == Reference("fl4-train-00001", ("right", "down"), ("p", "q"), True)
    everything = load_references(_cfg(tmp_path, *source, "actfirst.keep_failed_references=true"), log=lambda _: None)
    assert sorted(everything) == ["fl4-train-00000", "fl4-train-00001", "fl4-train-00002"]
    # An expert that never reaches the goal in 3 turns leaves nothing to keep: a clear error.
    with pytest.raises(ConfigError, match="none of 12 reference episodes succeeded.*keep_failed_references"):
        build_references(_cfg(tmp_path, "env.kwargs.max_turns=3"), log=lambda _: None)


def test_user_dataset_formats_and_errors(tmp_path):
    import datasets

    table = {"task": ["t1"], "actions": [["down"]], "observations": [["o"]], "success": [True]}
    datasets.Dataset.from_dict(table).to_parquet(str(tmp_path / "r.parquet"))
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "r_dir"))
    expected = [Reference("t1", ("down",), ("o",), True)]
    assert dataset_references(str(tmp_path / "r.parquet")) == expected
    assert dataset_references(str(tmp_path / "r_dir")) == expected
    (tmp_path / "bad.jsonl").write_text(json.dumps({"task": "t1", "acts": ["down"], "observations": ["o"]}) + "\n")
    with pytest.raises(ConfigError, match="actfirst.reference_dataset.*lacks the column.*actions"):
        dataset_references(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ConfigError, match="actfirst.reference_dataset.*does not exist"):
        dataset_references(str(tmp_path / "nope.jsonl"))
    (tmp_path / "r.csv").write_text("task\n")
    with pytest.raises(ConfigError, match="neither"):
        dataset_references(str(tmp_path / "r.csv"))


def test_directory_is_keyed_by_content_and_built_once(tmp_path):
    logs: list[str] = []
    cfg = _cfg(tmp_path)
    directory = references_dir(cfg)
    assert directory.parent == tmp_path / "cache" / "references"
    assert references_dir(_cfg(tmp_path, "env.kwargs.max_turns=7")) != directory
    assert references_dir(_cfg(tmp_path, "actfirst.keep_failed_references=true")) != directory
    assert references_dir(_cfg(tmp_path, "teacher.bootstrap.cache_dir=/elsewhere/bootstrap")).name == directory.name
    refs = load_references(cfg, logs.append)
    assert any("building them (expert)" in line for line in logs) and any("references (expert): episode 12/12" in line for line in logs)
    assert len(refs) == 12 and all(r.success for r in refs.values())
    logs.clear()
    assert load_references(cfg, logs.append, tasks=["fl4-train-00002"]).keys() == {"fl4-train-00002"}
    assert logs == []  # stored: not rebuilt
    meta = json.loads((directory / META_FILE).read_text())
    assert meta["source"] == "expert" and meta["kept"] == 12


def test_explicit_directory_refuses_references_of_other_settings(tmp_path):
    chosen = tmp_path / "my_refs"
    build_references(_cfg(tmp_path, f"actfirst.references_dir={chosen}"), log=lambda _: None)
    assert (chosen / META_FILE).is_file()
    with pytest.raises(ConfigError, match="actfirst.references_dir.*kwargs differ"):
        load_references(_cfg(tmp_path, f"actfirst.references_dir={chosen}", "env.kwargs.max_turns=7"), log=lambda _: None)


def test_teacher_references_come_from_its_rollouts(tmp_path, tiny_model_dir, tokenizer, fmt):
    from opd.envs import EnvFactory
    from opd.generation.hf import HFEngine
    from opd.models import load_model
    from opd.rollout.vanilla import EpisodeSettings, run_episodes

    engine = HFEngine(load_model(tiny_model_dir), pad_id=fmt.pad_id)
    factory = EnvFactory("opd/FrozenLakeText-v0", {"map_size": 4, "max_turns": 6, "n_train_tasks": 12, "n_eval_tasks": 4})
    played: list[list[str]] = []

    def play(tasks):
        played.append(tasks)
        return run_episodes(engine, factory, tasks, tokenizer, fmt, EpisodeSettings(max_new_tokens=4, temperature=0.0), 0)

    cfg = _cfg(tmp_path, "actfirst.reference_source=teacher", "actfirst.keep_failed_references=true")
    refs = load_references(cfg, lambda _: None, teacher_play=play)
    assert sum(map(len, played)) == 12 and len(refs) == 12
    again = play([played[0][0]])[0]
    assert refs[again.task] == trajectory_reference(again)  # greedy: the same episode again
    assert refs[again.task].observations == tuple(t.observation for t in again.turns)
    assert references_dir(cfg) != references_dir(_cfg(tmp_path, "actfirst.keep_failed_references=true"))


def test_cli_builds_references(tmp_path, capsys):
    from opd.cli import main

    cache = tmp_path / "cache" / "bootstrap"
    args = [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}", SMALL_ENV]
    assert main(["references", "build", str(TINY), *args]) == 0
    assert "kept 12 of 12 episodes" in " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert main(["references", "build", str(TINY), *args]) == 0
    assert "references: already stored in" in " ".join(capsys.readouterr().out.split())


def test_cli_builds_teacher_references_with_the_teacher_in_its_own_process(tmp_path, capsys):
    from opd.cli import main

    cache = tmp_path / "cache" / "bootstrap"
    args = [f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}", SMALL_ENV,
            "actfirst.reference_source=teacher", "actfirst.keep_failed_references=true"]
    assert main(["references", "build", str(TINY), *args]) == 0
    assert "kept 12 of 12 episodes" in " ".join(capsys.readouterr().out.split())
    directory = references_dir(_cfg(tmp_path, *args[3:]))
    meta = json.loads((directory / META_FILE).read_text())
    assert meta["source"] == "teacher" and meta["teacher"]["bootstrap"]["policy"] == "expert"
    refs = read_references(directory)
    assert len(refs) == 12 and all(len(r.actions) == len(r.observations) >= 1 for r in refs.values())
    # Real episodes of the real environment: replaying the teacher's actions gives its observations.
    env = FrozenLakeTextEnv(map_size=4, max_turns=6, n_train_tasks=12, n_eval_tasks=4)
    for ref in refs.values():
        env.reset(seed=0, options={"task": ref.task})
        assert tuple(env.step(action)[0] for action in ref.actions) == ref.observations
