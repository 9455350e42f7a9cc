"""The bootstrap SFT step splits its batch into forwards of similar lengths without changing
the update: the same parameters as one forward padded to the longest row. A build reports how
far it is: the tokenizer's corpus, the episodes, the SFT steps with their loss."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from opd.bootstrap import build_bootstrap_model
from opd.bootstrap.cache import bootstrap_key
from opd.bootstrap.rows import env_state_of, plan_text, sft_row
from opd.bootstrap.sft import initial_model, sft
from opd.models import tiny_qwen3
from opd.progress import Progress
from opd.schema import BootstrapConfig, EnvConfig


def test_length_grouped_sft_makes_the_padded_update(tokenizer, fmt, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (7, 40, 13, 90, 25, 64):  # a mix like whole episodes next to single turns
        ids = torch.randint(5, 250, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "loss_mask": [0.0] * (n // 2) + [1.0] * (n - n // 2),
                     "behaviour_logprobs": [0.0] * n, "turn_index": [-1] * (n // 2) + [0] * (n - n // 2)})
    boot = OmegaConf.structured(BootstrapConfig(sft_steps=3, batch_size=6, learning_rate=1e-2))
    boot.arch.hidden_size, boot.arch.num_heads, boot.arch.num_layers = 64, 1, 1
    params = {}
    for cap in (0, 100):  # 0: one forward of 6 x 90 padded tokens; 100: one or two rows per forward
        monkeypatch.setattr("opd.bootstrap.sft.SFT_BATCH_TOKENS", cap)
        model = tiny_qwen3(tokenizer, boot.arch, seed=0).train()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sft(model, rows, fmt.pad_id, boot, seed=0, log=lambda _: None)
        params[cap] = model.state_dict()
    moved = max((params[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3  # the steps did train
    assert max((params[0][k] - params[100][k]).abs().max().item() for k in before) < 1e-5


def test_head_at_targets_sft_makes_the_full_head_update(tokenizer, fmt):
    """With a real tokenizer the bootstrap's SFT runs the LM head on the target positions only:
    the same update as the full head's, to float rounding."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in (30, 60, 45):
        ids = torch.randint(5, 250, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "loss_mask": [0.0] * (n - 6) + [1.0] * 6,
                     "behaviour_logprobs": [0.0] * n, "turn_index": [-1] * (n - 6) + [0] * 6})
    params = {}
    for name in ("", "a-real-tokenizer"):
        boot = OmegaConf.structured(BootstrapConfig(sft_steps=3, batch_size=3, learning_rate=1e-2, tokenizer=name))
        boot.arch.hidden_size, boot.arch.num_heads, boot.arch.num_layers = 64, 1, 1
        model = tiny_qwen3(tokenizer, boot.arch, seed=0).train()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sft(model, rows, fmt.pad_id, boot, seed=0, log=lambda _: None)
        params[name] = model.state_dict()
    assert max((params[""][k] - before[k]).abs().max().item() for k in before) > 1e-3  # the steps did train
    assert max((params[""][k] - params["a-real-tokenizer"][k]).abs().max().item() for k in before) < 1e-5


def test_a_bootstrap_build_reports_its_progress(tmp_path, monkeypatch):
    # Every tenth of each stage (the minimum interval off: this build takes seconds), then a closing line.
    monkeypatch.setattr("opd.progress.MIN_INTERVAL_S", 0.0)
    env = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0", kwargs={"map_size": 4, "max_turns": 6}))
    boot = OmegaConf.structured(BootstrapConfig(n_episodes=20, sft_steps=10, batch_size=2, corpus_episodes=10,
                                                tokenizer_vocab_size=300, cache_dir=str(tmp_path)))
    boot.arch.hidden_size, boot.arch.num_heads, boot.arch.num_layers, boot.arch.intermediate_size = 64, 1, 1, 128
    lines: list[str] = []
    directory = build_bootstrap_model(boot, env, seed=0, log=lines.append)
    assert (Path(directory) / "model.safetensors").is_file()
    assert lines[0].startswith("bootstrap: building the expert model of opd/FrozenLakeText-v0 (20 episodes, 10 SFT steps")
    corpus = [line for line in lines if line.startswith("bootstrap: tokenizer corpus episode ")]
    episodes = [line for line in lines if line.startswith("bootstrap: expert episode ")]
    steps = [line for line in lines if line.startswith("bootstrap: SFT step ")]
    assert [line.split()[4].rstrip(",") for line in corpus] == [f"{k}/10" for k in range(1, 11)]
    assert [line.split()[3].rstrip(",") for line in episodes] == [f"{k}/20" for k in range(2, 21, 2)]
    assert [line.split()[3].rstrip(",") for line in steps] == [f"{k}/10" for k in range(1, 11)]
    assert all(re.search(r", loss \d+\.\d{4} \(\d+s, about \d+s left\)$", line) for line in steps[:-1]), steps
    assert re.search(r"SFT step 10/10, loss \d+\.\d{4} in \d+\.\ds$", steps[-1]) and "SFT sequences" in episodes[-1]
    # A second call finds the model in the cache: no build, nothing to report.
    lines.clear()
    assert build_bootstrap_model(boot, env, seed=0, log=lines.append) == directory and lines == []


def test_stage_progress_logs_each_tenth_at_most_every_few_seconds_and_a_bar_on_a_terminal():
    now = [0.0]
    lines: list[str] = []
    progress = Progress(lines.append, "SFT step", total=100, prefix="bootstrap", clock=lambda: now[0])
    for k in range(1, 101):
        now[0] += 0.5 if k <= 50 else 2.0  # fast, then slow: the interval, then the tenths set the pace
        progress.advance(k, "loss 1.0000")
    progress.finish("loss 1.0000")
    counts = [int(line.split()[3].split("/")[0]) for line in lines]
    # A first line once 3 s have gone (FIRST_LINE_S), then each tenth.
    assert counts == [6, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert lines[0] == "bootstrap: SFT step 6/100, loss 1.0000 (3s, about 47s left)"
    assert lines[6] == "bootstrap: SFT step 60/100, loss 1.0000 (45s, about 30s left)"
    lines.clear()
    now[0] = 0.0
    progress = Progress(lines.append, "SFT step", total=100, prefix="bootstrap", clock=lambda: now[0])
    for k in range(1, 101):
        now[0] += 0.125  # 12.5 s in all: lines no closer than 5 s
        progress.advance(k)
    progress.finish()
    assert [int(line.split()[3].split("/")[0]) for line in lines] == [24, 40, 80, 100]
    # A stage whose tenths are far apart (the prompt-dataset teacher's 1,500 SFT steps) says how it
    # goes within seconds, then at least every 30 s (QUIET_MAX_S).
    lines.clear()
    now[0] = 0.0
    progress = Progress(lines.append, "SFT step", total=1500, prefix="bootstrap", clock=lambda: now[0])
    for k in range(1, 201):
        now[0] += 0.8
        progress.advance(k)
    times = [float(line.split("(")[1].split("s")[0]) for line in lines]
    assert times[0] <= 3.2 and all(b - a <= 31.5 for a, b in zip(times, times[1:])) and len(lines) == 6, lines

    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, color_system=None, highlight=False, width=160)
    with Progress(console.log, "SFT step", total=4, prefix="bootstrap") as progress:
        for k in range(1, 5):
            progress.advance(k, f"loss {k:.4f}")
        progress.finish("loss 4.0000")
    shown = console.file.getvalue()
    assert "bootstrap: SFT step" in shown and "4/4" in shown and "SFT step 4/4, loss 4.0000 in" in shown


def test_history_both_trains_each_episode_in_both_layouts(tmp_path):
    # One row in the full layout and one packed state-grounded row per episode: twice the
    # sequences of either layout alone, under a cache key of its own.
    env = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0", kwargs={"map_size": 4, "max_turns": 6}))
    built = {}
    for history in ("full", "both"):
        boot = OmegaConf.structured(BootstrapConfig(n_episodes=12, sft_steps=2, batch_size=4, corpus_episodes=10,
                                                    tokenizer_vocab_size=300, cache_dir=str(tmp_path), history=history))
        boot.arch.hidden_size, boot.arch.num_heads, boot.arch.num_layers, boot.arch.intermediate_size = 64, 1, 1, 128
        lines: list[str] = []
        built[history] = build_bootstrap_model(boot, env, seed=0, log=lines.append)
        assert any(f"on 12 expert episodes ({12 * (2 if history == 'both' else 1)} sequences)" in line
                   for line in lines), lines
    assert built["full"] != built["both"]


def test_a_pretrained_start_is_cut_to_its_first_blocks_and_named_in_the_cache_key(tokenizer, tmp_path):
    """``bootstrap.init`` starts the SFT from a saved model (SmolLM2 in the studies; a saved tiny
    model here), ``init_layers`` keeps its first blocks with their weights, and both name the
    built model's cache entry."""
    from opd.models import save_model

    arch = OmegaConf.structured(BootstrapConfig()).arch
    arch.num_layers = 3
    source = tiny_qwen3(tokenizer, arch, seed=7)
    save_model(source, tokenizer, tmp_path / "base")

    boot = OmegaConf.structured(BootstrapConfig(init=str(tmp_path / "base"), init_layers=2, tokenizer=str(tmp_path / "base")))
    model = initial_model(boot, tokenizer, seed=0)
    assert len(model.model.layers) == model.config.num_hidden_layers == 2
    kept, original = model.state_dict(), source.state_dict()
    assert set(kept) == {k for k in original if not k.startswith("model.layers.2.")}
    assert all(torch.equal(kept[k], original[k]) for k in kept)  # the pretrained weights, not a fresh init
    ids = torch.tensor([tokenizer.encode("left down")])
    assert model(ids).logits.shape == source(ids).logits.shape  # a working model, one block short

    boot.init_layers = 5
    with pytest.raises(ValueError, match=r"'bootstrap.init_layers' is 5; .* has 3 transformer blocks"):
        initial_model(boot, tokenizer, seed=0)

    env = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0"))
    plain = OmegaConf.structured(BootstrapConfig())
    keys = {bootstrap_key(b, env, 0) for b in (plain, OmegaConf.structured(BootstrapConfig(init="")),
                                                         OmegaConf.structured(BootstrapConfig(init_layers=0)))}
    assert len(keys) == 1  # the same settings, the same key
    pretrained = [OmegaConf.structured(BootstrapConfig(init=str(tmp_path / "base"), tokenizer="t", init_layers=n))
                  for n in (0, 2)]
    assert len({bootstrap_key(b, env, 0) for b in pretrained} | keys) == 3


def test_a_plan_states_the_envs_state_line(tokenizer, fmt):
    """``think: plan`` targets say ``State: <the env's state_line>``: FrozenLake's last line, the
    clinical finding without its "Turns left" (not the reset's answer format); a think model has a
    cache key of its own."""
    from environments.clinical import ClinicalWorkupEnv

    frozen = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0"))
    clinical = OmegaConf.structured(EnvConfig(id="opd/ClinicalWorkup-v0"))
    assert env_state_of(frozen)("A F\nAround you: left wall.") == "Around you: left wall."
    assert env_state_of(clinical) is ClinicalWorkupEnv.state_line
    env = ClinicalWorkupEnv(n_train_tasks=5, n_eval_tasks=5)
    obs, info = env.reset(options={"task": env.task_ids("train")[0]})
    first = plan_text(obs, info["expert_action"], env_state_of(clinical))
    assert first == f"State: {obs.splitlines()[1]} Plan: {info['expert_action']}."
    assert plan_text(obs, "x").startswith("State: Reply with")  # the default: the answer format
    steps = [(obs, info["expert_action"], True), ("Troponin: 6 ng/L (normal). Turns left: 10.", "commit discharge", True),
             ("Decision: ...", "", False)]
    row = sft_row(steps, "t", tokenizer, fmt, think="plan", state_of=ClinicalWorkupEnv.state_line)
    (_, _), (start, end) = row["response_positions"]
    assert tokenizer.decode(row["input_ids"][start:end]).startswith("<think> State: Troponin: 6 ng/L (normal). Plan:")

    def key(env_cfg, think):
        return bootstrap_key(OmegaConf.structured(BootstrapConfig(think=think)), env_cfg, 0)

    assert key(clinical, "plan") != key(clinical, "") and key(frozen, "plan") != key(frozen, "")


def test_an_envs_data_version_is_in_the_key_so_a_changed_generator_retrains(monkeypatch):
    """ALFWorld's generated games carry a version (``GENERATOR_VERSION``): a bootstrap model
    trained on games of another version gets another key."""
    from environments.alfworld_env.env import ALFWorldTextEnv

    alfworld = OmegaConf.structured(EnvConfig(id="opd/ALFWorldText-v0", kwargs={"n_train_tasks": 4}))
    frozen = OmegaConf.structured(EnvConfig(id="opd/FrozenLakeText-v0"))
    boot = OmegaConf.structured(BootstrapConfig())
    before = bootstrap_key(boot, alfworld, 0)
    assert ALFWorldTextEnv.data_version == "generator-v1"
    monkeypatch.setattr(ALFWorldTextEnv, "data_version", "generator-v2")
    assert bootstrap_key(boot, alfworld, 0) != before
    hashed: list[dict] = []
    monkeypatch.setattr("opd.bootstrap.cache.digest", lambda payload: hashed.append(payload) or "k")
    bootstrap_key(boot, frozen, 0), bootstrap_key(boot, alfworld, 0)
    assert hashed[0]["data"] == "" and hashed[1]["data"] == "generator-v2"


def test_the_time_left_weighs_items_by_their_cost():
    """Issue 54, item 9: ``opd eval`` said 53 s left at 960 of 2,400 episodes and took 113 s more,
    because the episodes of the larger budgets to come take longer. With ``total_work`` the time
    left is the work to go at the time per unit of work."""
    now = [0.0]
    lines: list[str] = []
    costs = [2] * 800 + [4] * 800 + [8] * 800  # three budgets' episodes, each taking its turns' time
    progress = Progress(lines.append, "episode", total=len(costs), prefix="eval", clock=lambda: now[0],
                        total_work=float(sum(costs)))
    work = 0.0
    for done, cost in enumerate(costs[:960], start=1):
        now[0] += 0.01 * cost
        work += cost
        progress.advance(done, work=work)
    left = sum(costs[960:]) * 0.01
    assert progress.eta_s(960) == pytest.approx(left)  # 89.6 s, exactly what is left
    assert progress.eta_s(960) > 2.5 * (now[0] / 960 * (len(costs) - 960))  # the unweighted guess: 2.6x short
    assert lines and lines[-1].endswith(f"about {left:.0f}s left)"), lines[-1]
