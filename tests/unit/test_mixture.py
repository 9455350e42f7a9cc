"""Several environments in one run and their routes to teachers (:mod:`opd.mixture`), on the real
FrozenLake and prompt-dataset environments: task names, shares, routes, and the recipe checks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from opd.config import ConfigError, load_config
from opd.envs import EnvFactory, check_env, make_env
from opd.mixture import (MIX_ID, TeacherRoutes, env_of, inner_task, routes_of, sample_mixed_tasks, share_counts,
                         teacher_env)


def _mix_env(**kwargs):
    return make_env(MIX_ID, envs=[{"name": "lake", "id": "opd/FrozenLakeText-v0", "kwargs": {}},
                                  {"name": "rough", "id": "opd/FrozenLakeText-v0", "kwargs": {"frozen_prob": 0.7}}],
                    **kwargs)


def test_task_names_carry_the_environment():
    assert (env_of("lake::t3"), inner_task("lake::t3")) == ("lake", "t3")
    assert (env_of("row-00017"), inner_task("row-00017")) == ("", "row-00017")
    assert inner_task("a::b::c") == "b::c"  # only the first separator is the mix's


def test_mixed_env_resets_each_member_on_its_own_task():
    mixed = _mix_env()
    lake, rough = make_env("opd/FrozenLakeText-v0"), make_env("opd/FrozenLakeText-v0", frozen_prob=0.7)
    ids = mixed.unwrapped.task_ids("eval")
    assert ids[:4] == [f"lake::{lake.unwrapped.task_ids('eval')[0]}", f"rough::{rough.unwrapped.task_ids('eval')[0]}",
                       f"lake::{lake.unwrapped.task_ids('eval')[1]}", f"rough::{rough.unwrapped.task_ids('eval')[1]}"]
    assert len(ids) == len(lake.unwrapped.task_ids("eval")) + len(rough.unwrapped.task_ids("eval"))
    for task, member in ((ids[1], rough), (ids[0], lake)):
        obs, info = mixed.reset(options={"task": task})
        want_obs, want_info = member.reset(options={"task": inner_task(task)})
        assert obs == want_obs and info["expert_action"] == want_info["expert_action"]
        step = mixed.step("right")
        assert step[:4] == member.step("right")[:4]
    with pytest.raises(ValueError, match="'lake2', which is not in the mix"):
        mixed.reset(options={"task": "lake2::x"})
    check_env(_mix_env())  # the environment contract holds for the mix


def _model(tmp_path: Path, name: str) -> str:
    """A directory that passes the recipe's model check (config.json); nothing loads it here."""
    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / "config.json").write_text("{}")
    return str(tmp_path / name)


def _loadable(tmp_path: Path, **kw) -> dict:
    recipe = _recipe(**{"one": _model(tmp_path, "one"), "two": _model(tmp_path, "two"), **kw})
    recipe["student"]["path"] = _model(tmp_path, "student")
    return recipe


def test_a_mixed_factory_reports_its_members_class_attributes(tmp_path):
    cfg = load_config(_write(tmp_path, _loadable(tmp_path, teachers=False)))
    factory = EnvFactory.of(cfg.env)
    assert factory.env_id == MIX_ID and [m["name"] for m in factory.kwargs["envs"]] == ["lake", "rough"]
    lake_words = EnvFactory("opd/FrozenLakeText-v0").env_class().tokenizer_words
    assert tuple(factory.env_class().tokenizer_words) == tuple(lake_words)
    assert EnvFactory.of(cfg.env, max_turns=3)().unwrapped.member("rough").unwrapped.max_turns == 3  # kwargs reach each member


def test_shares_split_a_step_and_draws_are_pure_functions_of_seed_and_step():
    assert share_counts([1, 1, 1], 8) == [3, 3, 2]
    assert share_counts([2, 1], 6) == [4, 2]
    assert share_counts([0.5, 0.25, 0.25], 7) == [3, 2, 2]  # 3.5, 1.75, 1.75: the largest remainders
    tasks = {"a": [f"a::{i}" for i in range(50)], "b": [f"b::{i}" for i in range(50)]}
    draw = sample_mixed_tasks(tasks, {"a": 3.0, "b": 1.0}, 16, seed=0, step=5, group_size=2)
    assert Counter(env_of(t) for t in draw) == {"a": 12, "b": 4}
    assert [env_of(t) for t in draw] == ["a"] * 12 + ["b"] * 4  # one run per environment
    assert all(draw[i] == draw[i + 1] for i in range(0, 16, 2))  # groups of one task
    assert draw == sample_mixed_tasks(tasks, {"a": 3.0, "b": 1.0}, 16, seed=0, step=5, group_size=2)
    assert draw != sample_mixed_tasks(tasks, {"a": 3.0, "b": 1.0}, 16, seed=0, step=6, group_size=2)


def test_routes_cut_items_into_runs_of_one_teacher_group_in_order():
    routes = TeacherRoutes({"a": "one", "b": "two", "c": "one"}, {"one": "one", "two": "two"})
    tasks = ["a::1", "a::2", "b::1", "c::1", "a::3"]
    runs = routes.runs(tasks, str)
    assert runs == [("one", 0, ["a::1", "a::2"]), ("two", 2, ["b::1"]), ("one", 3, ["c::1", "a::3"])]
    assert [t for _, _, part in runs for t in part] == tasks
    assert routes.groups == ["one", "two"]
    with pytest.raises(ValueError, match="no routed environment"):
        routes.teacher_of("z::1")
    single = TeacherRoutes.single()
    assert single.runs(["t1", "t2"], str) == [("teacher", 0, ["t1", "t2"])]
    assert single.runs(["a::1"], str) == [("teacher", 0, ["a::1"])]  # one environment's own ids, whatever they hold


def test_two_names_of_one_model_share_a_group(tmp_path):
    model = _model(tmp_path, "m")
    cfg = load_config(_write(tmp_path, _loadable(tmp_path, one=model, two=model)))
    routes = routes_of(cfg)
    assert routes.teacher_group == {"one": "one", "two": "one"} and routes.groups == ["one"]
    assert routes_of(cfg, share_models=False).groups == ["one", "two"]
    cfg = load_config(_write(tmp_path, _loadable(tmp_path, one=model, two=_model(tmp_path, "other"))))
    assert routes_of(cfg).groups == ["one", "two"]


def test_a_built_teacher_is_built_on_the_environment_routed_to_it(tmp_path):
    cfg = load_config(_write(tmp_path, _loadable(tmp_path, teachers=False)))
    assert teacher_env(cfg, "teacher").id == "opd/FrozenLakeText-v0"
    assert dict(teacher_env(cfg, "teacher").kwargs) == {}  # the first entry routed to it: lake
    assert list(teacher_env(cfg, "teacher").mix) == []


def test_rows_of_a_dataset_are_routed_by_a_column(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1),
                                        "source": "add" if i % 3 else "other"}) + "\n" for i in range(60)))
    every, add, other = (make_env("opd/PromptDataset-v0", path=str(data), **kw).unwrapped
                         for kw in ({}, {"where": {"source": "add"}}, {"where": {"source": ["other"]}}))
    for split in ("train", "eval"):
        assert sorted(add.task_ids(split) + other.task_ids(split)) == sorted(every.task_ids(split))
        assert all(add.task(t).row["source"] == "add" for t in add.task_ids(split))
        assert other.task_ids(split) and all(other.task(t).row["source"] == "other" for t in other.task_ids(split))
    with pytest.raises(ValueError, match="column 'src', which .* does not have; its columns: answer, prompt, source"):
        make_env("opd/PromptDataset-v0", path=str(data), where={"src": "add"})


# -- the recipe's checks ------------------------------------------------------------------------
def _recipe(teachers: bool = True, one: str = "/nowhere/one", two: str = "/nowhere/two", **extra) -> dict:
    recipe = {
        "env": {"mix": [{"name": "lake", "id": "opd/FrozenLakeText-v0", "teacher": "one" if teachers else "teacher"},
                        {"name": "rough", "id": "opd/FrozenLakeText-v0", "kwargs": {"frozen_prob": 0.7},
                         "teacher": "two" if teachers else "teacher"}]},
        "student": {"path": "/nowhere/student"},
        "rollout": {"episodes_per_step": 4, "max_new_tokens": 4},
        "trainer": {"micro_batch_size": 4},
        "run": {"output_dir": "/tmp/opd-test-mix"},
        "resources": {"teacher_cpus": 0.25},
    }
    if teachers:
        recipe["teachers"] = {"one": {"path": one, "cpus": 0.25}, "two": {"path": two, "cpus": 0.25}}
    else:
        recipe["teacher"] = {"path": one}
    for key, value in extra.items():
        node = recipe
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return recipe


def _write(tmp_path: Path, recipe: dict) -> Path:
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _error(tmp_path: Path, recipe: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, recipe))
    return str(info.value)


def test_a_route_to_an_unknown_teacher_is_refused(tmp_path):
    recipe = _recipe()
    recipe["env"]["mix"][1]["teacher"] = "tow"
    assert "key 'env.mix.1.teacher' is 'tow', which is no teacher of the recipe; expected one of teacher, one, two" \
        in _error(tmp_path, recipe)


def test_a_teacher_no_route_uses_is_refused(tmp_path):
    recipe = _recipe()
    recipe["teachers"]["spare"] = {"path": "/nowhere/spare"}
    assert "key 'teachers.spare': no entry of env.mix routes to it" in _error(tmp_path, recipe)
    recipe = _recipe()
    recipe["teacher"] = {"path": "/nowhere/t"}
    assert "key 'teacher' is set but no entry of env.mix routes to it" in _error(tmp_path, recipe)
    recipe = _recipe()
    recipe["env"] = {"id": "opd/FrozenLakeText-v0"}
    assert "key 'teachers' names one, two but no environment is routed to them" in _error(tmp_path, recipe)


def test_shares_that_give_an_environment_nothing_are_refused(tmp_path):
    recipe = _recipe()
    recipe["env"]["mix"][0]["share"] = 20
    assert "key 'env.mix.1.share' (1 of 21) gives 'rough' none of a step's 4 task group(s)" in _error(tmp_path, recipe)
    recipe["env"]["mix"][0]["share"] = 0
    assert "key 'env.mix.0.share' is 0" in _error(tmp_path, recipe)


def test_names_ids_and_what_several_teachers_cannot_do_yet(tmp_path):
    recipe = _recipe()
    recipe["env"]["mix"][1]["name"] = "lake"
    assert "key 'env.mix.1.name': 'lake' names two entries" in _error(tmp_path, recipe)
    recipe = _recipe()
    recipe["env"]["mix"][1]["name"] = "rough::x"
    assert "key 'env.mix.1.name' is 'rough::x'" in _error(tmp_path, recipe)
    recipe = _recipe()
    recipe["env"]["id"] = "opd/FrozenLakeText-v0"
    assert "keys 'env.id' ('opd/FrozenLakeText-v0') and 'env.mix' are both set" in _error(tmp_path, recipe)
    recipe = _recipe()
    recipe["teachers"]["teacher"] = {"path": "/x"}
    assert "key 'teachers.teacher': a teacher's name" in _error(tmp_path, recipe)
    assert "key 'algorithm' is pivot_opd" in _error(tmp_path, _recipe(algorithm="pivot_opd", rollout__group_size=2))
    assert "key 'supervision.scoring' is 'hidden'" in _error(tmp_path, _recipe(supervision__scoring="hidden"))
    recipe = _recipe()
    recipe["env"]["mix"][1]["kwargs"] = {"nonsense": 1}
    assert "key 'env.mix.1.kwargs'" in _error(tmp_path, recipe)
    recipe = _recipe()
    recipe["env"]["mix"][1]["id"] = "opd/FrozenLake-v9"
    assert "key 'env.mix.1.id': unknown environment 'opd/FrozenLake-v9'" in _error(tmp_path, recipe)


def test_named_teachers_are_checked_as_the_teacher_is(tmp_path):
    recipe = _recipe()
    recipe["student"]["path"] = _model(tmp_path, "student")
    assert "key 'teachers.one.path': model directory '/nowhere/one' does not exist" in _error(tmp_path, recipe)
    recipe = _loadable(tmp_path)
    recipe["teachers"]["one"] = {"engine": "server", "server": {"urls": ["ftp://x"], "model": "m"}, "cpus": 0.25}
    assert "key 'teachers.one.server.urls.0' is 'ftp://x'" in _error(tmp_path, recipe)
    recipe["teachers"]["one"]["cpus"] = 5
    assert "+ teachers.*.cpus ask for" in _error(tmp_path, recipe)
    recipe["teachers"]["one"]["cpus"] = -3
    assert "key 'teachers.one.cpus' is -3" in _error(tmp_path, recipe)


def test_an_entry_may_name_its_own_splits(tmp_path):
    """``env.mix.N.train_split``: what the recipe's train split means for that environment (e.g.
    TextWorldExpress's train_seen); here FrozenLake's eval maps stand in for one entry's training."""
    recipe = _loadable(tmp_path, teachers=False)
    recipe["env"]["mix"][1]["train_split"] = "eval"
    cfg = load_config(_write(tmp_path, recipe))
    mixed = EnvFactory.of(cfg.env)().unwrapped
    rough = make_env("opd/FrozenLakeText-v0", frozen_prob=0.7).unwrapped
    assert mixed.member_task_ids("rough", "train") == [f"rough::{t}" for t in rough.task_ids("eval")]
    assert mixed.member_task_ids("lake", "train")[0].endswith(make_env("opd/FrozenLakeText-v0").unwrapped.task_ids("train")[0])
    recipe["env"]["mix"][1]["train_split"] = "nope"
    assert "key 'env.mix.1 (env.train_split)'" in _error(tmp_path, recipe)


def test_a_named_teacher_may_be_served_with_its_own_actors(tmp_path):
    """``teachers.NAME.engine: server``: its group's spec carries its server, its actors their
    own count and shares; the other group keeps the recipe's defaults."""
    from opd.runtime.workers import role_specs

    recipe = _loadable(tmp_path)
    recipe["teachers"]["two"] = {"engine": "server", "server": {"urls": ["http://10.0.0.5:8000"], "model": "m"},
                                 "replicas": 3, "cpus": 0.05}
    cfg = load_config(_write(tmp_path, recipe))
    specs = role_specs(cfg, str(tmp_path / "student"), {"one": str(tmp_path / "one"), "two": str(tmp_path / "student")})
    assert list(specs.teachers) == ["one", "two"] and specs.teacher is specs.teachers["one"].spec
    served = specs.teachers["two"]
    assert served.spec.engine.engine == "server" and served.spec.engine.server.urls == ("http://10.0.0.5:8000",)
    assert (served.replicas, served.cpus, served.gpus) == (3, 0.05, 0.0)
    assert (specs.teachers["one"].replicas, specs.teachers["one"].cpus) == (1, 0.25)
    assert specs.routes.env_teacher == {"lake": "one", "rough": "two"}
