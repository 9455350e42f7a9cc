"""opd's ``vanilla_opd`` against TRL's ``GKDTrainer``: the same on-policy distillation, side by
side, timed in the same run.

    pip install trl==1.16.0                          # the comparison only (the dev extra has it)
    .venv/bin/python bench/vs_trl.py --steps 12      # 2 rounds, opd (ray), TRL, opd (local); SmolLM2's vocabulary
    .venv/bin/python bench/vs_trl.py --steps 5 --rounds 1 --backends ray   # a quick look
    .venv/bin/python bench/vs_trl.py --vocab recipe  # the recipe's own 320-token toy vocabulary
    .venv/bin/python bench/vs_trl.py --vocab qwen3   # Qwen3's 151,936-row vocabulary
    .venv/bin/python bench/vs_trl.py rollout.episodes_per_step=64          # overrides reach both
    .venv/bin/python bench/vs_trl.py supervision.scoring=sampled losses.0.args.estimator=sampled  # opd's sampled estimator

Vocabulary (``--vocab``): by default both models get SmolLM2's tokenizer (49,152 tokens, shipped
offline with the CPU install), the size of a real model's, where the exact full-vocabulary loss
costs what it costs on real models; the bootstrap then gives the teacher 150 and the student 60
SFT steps. ``--vocab qwen3`` gives both models Qwen3's 151,936 embedding rows over the same tokenizer
(rows no token uses, as Qwen3 pads its 151,669 tokens: ``bootstrap.arch.vocab_size``), so that every
distribution computed is Qwen3's size. ``--vocab recipe`` keeps the recipe's own 320-token tokenizer: a toy in which a step is
about 0.1 s of arithmetic in both frameworks and per-step overhead decides.

What runs: ``recipes/prompt_dataset.yaml`` (the arithmetic prompt dataset, a tiny Qwen3 teacher
and student built once by the cached bootstrap) with opd's ``vanilla_opd`` and the exact
full-vocabulary ``reverse_kl``, which is GKD with lambda = 1 (every sequence the student's own
sample) and beta = 1 (the reverse KL). TRL's ``GKDTrainer`` (``lmbda=1.0``, ``beta=1.0``) loads
the very same two model directories. Both get, from the recipe:

- the same prompts in the same order: step ``s``'s tasks are opd's ``sample_tasks(seed, s)``; TRL
  reads them from a dataset in that order (``train_sampling_strategy="sequential"``), as chat
  messages its collator renders to the same prompt ids (checked, ``prompt_ids_match``; a tokenizer
  whose chat template renders them otherwise, as SmolLM2's adds a default system message, gets
  plain ChatML, ``chat_template_replaced``, and the timing is refused if they still differ);
- the batch (``per_device_train_batch_size`` = ``rollout.episodes_per_step``, one optimizer step
  each, no accumulation), the new-token budget, the sampling temperature, the learning rate
  (constant for both: the bench sets opd's ``trainer.warmup_steps=0`` and
  ``trainer.lr_schedule=constant``), fused AdamW with the same betas, weight decay and gradient
  clip, float32, the seed, and 2 torch threads each (``--threads``);
- no evaluation, checkpoint or trajectory file inside the timed steps. TRL's ``SFTConfig``
  defaults that would handicap it on a CPU are off: ``gradient_checkpointing`` (its generation
  would run without a KV cache) and ``bf16``. Logging, saving and evaluation are off.

Timing: each run is its own process (``opd train`` for opd; this file with ``--trl-worker`` for
TRL), so loading, the bootstrap and TRL's dataset set-up stay outside the steps. opd's step time
is ``time/step_s`` of ``metrics.jsonl`` (rollout, teacher scoring, training and weight sync).
TRL's is the time between two ``on_step_end`` callbacks (the first step from ``on_step_begin``):
fetching and collating the batch, generating, the forwards, the backward and the optimizer step.
Tokens are the trained completion tokens, padding excluded, end token included: opd's
``train_tokens`` and TRL's ``labels != -100`` after generation. Runs alternate A B (C) A B (C)
(``--rounds``); the first ``--warmup`` steps of each run are dropped; the medians pool the rest.
The headline is opd on Ray (``run.backend=ray``, what a user gets); ``local`` is opd in one
process. Target: opd's step throughput at least 2x TRL's.

What the losses optimise (:func:`opd.evaluation.trl_parity.loss_agreement`, also
``tests/integration/test_vs_trl_loss.py``): on one batch (the recipe's first step of prompts) opd's
exact ``reverse_kl`` and ``GKDTrainer.generalized_jsd_loss(beta=1.0)`` are the same per-token mean
of ``KL(pi_S || pi_T)``. Checked before the timing: the losses within 1e-4 and the student's
gradients (reported), and, for the convention, ``beta=0.0`` against opd's ``forward_kl``.

Departure from TRL's defaults, and why: in training, ``Trainer`` hands ``compute_loss`` a
``num_items_in_batch`` counted on the *dataset's* labels (the reference answers, before on-policy
generation replaces them), so TRL's loss is the completion tokens' KL summed over the reference
answers' token count: the same direction, scaled per step by (generated / reference tokens),
which interacts with the gradient clip. The bench sets ``model_accepts_loss_kwargs = False`` on the
trainer so TRL divides by the generated tokens, as opd does; it costs nothing in time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The recipe changes both frameworks share: a constant learning rate, and nothing but training
# in the timed steps (the evaluations before and after training are kept, on 8 held-out tasks).
SHARED_OVERRIDES = ("trainer.warmup_steps=0", "trainer.lr_schedule=constant", "run.eval_every_steps=0",
                    "run.eval_episodes=8", "run.save_every_steps=0", "run.trajectory_every_steps=0")
TOLERANCE = 1e-4  # |opd - TRL| on the loss check
# --vocab smollm2: a real vocabulary for both models, and the bootstrap steps that teach them the task with it.
REAL_VOCAB_OVERRIDES = ("teacher.bootstrap.tokenizer=smollm2", "student.bootstrap.tokenizer=smollm2",
                        "teacher.bootstrap.sft_steps=150", "student.bootstrap.sft_steps=60")
# --vocab qwen3: the same, with Qwen3's 151,936 embedding rows (SmolLM2's 49,152 tokens and rows no token uses, as
# Qwen3 pads its own 151,669): every distribution the loss, the teacher and the sampler compute is Qwen3's size.
QWEN3_VOCAB = 151_936
VOCAB_OVERRIDES = {"smollm2": REAL_VOCAB_OVERRIDES, "recipe": (),
                   "qwen3": (*REAL_VOCAB_OVERRIDES, f"teacher.bootstrap.arch.vocab_size={QWEN3_VOCAB}",
                             f"student.bootstrap.arch.vocab_size={QWEN3_VOCAB}")}
# ChatML as opd renders a first prompt (opd.chat.first_prompt_ids): given to TRL's tokenizer when its
# own template renders the prompts otherwise (SmolLM2's adds a default system message).
PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")


# -- what both frameworks get ---------------------------------------------------------------------
def shared_settings(recipe: str, overrides: list[str], steps: int, threads: int) -> tuple[Any, dict]:
    """The resolved recipe and the settings TRL is given from it: model directories (the bootstrap
    builds them on first use), batch, budget, optimizer, seed and each step's prompts."""
    from opd.algorithms.step import sample_tasks
    from opd.config import load_config
    from opd.envs import EnvFactory
    from opd.bootstrap import resolve_model_path

    cfg = load_config(recipe, [*SHARED_OVERRIDES, *overrides, f"run.total_steps={steps}",
                               f"resources.torch_threads={threads}"])
    terms = [(t.name, t.args.get("estimator")) for t in cfg.losses]
    # full: GKD's exact loss; sampled (with supervision.scoring: sampled): the same reverse KL estimated
    # from the sampled token, opd's choice for a real vocabulary (a row of its own, not GKD's loss).
    if cfg.algorithm != "vanilla_opd" or terms not in ([("reverse_kl", "full")], [("reverse_kl", "sampled")]):
        raise SystemExit("the bench compares vanilla_opd with the one loss reverse_kl (estimator: full, GKD's "
                         f"beta = 1, or sampled); {recipe} with {overrides} has algorithm {cfg.algorithm!r} and "
                         f"losses {terms}")
    if cfg.env.id != "opd/PromptDataset-v0" or cfg.rollout.system_prompt:
        raise SystemExit("TRL's GKDTrainer trains on single-turn prompts: the bench needs env.id "
                         f"opd/PromptDataset-v0 (got {cfg.env.id!r}) and no rollout.system_prompt")
    student_path = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, print)  # the driver's seeds
    teacher_path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print)
    env_factory = EnvFactory.of(cfg.env)
    env = env_factory()
    train_tasks = env.unwrapped.task_ids(cfg.env.train_split)
    step_tasks = [sample_tasks(train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, s, cfg.rollout.group_size)
                  for s in range(1, steps + 1)]
    examples = []
    for tasks in step_tasks:
        for task in tasks:
            prompt, info = env.reset(options={"task": task})
            examples.append({"messages": [{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": str(info.get("expert_action") or "")}]})
    env.close()
    t, r = cfg.trainer, cfg.rollout
    spec = {"opd_estimator": terms[0][1], "student_path": student_path, "teacher_path": teacher_path, "steps": steps, "threads": threads,
            "batch_size": r.episodes_per_step, "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
            "learning_rate": t.learning_rate, "weight_decay": t.weight_decay, "adam_beta1": t.adam_beta1,
            "adam_beta2": t.adam_beta2, "max_grad_norm": t.grad_clip_norm, "seed": cfg.run.seed,
            "examples": examples, "first_step_tasks": step_tasks[0]}
    return cfg, spec


# -- TRL ------------------------------------------------------------------------------------------
def trl_worker(spec_path: Path, out_path: Path) -> None:
    """Train with TRL's GKDTrainer as ``spec`` says; write each step's time and tokens to ``out_path``."""
    spec = json.loads(spec_path.read_text())
    import torch

    torch.set_num_threads(spec["threads"])  # opd's actors get resources.torch_threads, the same number
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    from trl.experimental.utils import DataCollatorForChatML

    from opd.chat import ChatFormat, first_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(spec["student_path"])
    student = AutoModelForCausalLM.from_pretrained(spec["student_path"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher_path"], dtype=torch.float32)
    dataset = Dataset.from_list(spec["examples"])

    # The prompts TRL's collator builds must be the ids opd's rollout conditions on.
    fmt = ChatFormat.from_tokenizer(tokenizer)

    def count_mismatches() -> int:
        collated = DataCollatorForChatML(tokenizer=tokenizer)(spec["examples"][: spec["batch_size"]])
        return sum(ids[mask.bool()].tolist() != first_prompt_ids(fmt, tokenizer, example["messages"][0]["content"])
                   for ids, mask, example in zip(collated["prompts"], collated["prompt_attention_mask"],
                                                 spec["examples"]))

    mismatches, template_replaced = count_mismatches(), False
    if mismatches:  # e.g. SmolLM2's template adds a default system message opd does not send
        tokenizer.chat_template, template_replaced = PLAIN_CHATML, True
        mismatches = count_mismatches()
    if mismatches:
        raise SystemExit(f"TRL's collator renders {mismatches} prompts differently from opd: the timing would "
                         "compare different work")

    class CountingGKDTrainer(GKDTrainer):
        """GKDTrainer unchanged, but for recording each step's completion tokens and phase times."""

        def generate_on_policy_outputs(self, model, inputs, generation_config):
            start = time.perf_counter()
            out = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            self.phase["generation_s"] = time.perf_counter() - start
            return out

        def training_step(self, model, inputs, num_items_in_batch=None):
            start = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            # GKDTrainer.training_step put the generated rows in `inputs`: count what the loss sees.
            self.phase["tokens"] = int((inputs["labels"] != -100).sum())
            # The student's and the teacher's forwards and the backward (generation taken out).
            self.phase["forward_backward_s"] = time.perf_counter() - start - self.phase.get("generation_s", 0.0)
            self.phase["loss"] = float(loss)
            return loss

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.rows: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step_s = now - (self.end[-1] if self.end else self.begin[-1])
            self.end.append(now)
            row = {"step": state.global_step, "step_s": step_s, **trainer.phase}
            row["optimizer_and_rest_s"] = step_s - row.get("generation_s", 0.0) - row.get("forward_backward_s", 0.0)
            self.rows.append(row)
            trainer.phase = {}
            print(f"  trl step {state.global_step}/{spec['steps']}: {step_s:.2f}s, {row.get('tokens', 0)} tokens, "
                  f"loss {row.get('loss', float('nan')):.3f}", flush=True)

    args = GKDConfig(
        output_dir=str(out_path.parent / "trl_output"), max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=spec["weight_decay"], adam_beta1=spec["adam_beta1"], adam_beta2=spec["adam_beta2"],
        max_grad_norm=spec["max_grad_norm"], optim="adamw_torch_fused",
        lmbda=1.0, beta=1.0, temperature=spec["temperature"], max_new_tokens=spec["max_new_tokens"],
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=spec["seed"],
        train_sampling_strategy="sequential", dataloader_num_workers=0,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    timer = StepTimes()
    trainer = CountingGKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                 processing_class=tokenizer, callbacks=[timer])
    trainer.phase = {}
    default_normaliser = "reference-answer tokens" if trainer.model_accepts_loss_kwargs else "generated tokens"
    trainer.model_accepts_loss_kwargs = False  # divide by the generated tokens, as opd does (module docstring)
    start = time.perf_counter()
    trainer.train()
    out_path.write_text(json.dumps({
        "rows": timer.rows, "train_wall_s": time.perf_counter() - start, "trl_version": trl.__version__,
        "prompt_ids_match": mismatches == 0, "prompt_mismatches": mismatches,
        "chat_template_replaced": template_replaced,
        "eos_token_id": trainer.generation_config.eos_token_id, "im_end_id": fmt.im_end_id,
        "trl_default_normaliser": default_normaliser, "torch_threads": torch.get_num_threads(),
    }, indent=2))


def run_trl(spec: dict, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    out = run_dir / "steps.json"
    _run([sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(run_dir / "spec.json"), str(out)], "TRL")
    return json.loads(out.read_text())


# -- opd ------------------------------------------------------------------------------------------
def run_opd(recipe: str, overrides: list[str], steps: int, threads: int, backend: str, run_dir: Path) -> dict:
    """``opd train`` in its own process; each step's time, trained tokens and phase times."""
    script = Path(sys.executable).with_name("opd")  # the console script a user runs
    opd = [str(script)] if script.is_file() else [sys.executable, "-c", "import sys; from opd.cli import main; "
                                                                         "sys.exit(main(sys.argv[1:]))"]
    command = [*opd, "train", recipe, *SHARED_OVERRIDES, *overrides, f"run.total_steps={steps}",
               f"resources.torch_threads={threads}", f"run.backend={backend}", f"run.output_dir={run_dir}"]
    _run(command, f"opd ({backend})")
    from opd.evaluation.run_dir import RunDir

    rows = [{"step": r["step"], "step_s": r["time/step_s"], "tokens": int(r["train_tokens"]),
             "generation_s": r["time/generation_s"], "teacher_scoring_s": r["time/teacher_scoring_s"],
             "training_s": r["time/training_s"], "weight_sync_s": r["time/weight_sync_s"]} for r in RunDir(run_dir).steps()]
    return {"rows": rows}


def _run(command: list[str], what: str) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
    if subprocess.run(command, cwd=ROOT, env=env).returncode != 0:
        raise SystemExit(f"the {what} run failed: {' '.join(command)}")


# -- the loss check -------------------------------------------------------------------------------
# -- the report -----------------------------------------------------------------------------------
def summarise(runs: list[dict], warmup: int) -> dict:
    """One framework's runs (one per round): medians over the steps after each run's warm-up."""
    kept = [row for run in runs for row in run["rows"][warmup:]]
    if not kept:
        raise SystemExit(f"no step left after dropping {warmup} warm-up steps per run: raise --steps")
    step_s = [r["step_s"] for r in kept]
    phases = sorted({k for r in kept for k in r if k.endswith("_s") and k != "step_s"})
    return {
        "steps_kept": len(kept), "median_step_s": statistics.median(step_s),
        "fastest_step_s": min(step_s),  # on a shared machine, what the step costs when nothing else runs
        "median_tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in kept),
        "tokens_per_step": statistics.fmean(r["tokens"] for r in kept),
        "round_median_step_s": [statistics.median(r["step_s"] for r in run["rows"][warmup:]) for run in runs],
        "median_phase_s": {p: statistics.median(r.get(p, 0.0) for r in kept) for p in phases},
    }


def markdown(result: dict) -> str:
    s, lc = result["summary"], result["loss_check"]
    trl = s["trl"]
    lines = [
        f"opd vanilla_opd vs TRL {result['trl_version']} GKDTrainer (lmbda=1, beta=1), {result['steps']} steps x "
        f"{result['rounds']} rounds, first {result['warmup']} steps of each run dropped; batch {result['batch_size']}, "
        f"max_new_tokens {result['max_new_tokens']}, {result['threads']} torch threads; opd's reverse KL estimator: "
        f"{result.get('opd_estimator', 'full')}" + ("" if result.get("opd_estimator", "full") == "full" else
                                                    " (the same objective from the sampled token: not GKD's exact loss)"),
        "",
        "| framework | median step (s) | median tokens/s | tokens/step | step throughput vs TRL | tokens/s vs TRL "
        "| fastest step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in s.items():
        lines.append(f"| {name} | {row['median_step_s']:.3f} | {row['median_tokens_per_s']:.0f} | "
                     f"{row['tokens_per_step']:.1f} | {trl['median_step_s'] / row['median_step_s']:.2f}x | "
                     f"{row['median_tokens_per_s'] / trl['median_tokens_per_s']:.2f}x | {row['fastest_step_s']:.3f} |")
    lines += ["", "Median phase times per step (s):", ""]
    for name, row in s.items():
        lines.append(f"- {name}: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in row["median_phase_s"].items())
                     + "; per round, median step " + ", ".join(f"{v:.3f}" for v in row["round_median_step_s"]))
    headline = s["opd (ray)"] if "opd (ray)" in s else next(v for k, v in s.items() if k != "trl")
    ratio = trl["median_step_s"] / headline["median_step_s"]
    lines += [
        "",
        f"- **opd / TRL step throughput: {ratio:.2f}x** (target >= 2x: {'met' if ratio >= 2 else 'NOT met'})",
        f"- loss check on {lc['rows']} rows, {lc['tokens']} completion tokens: opd reverse_kl (full) "
        f"{lc['opd_loss']:.6f}, TRL generalized_jsd_loss(beta=1) {lc['trl_loss']:.6f}, |diff| {lc['abs_diff']:.2e} "
        f"({'<' if lc['abs_diff'] < TOLERANCE else '>='} {TOLERANCE:g}); student gradients max |diff| "
        f"{lc['grad_max_abs_diff']:.2e} (max |grad| {lc['grad_max_abs']:.2e}); teacher logprobs max |diff| "
        f"{lc['teacher_max_abs_diff']:.2e}; beta=0: TRL {lc['trl_beta0']:.6f} = opd forward_kl "
        f"{lc['opd_forward_kl']:.6f}",
        f"- TRL's prompts equal opd's prompt ids: {result['trl_checks']['prompt_ids_match']}; TRL stops at id "
        f"{result['trl_checks']['eos_token_id']} (<|im_end|> is {result['trl_checks']['im_end_id']}); TRL's own "
        f"normaliser would be the {result['trl_checks']['trl_default_normaliser']} (the bench divides by the "
        "generated ones)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "prompt_dataset.yaml"))
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of runs in the order opd (ray), TRL, opd (local)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each framework's processes")
    parser.add_argument("--backends", default="ray,local", help="opd backends to time, comma-separated; the first "
                        "is the headline")
    parser.add_argument("--vocab", choices=tuple(VOCAB_OVERRIDES), default="smollm2",
                        help="both models' vocabulary: SmolLM2's 49,152 tokens, Qwen3's 151,936 rows (SmolLM2's "
                        "tokenizer, the rows padded), or the recipe's own (a toy)")
    parser.add_argument("--out", default="runs/bench_vs_trl")
    parser.add_argument("overrides", nargs="*", help="key=value for opd's recipe, read by both, e.g. "
                        "rollout.episodes_per_step=64")
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    args.overrides = [*VOCAB_OVERRIDES[args.vocab], *args.overrides]
    if args.rounds < 1 or args.steps <= args.warmup or not set(backends) <= {"ray", "local"} or not backends:
        parser.error("need --rounds >= 1, --steps > --warmup and --backends among ray,local")
    args.recipe = str(Path(args.recipe).resolve())  # the runs start in the repository root
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass --out to a new directory")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from opd.cli import _quiet_libraries

    _quiet_libraries()  # the runs' processes inherit it
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    cfg, spec = shared_settings(args.recipe, args.overrides, args.steps, args.threads)
    print(f"models: student {spec['student_path']}, teacher {spec['teacher_path']}", flush=True)
    from opd.algorithms.step import step_seed
    from opd.envs import EnvFactory
    from opd.evaluation.trl_parity import loss_agreement

    check = loss_agreement(spec["student_path"], spec["teacher_path"], EnvFactory.of(cfg.env), spec["first_step_tasks"],
                           max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                           teacher_view=cfg.supervision.teacher_view, seed=step_seed(cfg, 1))
    print(f"loss check: opd {check['opd_loss']:.6f}, TRL {check['trl_loss']:.6f}, |diff| {check['abs_diff']:.2e}",
          flush=True)

    runs: dict[str, list[dict]] = {f"opd ({b})": [] for b in backends} | {"trl": []}
    order = [f"opd ({backends[0]})", "trl", *(f"opd ({b})" for b in backends[1:])]
    trl_checks: dict = {}
    for k in range(args.rounds):
        for name in order:
            print(f"round {k + 1}/{args.rounds}: {name}, {args.steps} steps", flush=True)
            run_dir = out / f"{name.replace(' ', '').replace('(', '_').replace(')', '')}_{k}"
            if name == "trl":
                run = run_trl(spec, run_dir)
                trl_checks = {key: v for key, v in run.items() if key not in ("rows",)}
            else:
                run = run_opd(args.recipe, args.overrides, args.steps, args.threads, name[5:-1], run_dir)
            runs[name].append(run)
            kept = [r["step_s"] for r in run["rows"][args.warmup:]]
            print(f"round {k + 1}/{args.rounds}: {name} median step {statistics.median(kept):.3f}s", flush=True)

    summary = {name: summarise(r, args.warmup) for name, r in runs.items()}
    result = {
        "recipe": args.recipe, "vocab": args.vocab, "overrides": args.overrides, "steps": args.steps, "rounds": args.rounds,
        "warmup": args.warmup, "threads": args.threads, "batch_size": spec["batch_size"],
        "max_new_tokens": spec["max_new_tokens"], "trl_version": trl_checks.get("trl_version"),
        "student_path": spec["student_path"], "teacher_path": spec["teacher_path"],
        "summary": summary, "loss_check": check, "trl_checks": trl_checks,
        "opd_estimator": spec["opd_estimator"],
        "runs": {name: [r["rows"] for r in rs] for name, rs in runs.items()},
    }
    (out / "vs_trl.json").write_text(json.dumps(result, indent=2, default=str))
    table = markdown(result)
    (out / "vs_trl.md").write_text(table)
    print(table)
    if check["abs_diff"] >= TOLERANCE:
        raise SystemExit(f"the losses disagree: |opd - TRL| = {check['abs_diff']:.2e} >= {TOLERANCE:g}")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-worker":
        trl_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
