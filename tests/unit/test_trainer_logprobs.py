"""The trainer's gathered logprobs (:func:`opd.training.trainer.student_logprobs_at`) against the
straightforward log-softmax over every position (:func:`opd.training.trainer.student_logprobs`).

The trainer runs the LM head and the log-softmax only where the losses read them (the response
tokens and the named masks); every built-in loss must give the same value and the same gradient
on every parameter, for ``sampled``, ``topk`` and ``full`` scoring, packed rows, named masks,
a reference model and a sampling temperature.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from opd.generation.base import scores_from_logprobs
from opd.losses import combined_loss
from opd.supervision.teacher_view import with_teacher_scores
from opd.training.trainer import (needs_student_distribution, reads_trained_positions_only, student_logprobs,
                                  student_logprobs_at, trained_positions_BT)
from opd.trajectory import HeadRows, TokenBatch


def _rows(fmt, vocab: int, n_rows: int, gen: torch.Generator, packed: bool) -> tuple[list[dict], list[list[int]]]:
    """Multi-turn rows (prompt, response, prompt, response...) of random tokens; with ``packed``,
    each row's second response is a branch (``branch_ids`` 1, positions that restart after it).
    Also each row's response positions, in order."""
    rows, positions = [], []
    for r in range(n_rows):
        ids, loss, turn, branch, pos, where = [], [], [], [], [], []
        for k in range(2 + r % 2):
            prompt = [fmt.im_start_id, *torch.randint(5, vocab, (4 + (r + k) % 3,), generator=gen).tolist()]
            response = torch.randint(5, vocab, (3 + (r * k) % 4,), generator=gen).tolist()
            on_branch = packed and k == 1
            start = len(ids)
            base = pos[-1] + 1 if pos else 0
            if packed and k == 2:  # the trunk continues from the end of the first response
                base = pos[branch.index(1) - 1] + 1
            ids += prompt + response
            loss += [0.0] * len(prompt) + [1.0] * len(response)
            turn += [-1] * len(prompt) + [k] * len(response)
            branch += [1 if on_branch else 0] * (len(prompt) + len(response))
            pos += list(range(base, base + len(prompt) + len(response)))
            where += list(range(start + len(prompt), len(ids)))
        row = {"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": loss, "turn_index": turn,
               "behaviour_logprobs": [0.0 if m == 0 else -float(torch.rand(1, generator=gen)) * 3 for m in loss]}
        if packed:
            row.update(position_ids=pos, branch_ids=branch)
        rows.append(row)
        positions.append(where)
    return rows, positions


def _batch(fmt, vocab: int, scoring: str, packed: bool = False, masks: bool = False, seed: int = 0) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    rows, positions = _rows(fmt, vocab, 4, gen, packed)
    batch = TokenBatch.from_rows(rows, fmt.pad_id)
    scores = []
    for b, where in enumerate(positions):
        logp_NV = torch.log_softmax(torch.randn(len(where), vocab, generator=gen) * 2, dim=-1)
        scores.append(scores_from_logprobs(logp_NV, batch.input_ids_BT[b, where], scoring, top_k=5))
    batch = with_teacher_scores(batch, positions, scores)
    batch = replace(batch, advantage_B=torch.randn(len(batch), generator=gen))
    if masks:  # PivotOPD's: a pivot turn in rows 0-1, recovery in the other rows (and their top-k targets)
        pivot_BT = batch.loss_mask_BT * (batch.turn_index_BT == 1)
        pivot_BT[2:] = 0
        recovery_BT = batch.loss_mask_BT.clone()
        recovery_BT[:2] = 0
        batch = replace(batch, masks_BT={"pivot": pivot_BT, "recovery": recovery_BT},
                        loss_mask_BT=batch.loss_mask_BT * (torch.arange(len(batch)) < 2)[:, None])
    return batch.with_totals(micro_batches=1)


def _loss_and_grads(model, batch, terms, temperature, gathered: bool, reference=None, chunk_rows: int = 0):
    model.zero_grad(set_to_none=True)
    if gathered:
        positions_BT = trained_positions_BT(batch)
        if reference is not None:
            with torch.no_grad():
                batch = replace(batch, reference_logprobs_BT=student_logprobs_at(reference, batch, positions_BT,
                                                                                 temperature)[0])
        student = student_logprobs_at(model, batch, positions_BT, temperature, needs_student_distribution(batch, terms),
                                      chunk_rows)
        if chunk_rows and student[1] is not None:
            assert isinstance(student[1], HeadRows)  # the chunked path, not the [N, V] rows
    else:
        if reference is not None:
            with torch.no_grad():
                batch = replace(batch, reference_logprobs_BT=student_logprobs(reference, batch, temperature)[0])
        student = student_logprobs(model, batch, temperature)
    loss, metrics = combined_loss(batch.with_student(*student), terms)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {
    "sampled": ("sampled", [("reverse_kl", 1.0, {}), ("sft", 0.1, {"normalize": "turn"}), ("ppo_clip", 0.5, {})]),
    "sampled_baseline": ("sampled", [("reverse_kl", 1.0, {"baseline": "batch_mean", "turn_weights": [1.0, 0.5]})]),
    "topk": ("topk", [("reverse_kl", 1.0, {}), ("forward_kl", 0.5, {"normalize": "sequence"}),
                      ("gjsd", 0.3, {"beta": 0.3})]),
    "full": ("full", [("reverse_kl", 1.0, {}), ("forward_kl", 0.5, {}), ("gjsd", 0.3, {})]),
    "full_sampled_estimator": ("full", [("reverse_kl", 1.0, {"estimator": "sampled"}), ("gjsd", 1.0, {"beta": 1.0})]),
}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from opd.models import load_model

    return load_model(tiny_model_dir).train()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gathered_logprobs_give_the_same_losses_and_gradients(case, packed, model, fmt):
    scoring, terms = CASES[case]
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = _batch(fmt, vocab, scoring, packed=packed, seed=len(case))
    assert reads_trained_positions_only(terms)
    temperature = 0.7
    want_loss, want_metrics, want_grads = _loss_and_grads(model, batch, terms, temperature, gathered=False)
    got_loss, got_metrics, got_grads = _loss_and_grads(model, batch, terms, temperature, gathered=True)
    _assert_same(want_loss, want_metrics, want_grads, got_loss, got_metrics, got_grads)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_over_the_vocabulary_give_the_same_losses_and_gradients(case, packed, model, fmt):
    """``trainer.vocab_chunk_tokens``: the student's rows 3 at a time (about 15 chunks here), each
    recomputed in the backward pass, against all at once: the same loss and gradient (float32)."""
    scoring, terms = CASES[case]
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = _batch(fmt, vocab, scoring, packed=packed, seed=len(case) + 1)
    want = _loss_and_grads(model, batch, terms, 0.7, gathered=True)
    got = _loss_and_grads(model, batch, terms, 0.7, gathered=True, chunk_rows=3)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    for name, grad in want[2].items():
        assert float((got[2][name] - grad).abs().max()) <= 1e-6 * max(1.0, float(grad.abs().max())), name
    assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_named_masks_and_the_reference_are_gathered_too(packed, model, fmt, tiny_model_dir):
    from opd.models import load_model

    reference = load_model(tiny_model_dir)
    with torch.no_grad():  # a reference that differs from the student
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    terms = [("reverse_kl", 1.0, {}), ("pivot_preventive", 0.5, {}), ("pivot_recovery", 0.5, {}),
             ("reference_kl", 0.2, {})]
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = _batch(fmt, vocab, "topk", packed=packed, masks=True, seed=7)
    want = _loss_and_grads(model, batch, terms, 1.0, gathered=False, reference=reference)
    got = _loss_and_grads(model, batch, terms, 1.0, gathered=True, reference=reference)
    _assert_same(*want, *got)
    assert got[1]["reference_kl/kl"] > 0 and got[1]["pivot_recovery/tokens"] > 0


def _assert_same(want_loss, want_metrics, want_grads, got_loss, got_metrics, got_grads):
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-7)
    assert got_metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        scale = float(want.abs().max())
        torch.testing.assert_close(got_grads[name], want, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=name)
        assert scale > 0, name  # every parameter gets a gradient (the LM head and the embedding included)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_only_the_selected_positions_are_computed(packed, model, fmt, monkeypatch):
    """Zero elsewhere, no full distribution unless asked for, and no fallback to the plain path
    on a Qwen3 (whose head is a plain linear map)."""
    import opd.training.trainer as trainer

    vocab = model.get_output_embeddings().weight.shape[0]
    batch = _batch(fmt, vocab, "sampled", packed=packed, seed=3)
    positions_BT = trained_positions_BT(batch)
    with torch.no_grad():
        want_BT = student_logprobs(model, batch)[0]
        monkeypatch.setattr(trainer, "student_logprobs", None)  # the fallback would call it
        picked_BT, full_BTV = student_logprobs_at(model, batch, positions_BT)
    assert full_BTV is None
    assert torch.equal(picked_BT[~positions_BT], torch.zeros(int((~positions_BT).sum())))
    torch.testing.assert_close(picked_BT[positions_BT], want_BT[positions_BT], rtol=1e-5, atol=1e-6)
    assert not needs_student_distribution(batch, [("reverse_kl", 1.0, {})])
    assert needs_student_distribution(batch, [("reverse_kl", 1.0, {"estimator": "topk"})])
    assert needs_student_distribution(_batch(fmt, vocab, "full", seed=3), [("reverse_kl", 1.0, {})])


def test_a_users_loss_gets_every_position():
    """A loss of the user's may read any position: the trainer then computes them all."""
    assert reads_trained_positions_only([("reverse_kl", 1.0, {}), ("sft", 0.1, {})])
    assert not reads_trained_positions_only([("reverse_kl", 1.0, {}),
                                             ("examples.custom_loss.my_losses.teacher_weighted_nll", 0.1, {})])


def test_a_soft_capped_head_falls_back_to_every_position(model, fmt, caplog):
    """Gemma 2 soft-caps its logits after the head: the gathered path notices and computes the
    plain log-softmax, with the same numbers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=64, final_logit_softcapping=5.0,
                          pad_token_id=0, bos_token_id=None, eos_token_id=None)
    gemma = Gemma2ForCausalLM(config).train()
    batch = _batch(fmt, vocab, "topk", seed=5)
    terms = [("reverse_kl", 1.0, {}), ("forward_kl", 1.0, {})]
    want = _loss_and_grads(gemma, batch, terms, 1.0, gathered=False)
    with caplog.at_level("WARNING", logger="opd.training.trainer"):
        got = _loss_and_grads(gemma, batch, terms, 1.0, gathered=True)
    _assert_same(*want, *got)
    assert "Gemma2ForCausalLM: the LM head is not a plain linear map" in caplog.text


@pytest.mark.integration
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_deepspeed_trainer_takes_the_same_step_either_way(zero_stage, fmt, tiny_model_dir):
    """Through DeepSpeed (the LM head called outside the engine's forward, ZeRO-3 included), with
    the single-rank all-reduce skipped at stage 0 and the fused AdamW: the same loss, gradient
    norm and update as the trainer before them (every position's log-softmax, DeepSpeed's
    all-reduce, AdamW's per-op loop)."""
    from omegaconf import OmegaConf

    import opd.training.trainer as trainer
    from opd.schema import TrainerConfig

    cfg = OmegaConf.structured(TrainerConfig(learning_rate=1e-3, micro_batch_size=2, zero_stage=zero_stage,
                                             grad_clip_norm=1e9))
    terms = [("reverse_kl", 1.0, {}), ("forward_kl", 0.5, {})]
    steps = {}
    for gathered in (False, True):
        student = trainer.StudentTrainer(trainer.TrainerSpec(cfg, tuple(terms), tiny_model_dir, episodes_per_step=4))
        student.gather_logprobs = gathered  # False: every position's log-softmax, as a user's loss gets
        if not gathered:
            student.engine.enable_backward_allreduce = True
            for group in student.engine.optimizer.param_groups:
                group["fused"] = False
        batch = _batch(fmt, student.engine.module.config.vocab_size, "topk", packed=True, seed=11)
        metrics = student.train_step(replace(batch, totals=None))
        steps[gathered] = metrics, student.export_weights()
    (want, want_w), (got, got_w) = steps[False], steps[True]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    for name, w in want_w.items():
        torch.testing.assert_close(got_w[name], w, rtol=1e-5, atol=1e-6)
