"""Config: every shipped recipe binds; bad input is refused with a message naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from opd.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
# Every recipe (a study's definition, recipes/studies/*.study.yaml, is tested in test_studies.py).
RECIPES = sorted(p for p in [*(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "examples").rglob("*.yaml")]
                 if not p.name.endswith(".study.yaml"))


def test_recipes_are_found():
    assert ROOT / "recipes" / "quickstart.yaml" in RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_recipe_binds_and_every_key_is_read(recipe):
    import yaml
    from omegaconf import OmegaConf

    from opd.config import OPDConfig, _merge

    raw = yaml.safe_load(recipe.read_text())
    if any(v > 0 for k, v in raw.get("resources", {}).items() if k.endswith("_gpus")):
        # A GPU recipe: its models and GPUs are not on this machine, so bind it without validating.
        cfg = _merge(OmegaConf.structured(OPDConfig), OmegaConf.load(recipe), source=str(recipe))
    else:
        engine = {"ALFWorld": "alfworld", "ScienceWorld": "scienceworld"}
        ids = [raw["env"].get("id", ""), *(entry["id"] for entry in raw["env"].get("mix", []))]  # env.mix: each entry's
        for name, module in engine.items():
            if any(f"opd/{name}Text" in env_id for env_id in ids):
                pytest.importorskip(module, reason=f"{recipe.name} needs the envs extra (`pip install -e .[envs]`)")
        cfg = load_config(recipe)
    resolved = OmegaConf.to_container(cfg)

    def walk(node, schema, prefix=""):
        for key, value in node.items():
            assert key in schema, f"{recipe.name}: key {prefix}{key} did not bind"
            if isinstance(value, dict) and isinstance(schema[key], dict) and key not in ("kwargs", "args"):
                walk(value, schema[key], f"{prefix}{key}.")

    walk(raw, resolved)


def _recipe(tmp_path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text((ROOT / "recipes" / "quickstart.yaml").read_text() + "\n" + text)
    return path


def test_unknown_key_names_the_key_file_and_a_suggestion(tmp_path):
    path = _recipe(tmp_path, "")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["trainer.lerning_rate=0.1"])
    message = str(err.value)
    assert "unknown key 'trainer.lerning_rate'" in message
    assert "Did you mean 'trainer.learning_rate'?" in message


def test_unknown_key_in_the_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text((ROOT / "recipes" / "quickstart.yaml").read_text().replace("  keep_checkpoints: 2", "  keep_checkpoint: 2"))
    with pytest.raises(ConfigError, match=r"r\.yaml: unknown key 'run\.keep_checkpoint'\. Did you mean 'run\.keep_checkpoints'\?"):
        load_config(path)


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "recipes" / "quickstart.yaml", ["run.total_steps=many"])
    assert "key 'run.total_steps' has value 'many' of type str; expected an integer." in str(err.value)


def test_missing_model_path_is_refused_before_any_work(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "recipes" / "quickstart.yaml", ["student.bootstrap=null", f"student.path={missing}"])
    assert f"key 'student.path': model directory '{missing}' does not exist" in str(err.value)


def test_uncached_hub_id_is_refused_with_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"'Qwen/Qwen3-32B' is not a local directory and is not in the Hugging Face cache"):
        load_config(ROOT / "recipes" / "quickstart.yaml", ["teacher.bootstrap=null", "teacher.path=Qwen/Qwen3-32B"])


def test_impossible_resources_are_refused():
    with pytest.raises(ConfigError, match="ask for 65 CPUs"):
        load_config(ROOT / "recipes" / "quickstart.yaml", ["resources.trainer_cpus=64"])
    with pytest.raises(ConfigError, match="GPUs but this machine has 0"):
        load_config(ROOT / "recipes" / "quickstart.yaml", ["resources.teacher_gpus=1"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("supervision.teacher_view=omniscient", "key 'supervision.teacher_view' is 'omniscient'; expected one of state_grounded, full"),
        ("trainer.micro_batch_size=5", "'trainer.micro_batch_size' (5) must divide 'rollout.episodes_per_step' (32)"),
        ("env.id=opd/Nope-v0", "unknown environment 'opd/Nope-v0'"),
        ("env.eval_split=test", "key 'env.eval_split'"),
        ("losses.0.name=no_such_loss", "key 'losses.0.name': unknown loss 'no_such_loss'"),
        ("trainer.zero_stage=4", "expected 0, 1, 2 or 3"),
        ("rollout.temperature=-1", "key 'rollout.temperature' is -1.0"),
        ("trainer.micro_batch_tokens=-1", "key 'trainer.micro_batch_tokens' is -1; expected 0 <= value <= 1,000,000,000"),
        ("supervision.score_batch_tokens=-5", "key 'supervision.score_batch_tokens' is -5; expected 0 <= value"),
        ("notakey", "override 'notakey' is not key=value"),
        ("teacher.bootstrap.history=actions", "key 'teacher.bootstrap.history' is 'actions'; expected one of full, state_grounded"),
    ],
)
def test_bad_values_are_refused_with_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "recipes" / "quickstart.yaml", [override])
    assert fragment in str(err.value)


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides_apply():
    cfg = load_config(ROOT / "recipes" / "quickstart.yaml", ["trainer.learning_rate=3e-4", "run.total_steps=7"])
    assert cfg.trainer.learning_rate == 3e-4 and cfg.run.total_steps == 7


def test_an_empty_override_is_the_empty_string_on_a_string_key_and_none_on_an_optional_one(tmp_path):
    # One rule for `key=` (opd.config._empty_value): `env.module=` and `student.bootstrap=` both mean "none".
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(ROOT / "tests" / "data" / "tiny.yaml",
                      [f"run.output_dir={tmp_path / 'run'}", "env.module=", "rollout.system_prompt=",
                       "teacher.bootstrap.seed=", "logging.wandb_project=", "student.bootstrap=", f"student.path={model}"])
    assert cfg.env.module == "" and cfg.rollout.system_prompt == ""  # str: the empty string
    assert cfg.teacher.bootstrap.seed is None and cfg.logging.wandb_project is None  # X | None: None
    assert cfg.student.bootstrap is None and cfg.student.path == str(model)
    with pytest.raises(ConfigError, match="key 'run.total_steps' takes a value of type int and cannot be empty"):
        load_config(ROOT / "tests" / "data" / "tiny.yaml", ["run.total_steps="])


def test_engine_auto_is_hf_on_cpu_and_vllm_for_a_role_on_a_gpu(tmp_path):
    from omegaconf import OmegaConf

    from opd.config import resolve_engine

    cfg = load_config(ROOT / "recipes" / "quickstart.yaml", [f"run.output_dir={tmp_path}"])
    assert (cfg.student.engine, cfg.teacher.engine) == ("hf", "hf")  # recorded resolved in config.yaml
    assert resolve_engine("auto", 1.0) == "vllm" and resolve_engine("auto", 0.0) == "hf"
    assert resolve_engine("hf", 1.0) == "hf"
    # The GPU recipe leaves the engines at auto and puts both engine roles on GPUs.
    gpu = OmegaConf.load(ROOT / "recipes" / "alfworld" / "vanilla_opd_qwen3-4b.yaml")
    assert "engine" not in gpu.student and "engine" not in gpu.teacher
    assert resolve_engine("auto", gpu.resources.rollout_gpus) == "vllm"
    assert resolve_engine("auto", gpu.resources.teacher_gpus) == "vllm"


@pytest.mark.parametrize("algorithm,overrides,message", [
    ("actfirst_opd", ["supervision.teacher_view=full"], "needs 'supervision.teacher_view: state_grounded'"),
    ("pivot_opd", ["rollout.group_size=1"], "needs groups of 2 or more"),
    ("pivot_opd", ["rollout.group_size=4", "supervision.scoring=topk"], "needs 'supervision.scoring: sampled'"),
    ("grpo", ["rollout.group_size=4"], "need the teacher's grades"),
    ("vanilla_opd", ["losses=[{name: pivot_preventive}]"], "only algorithm 'pivot_opd' feeds"),
])
def test_an_algorithm_refuses_a_recipe_it_cannot_run(tmp_path, algorithm, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ROOT / "recipes" / "quickstart.yaml", [f"algorithm={algorithm}", *overrides])



def mask_loss(batch, cfg):
    """A user's loss named by dotted path that trains on a named mask no algorithm carries."""
    return batch.restricted_to("no_such_mask").student_logprobs_BT.sum() * 0.0, {}


mask_loss.token_mask = "no_such_mask"


def test_a_loss_on_a_mask_no_algorithm_carries_is_refused():
    with pytest.raises(ConfigError, match=re.escape("train on the token mask(s) ['no_such_mask'] that no registered")):
        load_config(ROOT / "recipes" / "quickstart.yaml", ["losses=[{name: tests.unit.test_config.mask_loss}]"])


def test_every_numeric_key_of_the_schema_has_a_bound_and_every_default_is_inside_it():
    import dataclasses
    import typing

    import opd.schema as schema

    classes = [c for c in vars(schema).values() if dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]
    unbounded, outside = [], []
    for cls in classes:
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            kinds = typing.get_args(kind) if typing.get_origin(kind) is typing.Union else (kind,)
            if not any(k in (int, float) for k in kinds):
                continue
            bound = schema.bound_of(cls, f.name)
            if bound is None:
                unbounded.append(f"{cls.__name__}.{f.name}")
            elif f.default is not None and not bound.holds(f.default):
                outside.append(f"{cls.__name__}.{f.name}={f.default}")
    assert not unbounded, f"numeric keys without a bound in opd.schema.BOUNDS: {unbounded}"
    assert not outside, f"defaults outside their bound: {outside}"
    assert len(classes) >= 10


def test_numbers_inside_their_bounds_pass_and_outside_are_refused_with_the_bound(tmp_path):
    recipe = ROOT / "recipes" / "quickstart.yaml"
    out = f"run.output_dir={tmp_path / 'run'}"
    cfg = load_config(recipe, [out, "trainer.adam_beta1=0.0", "trainer.grad_clip_norm=0", "rollout.temperature=0"])
    assert cfg.trainer.adam_beta1 == 0.0 and cfg.rollout.temperature == 0.0
    with pytest.raises(ConfigError, match=r"key 'trainer.adam_beta2' is 1.0; expected 0 <= value < 1\."):
        load_config(recipe, [out, "trainer.adam_beta2=1.0"])
