"""The driver loop: setup -> evaluate -> (step, log, evaluate, checkpoint)* -> summary.

Everything a run writes lives in ``run.output_dir``:

- ``config.yaml``: the resolved config; ``trajectories/``: every evaluation episode as text;
  ``metrics.jsonl``: one JSON line per step and per
  evaluation; ``tb/``: tensorboard events; ``checkpoints/step_N/``: see
  :mod:`opd.training.checkpoint`; ``summary.json`` and ``report.png`` at the end.

Resume (``opd train RECIPE --resume``) loads the newest complete checkpoint: DeepSpeed state
into the trainer, its weights into the rollout engine, and the driver's counters. Task
sampling and generation seeds are pure functions of (seed, step), so the resumed run continues
exactly where the interrupted one would have been.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from opd.config import ConfigError, to_yaml
from opd.training.checkpoint import atomic_write_text, latest_checkpoint, save_checkpoint


class RunError(RuntimeError):
    """A run that must stop; the message says why and what was kept."""


class MetricsLog:
    """``metrics.jsonl`` plus tensorboard. On resume, lines past the checkpoint are dropped so
    the file reads as one uninterrupted run."""

    def __init__(self, run_dir: Path, keep_until_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if keep_until_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _line_step(line) <= keep_until_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        elif keep_until_step is None and self.path.exists():
            # A fresh start in a directory whose earlier run never reached a checkpoint: keep
            # that run's log beside the new one rather than deleting it.
            self.path.rename(self.path.with_name(f"metrics.{int(time.time())}.jsonl"))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(key, value, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 10**12  # an unreadable (half-written) line is dropped


def train(cfg: Any, resume: bool = False, console: Any = None) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to ``summary.json``)."""
    from opd.algorithms import get_algorithm
    from opd.algorithms.base import RunContext
    from opd.chat import ChatFormat
    from opd.envs import EnvFactory
    from opd.evaluation.heldout import evaluate
    from opd.evaluation.report import Progress, render_summary, write_report_plot
    from opd.models import TokenizerMismatchError, check_tokenizers_match, load_tokenizer
    from opd.provisioning import resolve_model_path
    from opd.rollout.vanilla import EpisodeSettings
    from opd.runtime.actors import init_ray, spawn_workers

    log = console.log if console is not None else print
    run_dir = Path(cfg.run.output_dir)
    found = latest_checkpoint(run_dir)
    if found and not resume:
        raise RunError(
            f"{run_dir} already holds checkpoint {found[0].name}; pass --resume to continue that run, "
            f"or set run.output_dir to a new directory (nothing was changed)."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))

    setup_start = time.perf_counter()
    student_path = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, log)
    teacher_path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, log)
    student_tok = load_tokenizer(student_path, cfg.student.trust_remote_code)
    teacher_tok = load_tokenizer(teacher_path, cfg.teacher.trust_remote_code)
    try:
        check_tokenizers_match(student_tok, teacher_tok)
    except TokenizerMismatchError as exc:
        if not cfg.supervision.cross_tokenizer:
            raise ConfigError(f"keys 'student.path' ({student_path}) and 'teacher.path' ({teacher_path}): {exc} "
                              "Or set supervision.cross_tokenizer: true to align the two over text spans.") from None
        log(f"cross-tokenizer scoring (the tokenizers differ: {'; '.join(exc.problems)[:300]})")
    else:
        if cfg.supervision.cross_tokenizer:
            log("supervision.cross_tokenizer is set but the tokenizers match: scoring re-tokenises anyway")
    fmt = ChatFormat.from_tokenizer(student_tok)
    env_factory = EnvFactory(cfg.env.id, dict(cfg.env.kwargs), cfg.env.module)
    probe = env_factory()
    train_tasks = probe.unwrapped.task_ids(cfg.env.train_split)
    eval_tasks = probe.unwrapped.task_ids(cfg.env.eval_split)[: cfg.run.eval_episodes]
    probe.close()

    init_ray(cfg.resources)
    workers = spawn_workers(cfg, student_path, teacher_path)
    settings = dict(max_new_tokens=cfg.rollout.max_new_tokens, max_context_tokens=cfg.rollout.max_context_tokens,
                    system_prompt=cfg.rollout.system_prompt, env_isolation=cfg.env.isolation,
                    env_timeout_s=cfg.env.timeout_s)
    ctx = RunContext(cfg, workers, env_factory, train_tasks, eval_tasks,
                     EpisodeSettings(temperature=cfg.rollout.temperature, **settings),
                     EpisodeSettings(temperature=0.0, history=cfg.run.eval_history, **settings), fmt)
    algorithm = get_algorithm(cfg.algorithm)

    state: dict[str, Any] = {"step": 0, "train_time_s": 0.0, "evals": []}
    if found:
        path, state = found
        workers.load_checkpoint(str(path))
        workers.sync_weights()
        log(f"resumed from {path} (step {state['step']})")
    metrics = MetricsLog(run_dir, keep_until_step=state["step"] if found else None)
    log(f"setup took {time.perf_counter() - setup_start:.1f}s; run directory: {run_dir}")

    if not found:
        record = {**evaluate(ctx, "teacher"), **evaluate(ctx, "student")}
        state["teacher_success"] = record["eval/teacher_success"]
        state["student_success_before"] = record["eval/student_success"]
        state["evals"].append({"step": 0, **record})
        metrics.write(0, record)
        log(f"before training: teacher success {record['eval/teacher_success']:.2f}, "
            f"student success {record['eval/student_success']:.2f} on {len(eval_tasks)} held-out tasks")

    nonfinite_streak = 0
    progress = Progress(console, total=cfg.run.total_steps, start=state["step"])
    try:
        for step in range(state["step"] + 1, cfg.run.total_steps + 1):
            step_metrics = algorithm.train_step(ctx, step)
            state["train_time_s"] += step_metrics["time/step_s"]
            state["step"] = step
            nonfinite_streak = nonfinite_streak + 1 if step_metrics.get("nonfinite_loss") else 0
            if cfg.run.eval_every_steps and step % cfg.run.eval_every_steps == 0 and step < cfg.run.total_steps:
                record = evaluate(ctx, "student", step)
                step_metrics.update(record)
                state["evals"].append({"step": step, **record})
            metrics.write(step, step_metrics)
            progress.update(step, step_metrics)
            if nonfinite_streak >= cfg.trainer.max_nonfinite_steps:
                last = latest_checkpoint(run_dir)
                raise RunError(
                    f"the loss was NaN or infinite for {nonfinite_streak} steps in a row (up to step {step}); "
                    f"those micro-batches were skipped. Last complete checkpoint: "
                    f"{last[0] if last else 'none'}. Lower trainer.learning_rate or check the losses' inputs."
                )
            last_step = step == cfg.run.total_steps
            if last_step or (cfg.run.save_every_steps and step % cfg.run.save_every_steps == 0):
                if last_step:
                    record = evaluate(ctx, "student", step)
                    state["student_success_after"] = record["eval/student_success"]
                    state["evals"].append({"step": step, **record})
                    metrics.write(step, record)
                save_checkpoint(run_dir, step, workers.save_checkpoint, state, keep=cfg.run.keep_checkpoints)
    finally:
        progress.close()
        metrics.close()

    summary = {
        "teacher_success": state.get("teacher_success"),
        "student_success_before": state.get("student_success_before"),
        "student_success_after": state.get("student_success_after"),
        "steps": state["step"],
        "train_time_s": state["train_time_s"],
        "eval_episodes": len(eval_tasks),
        "run_dir": str(run_dir),
        "time_split": _time_split(run_dir / "metrics.jsonl"),
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    write_report_plot(run_dir)
    render_summary(console, summary, cfg)
    return summary


def _time_split(path: Path) -> dict[str, float]:
    keys = ("time/generation_s", "time/teacher_scoring_s", "time/training_s", "time/weight_sync_s", "time/step_s")
    totals = {k: 0.0 for k in keys}
    steps = 0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "time/step_s" in record:
            steps += 1
            for k in keys:
                totals[k] += record.get(k, 0.0)
    return {k.split("/")[1].removesuffix("_s") + "_s_per_step": v / max(steps, 1) for k, v in totals.items()}
