"""DAgger in the bootstrap (``bootstrap.dagger_episodes``): the init model plays the next train
games, and every turn it played becomes a row whose context is its own episode and whose target
is what the env's expert does in the state it reached. Real FrozenLake, a real tiny model built
by the bootstrap, real episodes; the expert's labels are checked against a replay of the env."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from opd.bootstrap import build_bootstrap_model
from opd.bootstrap.cache import bootstrap_key
from opd.bootstrap.rows import expert_labelled_rows
from opd.chat import ChatFormat, student_sequence
from opd.envs import EnvFactory
from opd.generation.hf import HFEngine
from opd.models import load_model, load_tokenizer
from opd.rollout.vanilla import EpisodeSettings, run_episodes
from opd.schema import BootstrapConfig, EnvConfig

ENV = {"map_size": 4, "max_turns": 8}


def _boot(tmp_path: Path, **kw) -> BootstrapConfig:
    boot = OmegaConf.structured(BootstrapConfig(sft_steps=kw.pop("sft_steps", 4), batch_size=4, corpus_episodes=10,
                                                tokenizer_vocab_size=300, cache_dir=str(tmp_path), **kw))
    boot.arch.hidden_size, boot.arch.num_heads, boot.arch.num_layers, boot.arch.intermediate_size = 64, 1, 1, 128
    return boot


def test_every_turn_the_model_played_is_labelled_with_the_experts_action_in_the_state_it_reached(tmp_path):
    env_cfg = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0", kwargs=ENV))
    # A weak policy (random valid moves, few steps) errs, so its states leave the expert's path.
    base = build_bootstrap_model(_boot(tmp_path, policy="random_valid", n_episodes=8), env_cfg, seed=0,
                                           log=lambda _: None)
    tokenizer = load_tokenizer(base)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    factory = EnvFactory(env_cfg.id, dict(ENV))
    tasks = factory().unwrapped.task_ids("train")[:6]
    engine = HFEngine(load_model(base), pad_id=fmt.pad_id)
    trajs = run_episodes(engine, factory, tasks, tokenizer, fmt, EpisodeSettings(max_new_tokens=8, env_isolation="inprocess"),
                         seed=0)
    labelled = off_path = 0
    for traj in trajs:
        rows = expert_labelled_rows(traj, tokenizer, fmt)
        played = student_sequence(traj, fmt)
        assert len(rows) == len(traj.turns)  # FrozenLake's expert acts in every state
        replay = factory()
        _, info = replay.reset(seed=0, options={"task": traj.task})
        for t, (turn, row) in enumerate(zip(traj.turns, rows)):
            target = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
            context = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if not m]
            assert target == tokenizer.encode(info["expert_action"], add_special_tokens=False) + [fmt.im_end_id]
            assert set(row["turn_index"]) == {-1, t}
            # The context is the episode as the model played it (its own earlier responses), up to turn t.
            assert context == played["input_ids"][: played["response_positions"][t][0]]
            off_path += turn.action_text != info["expert_action"]
            labelled += 1
            _, _, _, _, info = replay.step(turn.action_text)
    assert labelled > 10 and off_path > 0  # the rows label states off the expert's path too


def test_a_dagger_build_plays_the_init_model_and_names_it_in_the_key(tmp_path, monkeypatch):
    env_cfg = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0", kwargs=ENV))
    base = build_bootstrap_model(_boot(tmp_path, n_episodes=8), env_cfg, seed=0, log=lambda _: None)
    plain = _boot(tmp_path, n_episodes=8, init=base, tokenizer=base)
    dagger = _boot(tmp_path, n_episodes=8, init=base, tokenizer=base, dagger_episodes=6)
    assert bootstrap_key(plain, env_cfg, 0) != bootstrap_key(dagger, env_cfg, 0)
    colder = _boot(tmp_path, n_episodes=8, init=base, tokenizer=base, dagger_episodes=6, dagger_temperature=0.0)
    assert bootstrap_key(colder, env_cfg, 0) != bootstrap_key(dagger, env_cfg, 0)

    lines: list[str] = []
    built = build_bootstrap_model(dagger, env_cfg, seed=0, log=lines.append)
    assert (Path(built) / "model.safetensors").is_file()
    closing = [line for line in lines if "turns labelled by the expert" in line]
    assert len(closing) == 1 and " of 6 solved by the init model, " in closing[0], lines
    turns = int(closing[0].split(" solved by the init model, ")[1].split()[0])
    # 8 expert episodes' rows, then one row per labelled turn (at least one a game).
    assert any(f"on 8 expert episodes and 6 DAgger episodes ({8 + turns} sequences)" in line for line in lines), lines
    assert turns >= 6

    # An env whose expert names no action (stood in for by dropping every label) stops the build
    # after its first chunk of episodes, naming the key.
    monkeypatch.setattr("opd.bootstrap.build.expert_labelled_rows", lambda *args, **kwargs: [])
    monkeypatch.setattr("opd.progress.MIN_INTERVAL_S", 0.0)  # a line at every tenth, had it gone on
    played: list[str] = []
    with pytest.raises(ValueError, match=r"key 'bootstrap.dagger_episodes': env 'opd/FrozenLakeText-v0' named no expert"):
        build_bootstrap_model(_boot(tmp_path, n_episodes=8, init=base, tokenizer=base, dagger_episodes=40),
                                        env_cfg, seed=0, log=played.append)
    assert not any("DAgger episode" in line and "/40" in line for line in played)  # stopped before a tenth's line
