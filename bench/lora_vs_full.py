"""A LoRA student against the full fine-tune on the real pretrained student: SmolLM2-135M-Instruct
on SQL (the SmolLM2 study's setup, ``recipes/studies/sql_smollm2.yaml``, and the same with
``student.lora`` of rank 16, ``recipes/studies/sql_smollm2_lora.yaml``), one run each, one
after the other on this machine.

    .venv/bin/python bench/lora_vs_full.py                  # about an hour on 2 idle cores (and the
                                                            # teacher's build once, 13 minutes)
    .venv/bin/python bench/lora_vs_full.py --seeds 0 1 2    # three seeds each
    .venv/bin/python bench/lora_vs_full.py --seeds 0 1 2 --students lora   # more seeds of LoRA alone

Per run, from its own files: the trainer's peak resident memory (``memory/trainer_peak_rss_mb``,
the largest over the steps), the final checkpoint's size (the engine's state, and the whole
directory), the weight sync's time and bytes per step (``time/weight_sync_s``,
``weight_sync_mb``), the median step time, and held-out success before and after
(``summary.json``: all 179 held-out questions, greedy). For the LoRA run, ``opd export`` and the
round trip: the merged model (transformers) and the adapter directory (peft, on the base)
against the trainer restored from the same checkpoint, the max logprob difference over a few
held-out prompts. Results: ``<out>/lora_vs_full.json`` and ``lora_vs_full.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"full fine-tune": "recipes/studies/sql_smollm2.yaml", "LoRA rank 16": "recipes/studies/sql_smollm2_lora.yaml"}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def kind_of(name: str) -> str:
    """``full`` or ``lora``: the first word of a run's name."""
    return name.split()[0].lower()


def run_dir_of(name: str, seed: int, out: Path) -> Path:
    return out / f"{kind_of(name)}-seed{seed}"


def run_one(name: str, recipe: str, seed: int, out: Path) -> dict:
    run_dir = run_dir_of(name, seed, out)
    if not (run_dir / "summary.json").is_file():
        start = time.perf_counter()
        cmd = [str(ROOT / ".venv" / "bin" / "opd"), "train", str(ROOT / recipe), f"run.output_dir={run_dir}",
               f"run.seed={seed}"]
        subprocess.run(cmd, check=True, cwd=ROOT)
        wall = time.perf_counter() - start
    else:
        wall = float("nan")  # an earlier invocation's run: its figures are read again
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "time/step_s" in line]
    summary = json.loads((run_dir / "summary.json").read_text())
    final = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    state = final / ("torch" if (final / "torch").is_dir() else "ds")
    return {
        "name": name, "seed": seed, "run_dir": str(run_dir), "wall_s": wall, "steps": len(steps),
        "trainer_peak_rss_mb": max(s["memory/trainer_peak_rss_mb"] for s in steps),
        "checkpoint_state_mb": dir_bytes(state) / 2**20, "checkpoint_mb": dir_bytes(final) / 2**20,
        "weight_sync_s": statistics.mean(s["time/weight_sync_s"] for s in steps),
        "weight_sync_mb": statistics.mean(s.get("weight_sync_mb", float("nan")) for s in steps),
        "step_s": statistics.median(s["time/step_s"] for s in steps),
        "training_s": statistics.median(s["time/training_s"] for s in steps),
        "success_before": summary.get("student_success_before"), "success_after": summary.get("student_success_after"),
        "teacher_success": summary.get("teacher_success"),
    }


def export_round_trip(run_dir: Path, out: Path) -> dict:
    """``opd export`` of the LoRA run, then the merged model, the adapters on the base, and the
    trainer restored from the checkpoint, on the same held-out prompts: max logprob difference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from opd.config import load_config
    from opd.models import load_model, load_tokenizer
    from opd.training.trainer import StudentTrainer, TrainerSpec, token_logprobs
    from opd.trajectory import TokenBatch

    exported = out / f"{run_dir.name}-export"
    if not exported.is_dir():
        subprocess.run([str(ROOT / ".venv" / "bin" / "opd"), "export", str(run_dir), str(exported)], check=True)
    cfg = load_config(str(run_dir / "config.yaml"), [])
    base_dir = json.loads((exported / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    tokenizer = load_tokenizer(str(exported))
    texts = ["How many customers live in Lyon?", "List the names of products that cost more than 20.",
             "SELECT COUNT(*) FROM orders WHERE status = 'shipped'"]
    rows = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [1.0] * len(ids),
                     "turn_index": [0] * len(ids)})
    batch = TokenBatch.from_rows(rows, tokenizer.pad_token_id or 0)
    trainer = StudentTrainer(TrainerSpec(cfg.trainer, (("reverse_kl", 1.0, {}),), base_dir,
                                         episodes_per_step=cfg.rollout.episodes_per_step, lora=cfg.student.lora))
    final = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    trainer.load_checkpoint(str(final))
    mask = batch.attention_mask_BT.bool()
    with torch.no_grad():
        want = token_logprobs(trainer.engine.module.eval(), batch)
        merged = token_logprobs(AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval(), batch)
        adapted = token_logprobs(PeftModel.from_pretrained(load_model(base_dir), exported / "adapter").eval(), batch)
        start = token_logprobs(load_model(base_dir).eval(), batch)
    return {"export_dir": str(exported), "merged_vs_trainer": float((merged - want)[mask].abs().max()),
            "peft_vs_trainer": float((adapted - want)[mask].abs().max()),
            "trained_vs_start": float((want - start)[mask].abs().max()),
            "adapter_mb": dir_bytes(exported / "adapter") / 2**20, "merged_mb": dir_bytes(exported) / 2**20
            - dir_bytes(exported / "adapter") / 2**20}


def markdown(result: dict) -> str:
    lines = ["| run | seed | held out before | after | trainer peak RSS MiB | checkpoint (engine state) MiB | "
             "checkpoint (all) MiB | weight sync s | weight sync MiB | median step s | median training s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['name']} | {r['seed']} | {r['success_before']:.1%} | {r['success_after']:.1%} | "
                     f"{r['trainer_peak_rss_mb']:,.0f} | {r['checkpoint_state_mb']:,.1f} | {r['checkpoint_mb']:,.1f} | "
                     f"{r['weight_sync_s']:.2f} | {r['weight_sync_mb']:,.1f} | {r['step_s']:.1f} | {r['training_s']:.1f} |")
    trip = result.get("export")
    if trip:
        lines += ["", f"Export of the LoRA run: the merged model {trip['merged_mb']:,.1f} MiB, the adapter directory "
                  f"{trip['adapter_mb']:,.1f} MiB; max logprob difference against the trainer restored from the "
                  f"checkpoint: merged {trip['merged_vs_trainer']:.2e}, adapters on the base (peft) "
                  f"{trip['peft_vs_trainer']:.2e} (trained against the start: {trip['trained_vs_start']:.2f})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--students", nargs="+", choices=["full", "lora"], default=["full", "lora"],
                        help="the students to train (runs already in --out are reported either way)")
    parser.add_argument("--out", default="runs/bench_lora_vs_full")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_one(name, recipe, seed, out) for seed in args.seeds for name, recipe in RECIPES.items()
            if run_dir_of(name, seed, out).joinpath("summary.json").is_file() or kind_of(name) in args.students]
    lora_runs = [r for r in runs if r["name"].startswith("LoRA")]
    result = {"runs": runs, "export": export_round_trip(Path(lora_runs[0]["run_dir"]), out)}
    (out / "lora_vs_full.json").write_text(json.dumps(result, indent=2))
    (out / "lora_vs_full.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
