"""The driver loop: setup -> evaluate -> (step, log, evaluate, checkpoint)* -> summary.

Everything a run writes lives in ``run.output_dir``:

- ``config.yaml``: the resolved config; ``trajectories/``: every evaluation episode and a sample
  of the training episodes, token by token (:mod:`opd.evaluation.trajectories`);
  ``metrics.jsonl``: one JSON line per step and per
  evaluation; ``tb/``: tensorboard events; ``checkpoints/step_N/``: see
  :mod:`opd.training.checkpoint`; ``summary.json`` and ``report.png`` at the end.

Resume (``opd train RECIPE --resume``) loads the newest checkpoint that verifies (its files
match the sizes and hashes recorded at save time, its pickles hold only tensors and allowed data
classes): DeepSpeed state into the trainer, its weights into the rollout engine, and the driver's
counters. A checkpoint that fails verification is moved aside to ``checkpoints/rejected-step_N``
(kept, never deleted) and the next older one is tried. A recipe that differs from the run's
``config.yaml`` in anything but :data:`RESUMABLE_KEYS` is refused, listing the differences. Task
sampling and generation seeds are pure functions of (seed, step), so the resumed run continues
exactly where the interrupted one would have been.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from opd.config import ConfigError, flatten, to_yaml
from opd.runtime.errors import RunError, WorkerError
from opd.runtime.tracking import Trackers, require_backends
from opd.training.checkpoint import (CheckpointError, atomic_write_text, complete_checkpoints, latest_checkpoint,
                                     save_checkpoint, verified_checkpoints)
from opd.training.trainer import peak_rss_mb

__all__ = ["RESUMABLE_KEYS", "MetricsLog", "RunError", "recipe_changes", "train"]

# What a resumed run may change: how long it goes on, how often it evaluates and saves, where it
# writes, and how long a call may take. Anything else would make the resumed run a different one.
RESUMABLE_KEYS = ("run.total_steps", "run.eval_every_steps", "run.save_every_steps", "run.keep_checkpoints",
                  "run.output_dir", "run.trajectory_every_steps", "run.trajectory_episodes",
                  "resources.actor_timeout_s", "logging.wandb_project", "logging.wandb_mode", "logging.mlflow",
                  "run.backend",  # the same run on Ray or in one process (resume a step under pdb)
                  "run.async_steps",  # overlap or not: the resumed step rolls out with the checkpoint's weights either way
                  "run.max_restarts", "resources.placement_timeout_s", "run.teacher_check", "run.sampling_check",
                  # replicas change where the work runs, not its result (the trainer's ZeRO shards
                  # are checked against its rank count when they are loaded)
                  "resources.teacher_replicas", "resources.rollout_replicas", "resources.trainer_ranks")


class MetricsLog:
    """``metrics.jsonl`` plus :class:`~opd.runtime.tracking.Trackers` (tensorboard; wandb and
    MLflow when the recipe asks). On resume, lines past the checkpoint are dropped so the file
    reads as one uninterrupted run, and the trackers continue the same runs."""

    def __init__(self, run_dir: Path, keep_until_step: int | None, cfg: Any, log: Any = print):
        self.path = run_dir / "metrics.jsonl"
        if keep_until_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _line_step(line) <= keep_until_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        elif keep_until_step is None and self.path.exists():
            # A fresh start in a directory whose earlier run never reached a checkpoint: keep
            # that run's log beside the new one rather than deleting it.
            self.path.rename(self.path.with_name(f"metrics.{int(time.time())}.jsonl"))
        self.trackers = Trackers(run_dir, cfg, resumed_step=keep_until_step, log=log)

    def write(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")
        self.trackers.log(step, record)

    def close(self, summary: dict[str, Any] | None = None, failed: bool = False) -> None:
        self.trackers.close(summary, failed=failed)


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 10**12  # an unreadable (half-written) line is dropped


def train(cfg: Any, resume: bool = False, console: Any = None) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to ``summary.json``).

    An actor whose process dies (killed, out of memory, its node lost) ends that attempt; the run
    then ends every role's actors and starts them again from the last complete checkpoint (a
    resume, with its exact metrics and weights), up to ``run.max_restarts`` times. An exception
    raised inside an actor (a bug, a NaN policy) or a hung call is not retried: it would recur.
    """
    log = console.log if console is not None else print
    spawned: dict[str, Any] = {}
    restarts = 0
    try:
        while True:
            try:
                return _train_once(cfg, resume, console, spawned)
            except WorkerError as exc:
                if exc.kind != "died":
                    raise
                if restarts >= cfg.run.max_restarts:
                    exc.add_note(f"no restart left (run.max_restarts={cfg.run.max_restarts})" if restarts == 0 else
                                 f"after {restarts} restart(s), run.max_restarts={cfg.run.max_restarts}")
                    raise
                restarts += 1
                last = complete_checkpoints(Path(cfg.run.output_dir))
                log(f"[yellow]{exc}[/]; restarting every role from "
                    f"{last[-1].name if last else 'the beginning (no checkpoint yet)'} "
                    f"(restart {restarts} of {cfg.run.max_restarts}, run.max_restarts)")
                if spawned.get("workers") is not None:
                    spawned.pop("workers").shutdown()
                resume = True
    finally:  # the run's actors and their reservations end with it, whatever the outcome
        if spawned.get("workers") is not None:
            spawned.pop("workers").shutdown()


def _train_once(cfg: Any, resume: bool, console: Any, spawned: dict[str, Any]) -> dict[str, Any]:
    """One attempt of :func:`train`; the Ray workers it starts go in ``spawned["workers"]``."""
    from opd.algorithms import get_algorithm
    from opd.algorithms.base import RunContext, StepRollouts
    from opd.chat import ChatFormat
    from opd.envs import EnvFactory
    from opd.evaluation.heldout import check_sampling, check_teacher, evaluate
    from opd.evaluation.trajectories import RunEpisodes
    from opd.evaluation.report import Progress, render_summary, write_report_plot
    from opd.models import TokenizerMismatchError, check_tokenizers_match, load_tokenizer
    from opd.provisioning import resolve_model_path
    from opd.rollout.vanilla import episode_settings
    from opd.runtime.actors import spawn_workers
    from opd.runtime.cluster import init_ray
    from opd.runtime.local import spawn_local_workers

    log = console.log if console is not None else print
    run_dir = Path(cfg.run.output_dir)
    existing = complete_checkpoints(run_dir)
    if existing and not resume:
        raise RunError(
            f"{run_dir} already holds checkpoint {existing[-1].name}; pass --resume to continue that run, "
            f"or set run.output_dir to a new directory (nothing was changed)."
        )
    if resume and (run_dir / "config.yaml").is_file():
        changes = [c for c in recipe_changes((run_dir / "config.yaml").read_text(), cfg) if c[0] not in RESUMABLE_KEYS]
        if changes:
            listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes[:12])
            raise RunError(
                f"the recipe differs from the one {run_dir} was trained with ({run_dir / 'config.yaml'}) in "
                f"{len(changes)} key(s): {listed}. A resumed run may change only {', '.join(RESUMABLE_KEYS)}; "
                "run the changed recipe in a new run.output_dir (nothing was changed).", resumable=False
            )
    require_backends(cfg)  # a recipe asking for an absent wandb / mlflow fails now, not after setup
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

    placement: dict[str, list[dict[str, str]]] = {}  # the node of each role's actors (Ray only)
    if cfg.run.backend == "local":  # the same roles in this process, without Ray (opd.runtime.local)
        workers = spawn_local_workers(cfg, student_path, teacher_path)
    else:
        init_ray(cfg.resources)
        workers = spawned["workers"] = spawn_workers(cfg, student_path, teacher_path)
        placement = workers.placement()
        if len({n["node_id"] for nodes in placement.values() for n in nodes}) > 1:
            log("roles on nodes: " + "; ".join(
                f"{role} on " + ", ".join(f"{n['node_ip']} ({n['node_id'][:8]})" for n in nodes)
                for role, nodes in placement.items()))
    ctx = RunContext(cfg, workers, env_factory, train_tasks, eval_tasks,
                     episode_settings(cfg, cfg.rollout.temperature), episode_settings(cfg, 0.0, cfg.run.eval_history), fmt,
                     RunEpisodes(run_dir, {"student": student_tok, "teacher": teacher_tok},
                                 cfg.run.trajectory_every_steps, cfg.run.trajectory_episodes),
                     StepRollouts(cfg.run.async_steps, cfg.run.total_steps))
    algorithm = get_algorithm(cfg.algorithm)

    state: dict[str, Any] = {"step": 0, "train_time_s": 0.0, "evals": []}
    found = _resume(run_dir, workers, log) if resume else None
    if found:
        path, state = found
        workers.sync_weights()
        log(f"resumed from {path} (step {state['step']})")
    elif resume:
        log(f"{run_dir} holds no complete checkpoint: starting from the beginning")
    metrics = MetricsLog(run_dir, keep_until_step=state["step"] if found else None, cfg=cfg, log=log)
    log(f"setup took {time.perf_counter() - setup_start:.1f}s; run directory: {run_dir}")
    if cfg.run.async_steps:
        log(_pipelining_note(cfg))

    if not found:
        record = {**evaluate(ctx, "teacher"), **evaluate(ctx, "student")}
        state["teacher_success"] = record["eval/teacher_success"]
        state["student_success_before"] = record["eval/student_success"]
        state["evals"].append({"step": 0, **record})
        metrics.write(0, record)
        log(f"before training: teacher success {record['eval/teacher_success']:.2f}, "
            f"student success {record['eval/student_success']:.2f} on {len(eval_tasks)} held-out tasks")
        if algorithm.uses_teacher and cfg.run.teacher_check != "ignore":
            check = check_teacher(record["eval/teacher_success"], record["eval/student_success"], len(eval_tasks))
            state["teacher_check"] = check.as_dict()
            if not check.teacher_better:
                _warn_or_stop(check.message(), "run.teacher_check", cfg.run.teacher_check, log)

    nonfinite_streak = 0
    progress = Progress(console, total=cfg.run.total_steps, start=state["step"])
    step = state["step"]
    finished = False
    try:
        for step in range(state["step"] + 1, cfg.run.total_steps + 1):
            tracked = _reset_peak_rss()
            step_metrics = algorithm.train_step(ctx, step)
            if tracked:
                step_metrics["memory/driver_peak_rss_mb"] = peak_rss_mb()
            step_metrics["time/trajectory_write_s"] = ctx.episodes.take_seconds()
            state["train_time_s"] += step_metrics["time/step_s"]
            state["step"] = step
            nonfinite_streak = nonfinite_streak + 1 if step_metrics.get("nonfinite_loss") else 0
            greedy_valid = state["evals"][0].get("eval/student_valid_action_rate") if step == 1 else None
            if greedy_valid is not None and cfg.run.sampling_check != "ignore" and "valid_action_rate" in step_metrics:
                check = check_sampling(greedy_valid, step_metrics["valid_action_rate"], cfg.rollout.temperature)
                state["sampling_check"] = check.as_dict()
                if not check.sampling_ok:
                    _warn_or_stop(check.message(algorithm.uses_teacher), "run.sampling_check", cfg.run.sampling_check, log)
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
        finished = True
    except Exception as exc:
        exc.add_note(f"during training step {step} (steps done: {state['step']})")
        raise
    finally:
        progress.close()
        if not finished:  # an error or Ctrl-C: the wandb / MLflow runs end as failed
            metrics.close(failed=True)

    summary = {
        "teacher_success": state.get("teacher_success"),
        "student_success_before": state.get("student_success_before"),
        "student_success_after": state.get("student_success_after"),
        "steps": state["step"],
        "train_time_s": state["train_time_s"],
        "eval_episodes": len(eval_tasks),
        **({"teacher_check": state["teacher_check"]} if state.get("teacher_check") else {}),
        **({"sampling_check": state["sampling_check"]} if state.get("sampling_check") else {}),
        "heldout": _heldout_figures(state["evals"]),
        "run_dir": str(run_dir),
        "time_split": _time_split(run_dir / "metrics.jsonl"),
        **({"placement": placement} if placement else {}),
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    metrics.close(summary)
    write_report_plot(run_dir)
    render_summary(console, summary, cfg)
    return summary


def _warn_or_stop(message: str, key: str, setting: str, log: Callable[[str], None]) -> None:
    """A failed pre-flight check: stop the run (``key: error``) or warn on the console."""
    if setting == "error":
        raise RunError(f"{message} ({key}: error)")
    log(f"[bold yellow]warning:[/] {message}")


def _heldout_figures(evals: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The held-out figures besides success (mean return, turns and what the environment
    reports: score, value, questions asked, ...) of the teacher, the student before training
    and the student at the last evaluation."""
    def of(record: dict[str, Any], who: str) -> dict[str, float]:
        prefix = f"eval/{who}_"
        return {k[len(prefix):]: v for k, v in record.items()
                if k.startswith(prefix) and not k.endswith(("_time_s", "_success"))}

    first = next((e for e in evals if e.get("step") == 0), None)
    last = next((e for e in reversed(evals) if e.get("step", 0) > 0 and "eval/student_success" in e), None)
    out = {}
    if first is not None:
        out["teacher"], out["student_before"] = of(first, "teacher"), of(first, "student")
    if last is not None:
        out["student_after"] = of(last, "student")
    return {k: v for k, v in out.items() if v}


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (Linux: ``/proc/self/clear_refs``), so that
    :func:`~opd.training.trainer.peak_rss_mb` gives the peak since; False where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pipelining_note(cfg: Any) -> str:
    """What ``run.async_steps: 1`` will do with this recipe's placement (docs/performance.md)."""
    if cfg.run.backend == "local":
        return ("run.async_steps: 1 on the local backend: the same steps and staleness as on Ray, played one after "
                "another (nothing overlaps in one process)")
    res = cfg.resources
    if res.rollout_gpus > 0 and (res.teacher_gpus > 0 or res.trainer_gpus > 0):
        return "run.async_steps: 1: each step's rollout overlaps the previous step's scoring and training"
    return ("[yellow]run.async_steps: 1 with the roles sharing the CPU cores[/]: the overlapped rollout competes with "
            "scoring and training for them. Give the roles a share each (resources.torch_threads about half the "
            "cores): on 2 cores the quickstart ran 0.39x the serial loop's speed at 2 threads each, 1.28x at 1 "
            "(docs/performance.md); the gain is for a rollout with a GPU of its own")


def _resume(run_dir: Path, workers: Any, log: Any) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint that verifies into the workers; move the ones that do not
    aside (``rejected-step_N``), saying why. None when the directory holds no checkpoint."""
    rejected = []
    for path, state, reason in verified_checkpoints(run_dir):
        if state is None:
            aside = path.with_name(f"rejected-{path.name}")
            if aside.exists():  # rejected once before: keep both
                aside = path.with_name(f"rejected-{path.name}-{int(time.time())}")
            path.rename(aside)
            rejected.append(f"{path.name}: {reason}")
            log(f"[yellow]skipped checkpoint {path.name}[/]: {reason}; moved to {aside.name}")
            continue
        try:
            workers.load_checkpoint(str(path))
        except WorkerError as exc:
            if isinstance(exc.cause, CheckpointError):
                raise RunError(f"checkpoint {path} was refused: {exc.cause}. Nothing was loaded or changed.",
                               resumable=False) from None
            raise
        return path, state
    if rejected:
        raise RunError(f"no checkpoint in {run_dir / 'checkpoints'} verifies ({'; '.join(rejected)}); they were moved "
                       "aside as rejected-step_N. Start the run afresh in a new run.output_dir.", resumable=False)
    return None


def recipe_changes(old_yaml: str, cfg: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every leaf where ``cfg`` differs from a saved ``config.yaml``."""
    from omegaconf import OmegaConf

    old = flatten(OmegaConf.to_container(OmegaConf.create(old_yaml), resolve=True))
    new = flatten(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)), resolve=True))
    return [(key, old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


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
