"""``trainer.engine: torch`` (:class:`opd.training.torch_engine.TorchEngine`) against plain PyTorch.

The engine must do DeepSpeed's one-rank arithmetic (each micro-batch's loss over the accumulation
steps, the global-norm clip at the boundary, AdamW, the schedule), checkpoint without pickles and
resume to the same next update; with bfloat16 the trainer's LM head, applied by hand at the
trained positions, runs under the engine's autocast. (The comparison with DeepSpeed itself, over
whole runs, is in ``tests/integration/test_local_backend.py``.)
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from opd.training.torch_engine import TorchEngine
from opd.training.trainer import adamw, lr_multiplier, student_logprobs, student_logprobs_at
from opd.trajectory import TokenBatch


def _model(seed: int = 0, tied: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        tie_word_embeddings=tied))


def _engine(model, clip: float = 0.05, accumulation: int = 2) -> TorchEngine:
    optimizer = adamw(list(model.parameters()), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(2, 10, "cosine"))
    return TorchEngine(model, optimizer, scheduler, accumulation, clip)


def _micro(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _step(engine: TorchEngine, seeds: tuple[int, ...]) -> None:
    for m, seed in enumerate(seeds):
        engine.set_gradient_accumulation_boundary(m == len(seeds) - 1)
        engine.backward(_loss(engine, _micro(seed)))
    engine.step()


def test_a_step_is_deepspeeds_one_rank_arithmetic():
    model, plain = _model(), _model()
    engine = _engine(model)
    optimizer = adamw(list(plain.parameters()), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(2, 10, "cosine"))
    for step in range(3):
        seeds = (2 * step, 2 * step + 1)
        _step(engine, seeds)
        for seed in seeds:  # by hand: mean over the micro-batches, clip, update, schedule
            (_loss(plain, _micro(seed)) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-6)
        assert norm > 0.05  # the clip did act
        assert engine.get_lr() == pytest.approx(scheduler.get_last_lr())
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_no_update_before_the_accumulation_boundary():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    engine = _engine(model)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(_loss(engine, _micro(0)))
    engine.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert engine.global_steps == 0 and engine.get_global_grad_norm() is None


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_is_safetensors_and_json_and_resumes_to_the_same_update(tmp_path, tied):
    model = _model(tied=tied)
    engine = _engine(model)
    _step(engine, (0, 1))
    engine.save_checkpoint(str(tmp_path), "state", {"steps": 1})
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert files == ["model.safetensors", "optimizer.safetensors", "state.json"]
    assert json.loads((tmp_path / "state" / "state.json").read_text())["client_state"] == {"steps": 1}
    _step(engine, (2, 3))  # the run goes on...

    fresh = _engine(_model(seed=5, tied=tied))  # ...and another process resumes from the checkpoint
    path, client = fresh.load_checkpoint(str(tmp_path), "state")
    assert path == str(tmp_path / "state") and client == {"steps": 1} and fresh.global_steps == 1
    if tied:
        assert fresh.module.lm_head.weight is fresh.module.model.embed_tokens.weight
    _step(fresh, (2, 3))
    for (name, a), b in zip(engine.module.state_dict().items(), fresh.module.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.get_lr() == engine.get_lr()


def test_a_missing_checkpoint_is_none_and_a_mismatched_one_is_refused(tmp_path):
    engine = _engine(_model())
    assert engine.load_checkpoint(str(tmp_path), "state") == (None, {})
    engine.save_checkpoint(str(tmp_path), "state", {})
    small = _model()
    small.model.layers = small.model.layers[:1]  # another model: the checkpoint has a second layer too many
    with pytest.raises(ValueError, match=r"weights do not match the model.*unexpected \['model.layers.1"):
        _engine(small).load_checkpoint(str(tmp_path), "state")


def test_bfloat16_autocast_reaches_the_head_applied_at_trained_positions():
    model = _model()
    engine = TorchEngine(model, adamw(list(model.parameters()), lr=1e-3),
                         torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(model.parameters()), lambda s: 1.0), 1, 1.0,
                         autocast_dtype=torch.bfloat16)
    ids = _micro(0)
    loss_mask = torch.zeros_like(ids, dtype=torch.float)
    loss_mask[:, 4:] = 1
    batch = TokenBatch(input_ids_BT=ids, attention_mask_BT=torch.ones_like(ids), loss_mask_BT=loss_mask,
                       behaviour_logprobs_BT=torch.zeros_like(loss_mask), teacher_logprobs_BT=torch.zeros_like(loss_mask),
                       turn_index_BT=torch.zeros_like(ids))
    picked, _ = student_logprobs_at(engine, batch, loss_mask > 0)
    with torch.no_grad():
        exact, _ = student_logprobs(model, batch)  # float32, every position
    assert model.lm_head.weight.dtype == torch.float32  # the weights stay float32
    assert picked.dtype == torch.float32 and torch.all(picked[:, :4] == 0)
    assert (picked[:, 4:] - exact[:, 4:]).abs().max() < 0.05  # bfloat16 rounding, not a wrong position
    assert (picked[:, 4:] - exact[:, 4:]).abs().max() > 0  # and it did run in bfloat16
    picked.sum().backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()
