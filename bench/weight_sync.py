"""Weight sync at real model sizes: the trainer's weights to 1 and 2 rollout replicas through the
path a run takes (``RayWorkers.sync_weights``: the trainer's export put in Ray's object store once,
every replica loading it in place), against this machine's memory bandwidth measured in the same
run (a large ``memcpy``).

    .venv/bin/python bench/weight_sync.py                 # about 15 minutes on 2 idle cores
    .venv/bin/python bench/weight_sync.py --quick         # SmolLM2 in float32, HF engine, 1 replica

Models: SmolLM2-135M-Instruct (the real model, float32 and bfloat16) and a randomly initialised
model of Qwen3-0.6B's shape (28 layers, 1,024 wide, 151,936-token vocabulary, tied head: 0.6B
parameters; float32 and bfloat16). Engines: HF, and vLLM where its CPU build is installed. Per
case: the bytes a replica received (``weight_sync_mb``) against the model's size, the median of
a few syncs (``weight_sync_s``, from the trainer's export to the last replica's load), and the
share of the bandwidth that is: ``model bytes / seconds`` over the ``memcpy``'s bytes per second.
Each sync moves the model at least twice (into the object store, out of it into the engine's
weights), so half the bandwidth is the ceiling of a one-copy path. Results:
``<out>/weight_sync.json`` and ``weight_sync.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def memcpy_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of the best of ``repeats`` copies of a ``mib`` MiB tensor into another."""
    import torch

    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return source.numel() * 4 / best


def qwen3_06b_dir(dtype: str) -> str:
    """A randomly initialised model of Qwen3-0.6B's shape in ``dtype``, saved once under /tmp
    (SmolLM2's tokenizer beside it: the engines need one; the sync never reads it)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from opd.models import smollm2_model_dir

    directory = Path(f"/tmp/opd-bench-qwen3-0.6b-{dtype}")
    if (directory / "model.safetensors").is_file():
        return str(directory)
    config = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(smollm2_model_dir()).save_pretrained(directory)
    return str(directory)


def smollm2_dir(dtype: str) -> str:
    """SmolLM2-135M-Instruct in ``dtype`` (saved once under /tmp for bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.models import smollm2_model_dir

    if dtype == "float32":
        return smollm2_model_dir()
    directory = Path(f"/tmp/opd-bench-smollm2-{dtype}")
    if not (directory / "model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir(), dtype=getattr(torch, dtype))
        model.save_pretrained(directory)
        AutoTokenizer.from_pretrained(smollm2_model_dir()).save_pretrained(directory)
    return str(directory)


def model_bytes(path: str) -> int:
    """The bytes of the model's distinct tensors (a tied head counted once)."""
    from safetensors import safe_open

    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                sliced = f.get_slice(name)
                shape, dtype = sliced.get_shape(), sliced.get_dtype()
                n = 1
                for d in shape:
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}.get(dtype, 4)
    return total


def one_case(model: str, path: str, dtype: str, engine: str, replicas: int, syncs: int) -> dict:
    """Real actors as a run starts them (the tiny test recipe with this model as the student),
    ``syncs`` weight syncs, and what they moved."""
    import ray

    from opd.config import load_config
    from opd.runtime.actors import spawn_workers
    from opd.runtime.cluster import init_ray

    cfg = load_config(str(ROOT / "tests" / "data" / "tiny.yaml"), [
        f"student.path={path}", "student.bootstrap=null", f"student.dtype={dtype}", f"student.engine={engine}",
        f"teacher.path={path}", "teacher.bootstrap=null", f"teacher.dtype={dtype}",
        f"resources.rollout_replicas={replicas}", "resources.rollout_cpus=0.25", "resources.teacher_cpus=0.25",
        "resources.trainer_cpus=0.5", "trainer.zero_stage=0"])
    init_ray(cfg.resources)
    workers = spawn_workers(cfg, path, path)
    try:
        results = [workers.sync_weights() for _ in range(syncs + 1)][1:]  # the first warms the path
    finally:
        workers.shutdown()
        ray.shutdown()
    size = model_bytes(path)
    seconds = statistics.median(r["weight_sync_s"] for r in results)
    return {"model": model, "dtype": dtype, "engine": engine, "replicas": replicas, "model_mb": size / 2**20,
            "received_mb": results[-1]["weight_sync_mb"], "seconds": seconds,
            "load_s": statistics.median(r["weight_load_s"] for r in results),
            "bytes_per_s": size * replicas / seconds}


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"memcpy bandwidth: {bandwidth / 2**30:.2f} GiB/s", "",
             "| model | dtype | engine | replicas | model MiB | received per replica MiB | sync s (median) | "
             "load s | model bytes x replicas / s | share of memcpy |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['engine']} | {r['replicas']} | {r['model_mb']:,.1f} | "
                     f"{r['received_mb']:,.1f} | {r['seconds']:.2f} | {r['load_s']:.2f} | "
                     f"{r['bytes_per_s'] / 2**30:.2f} GiB/s | {r['bytes_per_s'] / bandwidth:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2 in float32, HF engine, one replica")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--engines", nargs="+", choices=["hf", "vllm"], help="default: hf, and vllm where installed")
    parser.add_argument("--out", default="runs/bench_weight_sync")
    args = parser.parse_args()
    engines = args.engines or ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") and not args.quick else [])
    models = [("SmolLM2-135M", smollm2_dir)] + ([] if args.quick else [("Qwen3-0.6B shape", qwen3_06b_dir)])
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    bandwidth = memcpy_bandwidth()
    rows = []
    for name, make in models:
        for dtype in dtypes:
            path = make(dtype)
            for engine in engines:
                for replicas in ([1] if args.quick else [1, 2]):
                    print(f"{name} {dtype} {engine} x{replicas} ...", flush=True)
                    rows.append(one_case(name, path, dtype, engine, replicas, args.syncs))
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps({"memcpy_bytes_per_s": bandwidth, "rows": rows}, indent=1))
    (out / "weight_sync.md").write_text(table(rows, bandwidth))
    print(table(rows, bandwidth))


if __name__ == "__main__":  # vLLM spawns helpers: keep the entry point guarded
    main()
