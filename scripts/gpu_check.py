"""The GPU check: every figure opd needs from a CUDA GPU, in one run of a few minutes, on a machine
with only torch and transformers (no Ray, no vLLM, no DeepSpeed).

    python scripts/gpu_check.py --out gpu_check                 # a CUDA GPU: about 5 minutes on one H200
    python scripts/gpu_check.py --allow-cpu --quick --out DIR   # CI: the same code on CPU, tiny sizes

Set-up on a bare GPU machine (torch with CUDA and transformers already there)::

    pip install --no-deps -e .                                  # the project, without its declared extras
    pip install --no-deps -r scripts/gpu_check-requirements.txt # small pure-Python packages

It runs three parts (four where DeepSpeed is installed), each timed, and writes ``OUT/gpu_check.json`` (one object: the device, the
versions, which optional packages were absent, then each part's figures or its error):

1. **quickstart**: ``opd train`` of the quickstart recipe on the local backend with
   ``trainer.engine: torch`` (:mod:`opd.runtime.local`, :mod:`opd.training.torch_engine`): the
   student's rollouts, the teacher's scoring and the training on CUDA in this one process. Per-step
   time split, held-out success before and after, CUDA memory peak.
2. **actfirst**: ``bench/actfirst_vs_vanilla.py`` on the same backend: vanilla OPD and ActFirst-OPD
   for the same number of updates with the HF engine. Its point on a GPU is ActFirst's premise
   (``S_ideal``): a wide decode step costs about what a narrow one does, so ActFirst's fewer,
   wider steps make the rollout faster; on two CPU cores a step's cost grows with its rows and
   the premise does not hold (``docs/actfirst.md``). Reported: both decode-step costs and widths,
   the rollout and wall-clock ratios, and ``S_ideal``.
3. **mfu**: one optimizer step of the real trainer (torch engine, bfloat16 autocast on CUDA) on a
   SmolLM2-135M-shaped model with random weights over packed multi-turn rows, FLOPs counted as
   ``bench/mfu.py`` counts them, against the ``torch.mm`` peak of the same dtype measured in the
   same run (median of ``--repeats`` steps).
4. **deepspeed_zero**, only where DeepSpeed is installed: the DeepSpeed trainer at ZeRO 0 and 3
   (NCCL), two steps each, and a weight sync whose result equals the trainer's weights.

A part that fails is recorded with its error and the others still run; the exit code is 1 if
any failed. ``--allow-cpu`` lets it run without a GPU (float32, the tiny recipes of the test
suite with ``--quick``): CI runs it that way, so the script is known to work the day a GPU is
lent (``tests/e2e/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("ray", "deepspeed", "vllm", "pyarrow", "datasets", "matplotlib", "tensorboard", "pandas", "psutil")


def _present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # refused, or a module whose spec is None
        return False


def _cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def quickstart(args, work: Path) -> dict:
    """The recipe's first steps on the local backend with the torch engine, in this process."""
    import torch

    from opd.cli import main as opd_main
    from opd.evaluation.run_dir import RunDir

    run_dir = work / "quickstart"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    overrides = [f"run.output_dir={run_dir}", "run.backend=local", "trainer.engine=torch",
                 f"run.total_steps={args.steps}", f"run.save_every_steps={args.steps}", "run.eval_every_steps=0",
                 f"run.eval_episodes={args.eval_episodes}", *_cache(args)]
    start = time.perf_counter()
    code = opd_main(["train", args.recipe, *overrides])
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"opd train exited {code} (see {run_dir / 'error.log'})")
    run = RunDir(run_dir)
    steps, summary = run.steps(), run.summary()
    split = {k: statistics.median(r[k] for r in steps) for k in steps[0] if k.startswith("time/")}
    return {
        "recipe": args.recipe, "steps": len(steps), "wall_s": wall,
        "losses": [r["loss"] for r in steps], "losses_finite": all(r["loss"] == r["loss"] for r in steps),
        "median_time_split_s": split, "teacher_success": summary["teacher_success"],
        "student_success_before": summary["student_success_before"],
        "student_success_after": summary["student_success_after"],
        "cuda_peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "checkpoint_state": sorted(p.name for p in (run_dir / "checkpoints" / f"step_{args.steps}").iterdir()),
    }


def actfirst(args, work: Path) -> dict:
    """``bench/actfirst_vs_vanilla.py`` on the local backend with the torch engine."""
    sys.path.insert(0, str(ROOT / "bench"))
    import actfirst_vs_vanilla

    result = actfirst_vs_vanilla.main(["--recipe", args.actfirst_recipe, "--steps", str(args.actfirst_steps),
                                       "--out", str(work / "actfirst"), "run.backend=local", "trainer.engine=torch",
                                       "run.eval_episodes=4", *_cache(args)])
    v, a = result["vanilla"]["per_step"], result["actfirst"]["per_step"]
    return {
        "recipe": args.actfirst_recipe, "updates": args.actfirst_steps,
        "wall_clock_ratio": result["wall_clock_ratio"], "rollout_ratio": result["rollout_ratio"],
        "s_ideal": result["s_ideal"], "decode_step_ms": result["decode_step_ms"],
        "decode_rows_mean": result["decode_rows_mean"],
        # the premise: a step of ActFirst's width costs about a step of vanilla's on a GPU
        "wide_over_narrow_step_cost": result["decode_step_ms"]["actfirst"] / max(result["decode_step_ms"]["vanilla"], 1e-9),
        "ratio_at_narrow_step_cost": result["ratio_at_narrow_step_cost"],
        "step_s": {"vanilla": v["time/step_s"], "actfirst": a["time/step_s"]},
        "generation_s": {"vanilla": v["time/generation_s"], "actfirst": a["time/generation_s"]},
    }


def mfu(args, work: Path) -> dict:
    """The trainer's MFU: one step on a SmolLM2-135M-shaped model against the matmul peak."""
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from mfu import SMOLLM2_135M, episodes, step_flops

    from opd.algorithms.step import build_token_batch
    from opd.chat import ChatFormat
    from opd.models import save_model, train_chat_tokenizer
    from opd.schema import TrainerConfig
    from opd.training.trainer import StudentTrainer, TrainerSpec

    gpu = torch.cuda.is_available()
    dtype = "bfloat16" if gpu else "float32"
    shape = dict(SMOLLM2_135M, num_hidden_layers=args.mfu_layers)
    tokenizer = train_chat_tokenizer(["left right up down", "a b c d e f g"], vocab_size=300)
    torch.manual_seed(0)
    path = work / "mfu_model"
    save_model(LlamaForCausalLM(LlamaConfig(**shape)), tokenizer, path)  # token ids beyond the tokenizer are fine
    fmt = ChatFormat.from_tokenizer(tokenizer)
    trajs, scores = episodes(fmt, args.mfu_rows, tuple(args.mfu_tokens), 0.25, seed=0)
    batch = build_token_batch(trajs, scores, fmt.pad_id, fmt)
    cfg = OmegaConf.structured(TrainerConfig(engine="torch", learning_rate=1e-12, micro_batch_size=args.mfu_rows,
                                             micro_batch_tokens=0))
    trainer = StudentTrainer(TrainerSpec(cfg, (("reverse_kl", 1.0, {}),), str(path), episodes_per_step=args.mfu_rows,
                                         dtype=dtype))
    flops = step_flops(trainer.engine.module, batch, True, cfg.micro_batch_size, cfg.micro_batch_tokens)
    trainer.train_step(batch)  # warm-up
    times = []
    for _ in range(args.repeats):
        _cuda_sync()
        start = time.perf_counter()
        trainer.train_step(batch)
        _cuda_sync()
        times.append(time.perf_counter() - start)
    peak = matmul_peak(torch.bfloat16 if gpu else torch.float32, args.peak_size)
    step_s = statistics.median(times)
    return {"dtype": dtype, "layers": args.mfu_layers, "rows": args.mfu_rows, "tokens": flops["tokens"],
            "step_s": step_s, "step_times_s": times, "tokens_per_s": flops["tokens"] / step_s,
            "gflop_per_step": flops["flops"] / 1e9, "achieved_tflops": flops["flops"] / step_s / 1e12,
            "peak_tflops": peak / 1e12, "mfu": flops["flops"] / step_s / peak}


def matmul_peak(dtype, size: int, repeats: int = 5) -> float:
    """Best FLOP/s of ``torch.mm`` of two ``size`` square matrices of ``dtype`` on the device."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        _cuda_sync()
        start = time.perf_counter()
        torch.mm(a, b)
        _cuda_sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def deepspeed_zero(args, work: Path) -> dict:
    """Where DeepSpeed is installed: two reverse-KL steps of the DeepSpeed trainer at ZeRO stages
    0 and 3 (NCCL on a GPU) on a tiny model, each followed by a weight sync into an HF engine
    whose weights must then equal the trainer's."""
    import torch
    from omegaconf import OmegaConf

    from opd.algorithms.step import build_token_batch
    from opd.chat import ChatFormat
    from opd.envs import EnvFactory
    from opd.generation.hf import HFEngine
    from opd.models import save_model, tiny_qwen3, train_chat_tokenizer
    from opd.rollout.vanilla import EpisodeSettings, run_episodes
    from opd.schema import TinyArchConfig, TrainerConfig
    from opd.supervision.teacher_view import score_trajectories
    from opd.training.trainer import StudentTrainer, TrainerSpec

    factory = EnvFactory("opd/FrozenLakeText-v0", {"n_train_tasks": 64, "n_eval_tasks": 8})
    env = factory()
    tasks = env.unwrapped.task_ids("train")[:16]
    corpus = ["left down right up", "<think> plan </think>"] + [env.reset(options={"task": t})[0] for t in tasks]
    tokenizer = train_chat_tokenizer(corpus, vocab_size=300)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    arch = TinyArchConfig(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256)
    save_model(tiny_qwen3(tokenizer, arch, seed=0), tokenizer, work / "ds_student")
    save_model(tiny_qwen3(tokenizer, arch, seed=1), tokenizer, work / "ds_teacher")
    student, teacher = HFEngine.from_pretrained(str(work / "ds_student")), HFEngine.from_pretrained(str(work / "ds_teacher"))
    trajs = run_episodes(student, factory, tasks, tokenizer, fmt, EpisodeSettings(max_new_tokens=6), seed=0)
    batch = build_token_batch(trajs, score_trajectories(teacher, trajs, "state_grounded", fmt), fmt.pad_id, fmt)
    out = {}
    for stage in (0, 3):
        cfg = OmegaConf.structured(TrainerConfig(learning_rate=1e-3, zero_stage=stage, micro_batch_size=8))
        trainer = StudentTrainer(TrainerSpec(cfg, (("reverse_kl", 1.0, {}),), str(work / "ds_student"),
                                             episodes_per_step=16, total_steps=2))
        losses = [trainer.train_step(batch)["loss"] for _ in range(2)]
        student.update_weights(trainer.export_weights())
        served, trained = student.state_dict(), trainer.export_weights()
        out[f"zero{stage}"] = {"losses": losses, "trainer_device": str(trainer.engine.device),
                               "weights_equal_after_sync": all(torch.equal(served[k].cpu(), trained[k]) for k in trained)}
        student.update_weights(HFEngine.from_pretrained(str(work / "ds_student")).state_dict())
        del trainer
    return out


def _imported_distributions() -> dict[str, str]:
    """name -> version of every installed distribution this run imported (what a bare machine needs)."""
    import importlib.metadata as metadata

    owners = metadata.packages_distributions()
    names = {dist for module in list(sys.modules) for dist in owners.get(module.split(".")[0], [])
             if sys.modules.get(module) is not None}
    return {name: metadata.version(name) for name in sorted(names)}


def _cache(args) -> list[str]:
    if not args.cache:
        return []
    return [f"student.bootstrap.cache_dir={args.cache}", f"teacher.bootstrap.cache_dir={args.cache}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check", help="where gpu_check.json and the runs go")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a CUDA GPU (float32; CI)")
    parser.add_argument("--quick", action="store_true", help="the test suite's tiny recipes and sizes")
    parser.add_argument("--cache", default="", help="bootstrap cache directory (default: the recipes')")
    parser.add_argument("--parts", default="quickstart,actfirst,mfu,deepspeed_zero",
                        help="comma-separated; deepspeed_zero runs only where DeepSpeed is installed")
    args = parser.parse_args(argv)
    quick = args.quick
    args.recipe = str(ROOT / ("tests/data/tiny.yaml" if quick else "recipes/quickstart.yaml"))
    args.steps, args.eval_episodes = (2, 4) if quick else (20, 100)
    args.actfirst_recipe = str(ROOT / ("tests/data/actfirst_tiny.yaml" if quick else "recipes/actfirst_frozenlake.yaml"))
    args.actfirst_steps = 1 if quick else 5
    args.mfu_layers, args.mfu_rows, args.mfu_tokens = (2, 2, (64, 128)) if quick else (30, 16, (768, 1536))
    args.repeats, args.peak_size = (2, 512) if quick else (5, 8192)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); pass --allow-cpu to run the same "
              "code on CPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="runs-", dir=out))
    report: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "absent": [name for name in OPTIONAL if not _present(name)], "quick": quick, "parts": {},
    }
    failed = False
    parts = {"quickstart": quickstart, "actfirst": actfirst, "mfu": mfu, "deepspeed_zero": deepspeed_zero}
    for name in args.parts.split(","):
        if name == "deepspeed_zero" and not _present("deepspeed"):
            report["parts"][name] = {"ok": None, "skipped": "DeepSpeed is not installed"}
            continue
        print(f"gpu_check: {name}...", flush=True)
        start = time.perf_counter()
        try:
            figures = parts[name](args, work)
            report["parts"][name] = {"ok": True, "seconds": time.perf_counter() - start, **figures}
        except Exception as exc:  # noqa: BLE001 -- recorded, and the other parts still run
            failed = True
            report["parts"][name] = {"ok": False, "seconds": time.perf_counter() - start,
                                     "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(f"gpu_check: {name} {'done' if report['parts'][name]['ok'] else 'FAILED'} in "
              f"{report['parts'][name]['seconds']:.0f}s", flush=True)
    report["imported_distributions"] = _imported_distributions()
    path = out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"gpu_check: {'a part failed' if failed else 'every part passed'}; figures in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
