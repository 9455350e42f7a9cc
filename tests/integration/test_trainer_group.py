"""A trainer group: ``resources.trainer_ranks`` StudentTrainer actors forming one torch.distributed
group (gloo on CPU, a file rendezvous on one node) under one DeepSpeed engine.

Each rank trains its share of the batch rows normalised by the whole batch's totals, so one
optimizer step of two ranks under any ZeRO stage is the step of one rank under ZeRO-0: the same
loss and metrics, the same updated weights (gathered from the ZeRO-3 shards). A rank left with
fewer rows (or none) runs idle micro-batches so that the collectives stay in step. The sharded
checkpoint of a group resumes exactly, and a group of another size is refused with the key to set.

Real parts: Ray actors, DeepSpeed's ZeRO over gloo, the tiny Qwen3 of the test fixtures.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from opd.schema import ResourcesConfig, TrainerConfig
from tests.integration.test_trainer_rows import _batch

pytestmark = pytest.mark.integration
TERMS = [("reverse_kl", 1.0, {})]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from opd.runtime.cluster import init_ray

    init_ray(OmegaConf.structured(ResourcesConfig(num_cpus=4)))
    yield
    ray.shutdown()


def _cfg(stage: int):
    return OmegaConf.structured(TrainerConfig(learning_rate=1e-2, micro_batch_size=2, zero_stage=stage,
                                              grad_clip_norm=1e9))


def _group(model_dir: str, stage: int, ranks: int, lora=None) -> list:
    """``ranks`` trainer actors meeting through a file rendezvous, as spawn_workers starts them."""
    import ray

    from opd.runtime.actors import rendezvous_point
    from opd.training.trainer import StudentTrainer, TrainerSpec

    rendezvous = ray.get(ray.remote(rendezvous_point).remote(True)) if ranks > 1 else None
    actor = ray.remote(StudentTrainer).options(num_cpus=0.5)
    spec = TrainerSpec(_cfg(stage), tuple(TERMS), model_dir, 4, torch_threads=1, lora=lora)
    return [actor.remote(spec, rank=r, world_size=ranks, rendezvous=rendezvous) for r in range(ranks)]


def _step(group: list, batch) -> tuple[list[dict], list]:
    """One step on every rank; each rank's metrics and export (rank 0's weights, None elsewhere)."""
    import ray

    metrics = ray.get([t.train_step.remote(batch) for t in group])
    return metrics, ray.get([t.export_weights.remote() for t in group])


def _end(group: list) -> None:
    import ray

    for actor in group:
        ray.kill(actor)


@pytest.mark.parametrize("stage,rows", [(3, 5), (0, 3), (2, 1)])
def test_two_ranks_take_the_one_rank_zero0_step(stage, rows, tokenizer, fmt, tiny_model_dir, ray_local):
    """5 rows: ranks of 3 and 2 rows (2 and 1 micro-batches); 1 row: rank 1 has none."""
    from opd.models import load_model

    batch = _batch(tokenizer, fmt, rows, seed=rows)
    one = _group(tiny_model_dir, 0, 1)
    (expected,), (weights,) = _step(one, batch)
    _end(one)
    two = _group(tiny_model_dir, stage, 2)
    got, exported = _step(two, batch)
    _end(two)

    assert exported[1] is None  # rank 0 answers for the group
    assert all(got[0][k] == got[1][k] for k in got[0] if not k.startswith("time/"))  # every rank: the whole step's
    timeless = [k for k in expected if not k.startswith(("time/", "memory/"))]
    assert sorted(timeless) == sorted(k for k in got[0] if not k.startswith(("time/", "memory/")))
    for key in timeless:
        assert got[0][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert got[0]["train_rows"] == rows and got[0]["loss"] > 0
    assert got[0]["memory/trainer_peak_rss_mb"] > 100  # the largest rank's peak (a process's own differs)
    start = load_model(tiny_model_dir).state_dict()
    assert max((weights[k] - start[k]).abs().max().item() for k in weights) > 1e-4  # the step moved them
    worst = max((exported[0][k] - weights[k]).abs().max().item() for k in weights)
    assert worst < 1e-5, f"updated weights differ by {worst:.2e}"


def test_a_group_checkpoint_resumes_exactly_and_refuses_another_rank_count(tmp_path, tokenizer, fmt, tiny_model_dir,
                                                                          ray_local):
    import ray

    from opd.training.checkpoint import CheckpointError

    first, second = _batch(tokenizer, fmt, 5, seed=1), _batch(tokenizer, fmt, 4, seed=2)
    group = _group(tiny_model_dir, 3, 2)
    _step(group, first)
    ray.get([t.save_checkpoint.remote(str(tmp_path)) for t in group])
    expected, (weights, _) = _step(group, second)
    _end(group)

    shards = sorted(p.name for p in (tmp_path / "ds" / "state").iterdir())
    assert sum("optim_states" in name for name in shards) == 2, shards  # one optimizer shard per rank
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # gathered, written once

    resumed = _group(tiny_model_dir, 3, 2)
    ray.get([t.load_checkpoint.remote(str(tmp_path)) for t in resumed])
    got, (after, _) = _step(resumed, second)
    _end(resumed)
    for key in expected[0]:
        if not key.startswith(("time/", "memory/")):
            assert got[0][key] == pytest.approx(expected[0][key], rel=1e-6, abs=1e-9), key
    assert max((after[k] - weights[k]).abs().max().item() for k in weights) < 1e-6

    lone = _group(tiny_model_dir, 3, 1)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(lone[0].load_checkpoint.remote(str(tmp_path)))
    _end(lone)
    assert isinstance(info.value.cause, CheckpointError)
    assert "written by 2 trainer rank(s) under ZeRO stage 3" in str(info.value.cause)
    assert "resources.trainer_ranks=2" in str(info.value.cause)


def test_a_lora_group_takes_the_one_rank_step_and_resumes_exactly(tmp_path, tokenizer, fmt, tiny_model_dir, ray_local):
    """LoRA adapters on two ZeRO-3 ranks: the one-rank ZeRO-0 step (metrics and adapters), the
    adapters alone exported (gathered from the shards), and the group's checkpoint resumes exactly."""
    import ray

    from opd.schema import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0)
    first, second = _batch(tokenizer, fmt, 5, seed=3), _batch(tokenizer, fmt, 4, seed=4)
    one = _group(tiny_model_dir, 0, 1, lora)
    (expected,), (update,) = _step(one, first)
    _end(one)
    group = _group(tiny_model_dir, 3, 2, lora)
    got, (exported, none) = _step(group, first)
    assert none is None and exported.factors.keys() == update.factors.keys() and len(update.factors) == 14
    for name, (a, b, scale) in update.factors.items():
        a2, b2, scale2 = exported.factors[name]
        assert scale2 == scale and float((a2 - a).abs().max()) < 1e-5 and float((b2 - b).abs().max()) < 1e-5, name
    for key in expected:
        if not key.startswith(("time/", "memory/")):
            assert got[0][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert max(float(b.abs().max()) for _, b, _ in update.factors.values()) > 0  # B left zero: the step moved it

    ray.get([t.save_checkpoint.remote(str(tmp_path)) for t in group])
    after, (want, _) = _step(group, second)
    _end(group)
    resumed = _group(tiny_model_dir, 3, 2, lora)
    ray.get([t.load_checkpoint.remote(str(tmp_path)) for t in resumed])
    again, (have, _) = _step(resumed, second)
    _end(resumed)
    for key in after[0]:
        if not key.startswith(("time/", "memory/")):
            assert again[0][key] == pytest.approx(after[0][key], rel=1e-6, abs=1e-9), key
    for name, (a, b, _) in want.factors.items():
        assert torch.equal(have.factors[name][0], a) and torch.equal(have.factors[name][1], b), name

