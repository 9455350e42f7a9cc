"""The DeepSpeed trainer (CPU, gloo, in this process) takes a batch of any number of rows.

PivotOPD adds recovery rows, so a step's batch is not always ``rollout.episodes_per_step``
rows; ActFirst's rows are packed (a trunk with response branches, branch attention). The accumulated gradient must still be the whole
batch's: the trainer's reported loss and pre-clip gradient norm are compared with a plain
PyTorch forward/backward of the same loss over the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from opd.schema import TrainerConfig

pytestmark = pytest.mark.integration


def _batch(tokenizer, fmt, rows: int, seed: int):
    from opd.trajectory import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    data = []
    for r in range(rows):
        prompt = [fmt.im_start_id, *fmt.role_ids["user"], *tokenizer.encode("F F H G", add_special_tokens=False)]
        response = torch.randint(5, 250, (3 + r % 4,), generator=gen).tolist()
        n = len(prompt) + len(response)
        data.append({
            "input_ids": prompt + response,
            "attention_mask": [1] * n,
            "loss_mask": [0.0] * len(prompt) + [1.0] * len(response),
            "behaviour_logprobs": [0.0] * len(prompt) + (-torch.rand(len(response), generator=gen) * 3).tolist(),
            "teacher_logprobs": [0.0] * len(prompt) + (-torch.rand(len(response), generator=gen) * 3).tolist(),
            "turn_index": [-1] * len(prompt) + [0] * len(response),
        })
    return TokenBatch.from_rows(data, fmt.pad_id)


def _packed(batch, gen):
    """Each row made a packed one: its response a branch, then two trunk tokens and a second
    branch (which sees the trunk, not the first branch), with positions that skip branches."""
    from dataclasses import replace

    from opd.trajectory import TokenBatch

    rows = []
    for r in range(len(batch)):
        n = int(batch.attention_mask_BT[r].sum())
        ids = batch.input_ids_BT[r, :n].tolist()
        loss = batch.loss_mask_BT[r, :n].tolist()
        start = loss.index(1.0)
        second = torch.randint(5, 250, (3,), generator=gen).tolist()
        trunk_tail = torch.randint(5, 250, (2,), generator=gen).tolist()
        rows.append({
            "input_ids": ids + trunk_tail + second,
            "position_ids": list(range(start)) + list(range(start, n)) + list(range(start, start + 2))
            + list(range(start + 2, start + 5)),
            "branch_ids": [0] * start + [1] * (n - start) + [0, 0] + [2, 2, 2],
            "loss_mask": loss + [0.0, 0.0] + [1.0, 1.0, 1.0],
            "behaviour_logprobs": batch.behaviour_logprobs_BT[r, :n].tolist() + [0.0, 0.0, -1.0, -2.0, -0.5],
            "teacher_logprobs": batch.teacher_logprobs_BT[r, :n].tolist() + [0.0, 0.0, -0.7, -1.5, -2.5],
            "turn_index": batch.turn_index_BT[r, :n].tolist() + [-1, -1, 1, 1, 1],
        })
    out = TokenBatch.from_rows([{**r, "attention_mask": [1] * len(r["input_ids"])} for r in rows], 0)
    width = out.input_ids_BT.shape[1]

    def pad(key):
        t = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r[key])] = torch.tensor(r[key])
        return t

    return replace(out, position_ids_BT=pad("position_ids"), branch_ids_BT=pad("branch_ids"))


@pytest.mark.parametrize("rows,packed,batch_tokens,stage", [(3, False, 0, 1), (5, False, 0, 1), (8, False, 0, 0),
                                                            (11, False, 0, 1), (5, True, 0, 0), (11, False, 40, 1),
                                                            (5, True, 30, 1)])
def test_any_row_count_gives_the_whole_batch_gradient(rows, packed, batch_tokens, stage, tokenizer, fmt, tiny_model_dir):
    from opd.losses import combined_loss
    from opd.models import load_model
    from opd.training.trainer import StudentTrainer, TrainerSpec, token_logprobs

    # micro_batch_tokens splits the micro-batches further, by length (rows are 12-24 tokens here).
    # ZeRO 0 keeps the gradients on the parameters and DeepSpeed reports no norm there: the trainer's own.
    cfg = OmegaConf.structured(TrainerConfig(learning_rate=1e-3, micro_batch_size=2, zero_stage=stage,
                                             grad_clip_norm=1e9, micro_batch_tokens=batch_tokens))
    terms = [("reverse_kl", 1.0, {})]
    batch = _batch(tokenizer, fmt, rows, seed=rows)
    if packed:
        batch = _packed(batch, torch.Generator().manual_seed(rows))

    model = load_model(tiny_model_dir)
    loss, _ = combined_loss(batch.with_totals().with_student(token_logprobs(model, batch)), terms)
    loss.backward()
    expected_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()

    trainer = StudentTrainer(TrainerSpec(cfg, tuple(terms), tiny_model_dir, episodes_per_step=4))
    before = {k: v.clone() for k, v in trainer.export_weights().items()}
    metrics = trainer.train_step(batch)
    after = trainer.export_weights()

    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-3)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0  # one optimizer step was taken


def test_reference_kl_anchors_to_the_starting_weights(tokenizer, fmt, tiny_model_dir):
    """With ``reference_kl`` the trainer keeps a frozen copy of the starting weights: the anchor
    is 0 at the first step, and after an update the loss equals a plain PyTorch computation with
    the updated student against the untouched starting model."""
    from dataclasses import replace

    from opd.losses import combined_loss
    from opd.models import load_model
    from opd.training.trainer import StudentTrainer, TrainerSpec, token_logprobs

    cfg = OmegaConf.structured(TrainerConfig(learning_rate=1e-2, micro_batch_size=2, zero_stage=1, grad_clip_norm=1e9))
    terms = [("reverse_kl", 1.0, {}), ("reference_kl", 0.5, {})]
    batch = _batch(tokenizer, fmt, 4, seed=3)
    trainer = StudentTrainer(TrainerSpec(cfg, tuple(terms), tiny_model_dir, episodes_per_step=4))
    first = trainer.train_step(batch)
    assert first["reference_kl/kl"] == pytest.approx(0.0, abs=1e-7)
    moved = trainer.export_weights()
    second = trainer.train_step(batch)

    start = load_model(tiny_model_dir)
    student = load_model(tiny_model_dir)
    student.load_state_dict(moved)
    with torch.no_grad():
        reference_BT = token_logprobs(start, batch)
    loss, metrics = combined_loss(replace(batch.with_totals(), reference_logprobs_BT=reference_BT)
                                  .with_student(token_logprobs(student, batch)), terms)
    assert second["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    assert second["reference_kl/kl"] == pytest.approx(metrics["reference_kl/kl"], rel=1e-4)
    assert second["reference_kl/kl"] > 1e-4  # the student moved away from its start
    start_weights = start.state_dict()
    assert all(torch.equal(v, start_weights[k]) for k, v in trainer.reference.state_dict().items())
