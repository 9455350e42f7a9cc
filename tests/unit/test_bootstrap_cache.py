"""The cache key of a bootstrapped model names everything that decides its weights: every
setting of the ``bootstrap`` section (but where the cache is, and the seed, which is given
apart), the environment's data, the seed and the build environment."""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from opd.bootstrap.cache import CACHE_VERSION, bootstrap_key, build_environment, tokenizer_key
from opd.schema import BootstrapConfig, EnvConfig, TinyArchConfig

ENV = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0", kwargs={"map_size": 4}))
# A value other than the default for every setting (a choice's other option, a number moved).
CHANGED = {"policy": "random_valid", "arch": TinyArchConfig(hidden_size=64), "n_episodes": 3, "explore_prob": 0.1,
           "sft_steps": 7, "batch_size": 4, "learning_rate": 1e-3, "tokenizer_vocab_size": 400, "corpus_episodes": 20,
           "tokenizer": "smollm2", "init": "smollm2", "init_layers": 2, "think": "plan", "action_only_prob": 0.5,
           "history": "both", "hint_prob": 0.2, "dagger_episodes": 4, "dagger_temperature": 0.5}


def test_every_setting_but_the_cache_dir_and_the_seed_names_the_model():
    fields = {f.name for f in dataclasses.fields(BootstrapConfig)}
    assert set(CHANGED) == fields - {"cache_dir", "seed", "shipped"}, "a new bootstrap setting needs a case here"
    base = bootstrap_key(OmegaConf.structured(BootstrapConfig()), ENV, 0)
    keys = {name: bootstrap_key(OmegaConf.structured(BootstrapConfig(**{name: value})), ENV, 0)
            for name, value in CHANGED.items()}
    assert [name for name, key in keys.items() if key == base] == []
    assert len(set(keys.values())) == len(keys)
    # Where the model is cached or found, and a pinned seed (the seed is the key's argument), are not what it is.
    assert bootstrap_key(OmegaConf.structured(BootstrapConfig(cache_dir="/elsewhere", seed=3, shipped=False)),
                         ENV, 0) == base
    assert bootstrap_key(OmegaConf.structured(BootstrapConfig()), ENV, 1) != base


def test_the_environment_and_the_build_name_the_model(monkeypatch):
    boot = OmegaConf.structured(BootstrapConfig())
    base = bootstrap_key(boot, ENV, 0)
    other_env = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0", kwargs={"map_size": 5}))
    assert bootstrap_key(boot, other_env, 0) != base
    assert bootstrap_key(boot, OmegaConf.merge(ENV, {"train_split": "eval"}), 0) != base
    hashed: list[dict] = []
    monkeypatch.setattr("opd.bootstrap.cache.digest", lambda payload: hashed.append(payload) or "k")
    bootstrap_key(boot, ENV, 0)
    assert hashed[0]["v"] == CACHE_VERSION and hashed[0]["build"] == build_environment()
    assert set(hashed[0]["boot"]) == {f.name for f in dataclasses.fields(BootstrapConfig)} - {"cache_dir", "seed",
                                                                                              "shipped"}
    # The recipe's key (a shipped model's name) is the same payload without the build.
    bootstrap_key(boot, ENV, 0, build=False)
    assert hashed[1] == {k: v for k, v in hashed[0].items() if k != "build"}


def test_the_tokenizer_key_names_its_corpus_and_words():
    base = tokenizer_key(ENV, 320, 300, ("left", "down"))
    assert len({base, tokenizer_key(ENV, 400, 300, ("left", "down")), tokenizer_key(ENV, 320, 100, ("left", "down")),
                tokenizer_key(ENV, 320, 300, ("left",))}) == 4


def test_padded_embedding_rows_name_the_model_and_none_keep_the_keys_of_before(monkeypatch):
    """``arch.vocab_size`` came after models were shipped under their keys: left at 0 it is not in the
    key (the shipped models keep their names), set it names a model of its own."""
    hashed: list[dict] = []
    monkeypatch.setattr("opd.bootstrap.cache.digest", lambda payload: hashed.append(payload) or str(len(hashed)))
    bootstrap_key(OmegaConf.structured(BootstrapConfig()), ENV, 0)
    bootstrap_key(OmegaConf.structured(BootstrapConfig(arch=TinyArchConfig(vocab_size=151_936))), ENV, 0)
    assert "vocab_size" not in hashed[0]["boot"]["arch"]
    assert hashed[1]["boot"]["arch"]["vocab_size"] == 151_936
