"""The bootstrap's hinted turns (``bootstrap.hint_prob``): how a tiny student learns to read
PivotOPD's hint line, and the option's place in the cache key."""

from __future__ import annotations

import random

from omegaconf import OmegaConf

from opd.bootstrap.cache import bootstrap_key
from opd.bootstrap.rows import hint_rows
from opd.schema import BootstrapConfig, EnvConfig
from opd.supervision.pivot import hint_text


def test_hinted_rows_train_only_the_hinted_turn(tokenizer, fmt):
    steps = [("F A\nG H", "down", True), ("F F\nA H", "right", True), ("F F\nF A", "down", False),
             ("F F\nF G", "up", True), ("won", "", False)]
    rows = hint_rows(steps, tokenizer, fmt, 1.0, random.Random(0))
    assert len(rows) == 2  # turns 1 and 3; turn 0 has no earlier turn, turn 2 is not trained on
    for row, k in zip(rows, (1, 3)):
        text = tokenizer.decode(row["input_ids"])
        assert text.count("Hint: at turn ") == 1 and text.endswith(f"Now do: {steps[k][1]}<|im_end|>\n<|im_start|>assistant\n{steps[k][1]}<|im_end|>")
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert tokenizer.decode(trained) == f"{steps[k][1]}<|im_end|>"
    assert hint_rows(steps, tokenizer, fmt, 0.0, random.Random(0)) == []
    # At turn 1 the only earlier turn is 0: the hint names turn 0's action as the gold one.
    assert hint_text(0, "down", "right") in tokenizer.decode(rows[0]["input_ids"])


def test_a_pinned_seed_is_the_argument_and_hints_name_their_own_key():
    env = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0"))
    plain = OmegaConf.structured(BootstrapConfig())
    pinned = OmegaConf.structured(BootstrapConfig(seed=3))
    hinted = OmegaConf.structured(BootstrapConfig(hint_prob=0.2))
    assert bootstrap_key(plain, env, 3) == bootstrap_key(pinned, env, 3)  # the seed is the argument
    assert bootstrap_key(plain, env, 3) != bootstrap_key(hinted, env, 3)
