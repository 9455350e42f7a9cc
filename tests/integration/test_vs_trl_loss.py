"""opd's exact reverse KL optimises what TRL's GKDTrainer optimises at lambda = 1, beta = 1.

On one batch built the way a vanilla_opd step builds it (two tiny Qwen3s with one tokenizer,
the student's own samples on the shipped arithmetic prompts, the teacher's full
distributions from opd's scoring), :func:`opd.evaluation.trl_parity.loss_agreement` computes opd's
``reverse_kl`` (``estimator: full``, the trainer's logprob path) and TRL's
``GKDTrainer.generalized_jsd_loss(beta=1.0)``. Both are the mean over the batch's completion
tokens of the exact per-token KL(student || teacher), so they must agree without any factor, and
so must the student's gradients; ``beta=0.0`` must be opd's ``forward_kl`` (TRL's convention).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="the comparison with TRL's GKDTrainer needs trl (the dev extra: trl==1.16.0)")

from opd.envs import EnvFactory  # noqa: E402
from opd.evaluation.trl_parity import loss_agreement  # noqa: E402
from opd.models import save_model, tiny_qwen3, train_chat_tokenizer  # noqa: E402
from opd.schema import TinyArchConfig  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "environments" / "prompt_data" / "arith_tiny.jsonl"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A teacher and a student: tiny Qwen3s of different seeds, one tokenizer trained on the data.

    The teacher is random, its logits sharpened (scaling the final norm: a fresh model is nearly
    uniform, and the KL of two such would be about 0.03). The student learns the answers for a
    few steps, so that it sometimes ends early: rows of unequal lengths, on which a per-token mean
    and a per-sequence one differ."""
    from opd.chat import ChatFormat, first_prompt_ids

    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    tokenizer = train_chat_tokenizer([f"{r['prompt']} {r['answer']}" for r in rows], vocab_size=320)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    arch = TinyArchConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128)
    teacher, student = tiny_qwen3(tokenizer, arch, seed=0), tiny_qwen3(tokenizer, arch, seed=1)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(8.0)
    sequences = []
    for r in rows[:64]:
        prompt = first_prompt_ids(fmt, tokenizer, r["prompt"])
        answer = tokenizer.encode(" " + r["answer"], add_special_tokens=False) + [fmt.im_end_id]
        sequences.append((prompt + answer, len(prompt)))
    width = max(len(ids) for ids, _ in sequences)
    ids_BT = torch.tensor([ids + [fmt.pad_id] * (width - len(ids)) for ids, _ in sequences])
    labels_BT = torch.tensor([[-100] * n + ids[n:] + [-100] * (width - len(ids)) for ids, n in sequences])
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    student.train()
    for _ in range(15):
        loss = student(input_ids=ids_BT, attention_mask=ids_BT != fmt.pad_id, labels=labels_BT).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dirs = {}
    for role, model in (("teacher", teacher), ("student", student.eval())):
        dirs[role] = str(tmp_path_factory.mktemp(role))
        save_model(model, tokenizer, dirs[role])
    return dirs


def test_reverse_kl_full_equals_trl_generalized_jsd_at_beta_1(model_dirs):
    env_factory = EnvFactory("opd/PromptDataset-v0", {"path": str(DATA)})
    tasks = env_factory().unwrapped.task_ids("train")[:8]
    result = loss_agreement(model_dirs["student"], model_dirs["teacher"], env_factory, tasks,
                                     max_new_tokens=6, temperature=1.0, seed=0)

    assert result["rows"] == 8
    assert result["tokens"] == sum(result["row_tokens"]) and max(result["row_tokens"]) <= 6
    assert len(set(result["row_tokens"])) > 1  # per-token and per-sequence means differ on this batch
    assert result["opd_loss"] > 0.5  # two different, peaked models: a real divergence, not 0 = 0
    assert result["abs_diff"] < 1e-4
    assert result["trl_loss"] == pytest.approx(result["opd_loss"], rel=1e-5, abs=1e-6)
    # Equal losses could still weigh tokens differently; equal gradients cannot.
    assert result["grad_max_abs"] > 0
    assert result["grad_max_abs_diff"] <= 1e-4 * result["grad_max_abs"]
    # The teacher's full distribution from opd's packed scoring is the plain forward's.
    assert result["teacher_max_abs_diff"] < 1e-4
    # TRL's beta = 0 end is the forward KL, KL(teacher || student).
    assert result["trl_beta0"] == pytest.approx(result["opd_forward_kl"], rel=1e-5, abs=1e-6)
    assert result["trl_beta0"] != pytest.approx(result["trl_loss"], rel=1e-3)
