"""The driver: a run as a recipe, setup -> preflight -> train -> summarize.

:class:`TrainingRun` is one attempt of a run, in torchtune's shape:

- :meth:`~TrainingRun.setup`: the run directory (and on ``--resume`` the recipe's differences),
  the models (built by the bootstrap where the recipe says), the tokenizer policy, the
  environment's tasks, the roles (Ray actors, or objects in this process with ``run.backend:
  local``), the algorithm's :class:`~opd.algorithms.base.RunContext` and, on resume, the newest
  checkpoint that verifies;
- :meth:`~TrainingRun.preflight`: step 0's held-out evaluation of the teacher and the student,
  and the check that the teacher is better (a resumed run skips both);
- :meth:`~TrainingRun.train`: the algorithm's ``train_step`` up to ``run.total_steps``, with the
  evaluation and checkpoint cadence (:meth:`~TrainingRun.save_checkpoint`);
- :meth:`~TrainingRun.summarize`: ``summary.json``, ``report.png`` and the console's table.

Its state is a :class:`~opd.runtime.run_state.RunState`, which every checkpoint keeps. :func:`train`
runs attempts until one finishes, restarting the roles from the last checkpoint when an actor's
process died.

Everything a run writes lives in ``run.output_dir`` (read back with
:class:`opd.evaluation.run_dir.RunDir`):

- ``config.yaml``: the resolved config; ``trajectories/``: every evaluation episode and a sample
  of the training episodes, token by token (:mod:`opd.evaluation.trajectories`);
  ``metrics.jsonl``: one JSON line per step and per evaluation; ``tb/``: tensorboard events;
  ``checkpoints/step_N/``: see :mod:`opd.training.checkpoint`; ``summary.json`` and
  ``report.png`` at the end.

Resume (``opd train RECIPE --resume``) loads the newest checkpoint that verifies (its files
match the sizes and hashes recorded at save time, its pickles hold only tensors and allowed data
classes): DeepSpeed state into the trainer, its weights into the rollout engine, and the driver's
state. A checkpoint that fails verification is moved aside to ``checkpoints/rejected-step_N``
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

from rich.markup import escape

from opd.algorithms import get_algorithm
from opd.algorithms.base import RunContext, StepRollouts, Workers
from opd.bootstrap import resolve_student_path, resolve_teacher_path
from opd.chat import ChatFormat
from opd.config import ConfigError, flatten, to_yaml
from opd.curriculum import Curriculum
from opd.envs import EnvFactory
from opd.evaluation.heldout import check_sampling, check_teacher, evaluate
from opd.evaluation.report import render_summary, step_status, training_progress, write_report_plot
from opd.evaluation.run_dir import RunDir
from opd.evaluation.trajectories import RunEpisodes
from opd.losses import LossError
from opd.mixture import DEFAULT_TEACHER, TaskMix, by_environment, routes_of
from opd.models import TokenizerMismatchError, check_tokenizers_match, load_tokenizer
from opd.rollout.vanilla import episode_settings
from opd.runtime.errors import RunError, WorkerError
from opd.runtime.preemption import Preempted, Preemption
from opd.runtime.run_lock import RunDirectoryLock
from opd.runtime.run_state import RunState, StateError
from opd.runtime.tracking import MetricsLog, require_backends
from opd.runtime.workers import recipe_loss_terms
from opd.schema import OPDConfig
from opd.training.checkpoint import (CheckpointError, OutOfSpaceError, atomic_write_text, complete_checkpoints,
                                     latest_checkpoint, save_checkpoint, too_little_space, verified_checkpoints)
from opd.training.trainer import peak_rss_mb

__all__ = ["RESUMABLE_KEYS", "RunError", "TrainingRun", "finished_summary", "recipe_changes", "train"]

# What a resumed run may change: how long it goes on, how often it evaluates and saves, where it
# writes, and how long a call may take. Anything else would make the resumed run a different one.
RESUMABLE_KEYS = ("run.total_steps", "run.eval_every_steps", "run.save_every_steps", "run.keep_checkpoints",
                  "run.output_dir", "run.trajectory_every_steps", "run.trajectory_episodes",
                  "resources.actor_timeout_s", "logging.wandb_project", "logging.wandb_mode", "logging.mlflow",
                  "run.backend",  # the same run on Ray or in one process (resume a step under pdb)
                  "run.async_steps",  # overlap or not: the resumed step rolls out with the checkpoint's weights either way
                  "run.max_restarts", "run.preempt_grace_s", "resources.placement_timeout_s", "run.teacher_check",
                  "run.sampling_check",
                  # replicas change where the work runs, not its result (the trainer's ZeRO shards
                  # are checked against its rank count when they are loaded)
                  "resources.teacher_replicas", "resources.rollout_replicas", "resources.trainer_ranks")


def train(cfg: OPDConfig, resume: bool = False, console: Any = None) -> dict[str, Any]:
    """Run the recipe; returns the summary (also written to ``summary.json``).

    An actor whose process dies (killed, out of memory, its node lost) ends that attempt; the run
    then ends every role's actors and starts them again from the last complete checkpoint (a
    resume, with its exact metrics and weights), up to ``run.max_restarts`` times. An exception
    raised inside an actor (a bug, a NaN policy) or a hung call is not retried: it would recur.
    """
    log = console.log if console is not None else print
    if resume and (done := finished_summary(cfg)) is not None:
        log(f"{cfg.run.output_dir} is complete: it trained all {cfg.run.total_steps} steps (run.total_steps) and wrote "
            "summary.json; nothing to do. Raise run.total_steps to train on. Its summary:")
        render_summary(console, done, cfg)
        return done
    chaos = _chaos(cfg, log)
    preemption = Preemption(cfg.run.preempt_grace_s, log)
    preemption.install()
    try:
        with RunDirectoryLock(Path(cfg.run.output_dir), log):  # one driver per run directory
            try:
                return _attempts(cfg, resume, console, preemption, log, chaos)
            finally:
                if chaos is not None:
                    chaos.close()
    finally:
        preemption.uninstall()


def _chaos(cfg: OPDConfig, log: Callable[[str], None]) -> Any:
    """The seeded fault injector of a chaos run (``OPD_CHAOS``, :mod:`opd.runtime.chaos`), or None."""
    from opd.runtime.chaos import ENV_VAR, Chaos, ChaosError

    try:
        chaos = Chaos.from_environment(cfg.run.total_steps, cfg.run.save_every_steps, Path(cfg.run.output_dir), log)
    except ChaosError as exc:
        raise ConfigError(f"{exc}; unset {ENV_VAR} for a run without injected faults") from None
    if chaos is not None and cfg.run.backend != "ray":
        raise ConfigError(f"{ENV_VAR} kills the run's actors: it needs run.backend: ray (the recipe has "
                          f"{cfg.run.backend!r}); unset {ENV_VAR} or set run.backend: ray")
    return chaos


def _attempts(cfg: OPDConfig, resume: bool, console: Any, preemption: Preemption,
              log: Callable[[str], None], chaos: Any = None) -> dict[str, Any]:
    """:func:`train`'s attempts: one, and one more from the last checkpoint after each death of a
    role's actor, up to ``run.max_restarts``."""
    restarts = 0
    while True:
        run = TrainingRun(cfg, resume, console, preemption, chaos)
        run.restarts = restarts
        try:
            run.setup()
            preemption.install()  # again: Ray's core worker put its own SIGTERM handler in when it started
            run.preflight()
            run.train()
            return run.summarize()
        except KeyboardInterrupt:
            if preemption.requested:  # the grace period ran out, or a second signal: the step is abandoned
                raise run.preempted(saved=False) from None
            raise
        except WorkerError as exc:
            if exc.kind != "died":
                raise
            if preemption.requested:  # the signal reached the roles too: nothing to restart for
                raise run.preempted(saved=False) from None
            restarts = _restart_or_raise(exc, cfg, restarts, log)
            resume = True
        finally:  # the attempt's actors and their reservations end with it, whatever the outcome
            run.shutdown()


def _restart_or_raise(exc: WorkerError, cfg: OPDConfig, restarts: int, log: Callable[[str], None]) -> int:
    """After a role's actor died: the restart count with this one, or ``exc`` with a note when
    ``run.max_restarts`` are spent."""
    if restarts >= cfg.run.max_restarts:
        exc.add_note(f"no restart left (run.max_restarts={cfg.run.max_restarts})" if restarts == 0 else
                     f"after {restarts} restart(s), run.max_restarts={cfg.run.max_restarts}")
        raise exc
    restarts += 1
    last = complete_checkpoints(Path(cfg.run.output_dir))
    log(f"[yellow]{escape(str(exc))}[/]; restarting every role from "
        f"{last[-1].name if last else 'the beginning (no checkpoint yet)'} "
        f"(restart {restarts} of {cfg.run.max_restarts}, run.max_restarts)")
    return restarts


def check_recipe_unchanged(cfg: OPDConfig) -> None:
    """A resumed run's recipe may differ from its saved ``config.yaml`` in :data:`RESUMABLE_KEYS` only."""
    run_dir = Path(cfg.run.output_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return
    changes = [c for c in recipe_changes(saved.read_text(), cfg) if c[0] not in RESUMABLE_KEYS]
    if changes:
        listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes[:12])
        raise ConfigError(
            f"the recipe differs from the one {run_dir} was trained with ({saved}) in {len(changes)} key(s): "
            f"{listed}. A resumed run may change only {', '.join(RESUMABLE_KEYS)}; run the changed recipe in a new "
            "run.output_dir (nothing was changed).")


def finished_summary(cfg: OPDConfig) -> dict[str, Any] | None:
    """The run's ``summary.json`` when the run in ``run.output_dir`` has trained all
    ``run.total_steps`` steps (its newest complete checkpoint is of that step): a ``--resume``
    of it has nothing to train, and need not start a worker to say so."""
    run_dir = Path(cfg.run.output_dir)
    check_recipe_unchanged(cfg)
    last = complete_checkpoints(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not last or last[-1].name != f"step_{cfg.run.total_steps}" or not isinstance(summary, dict) \
            or summary.get("steps") != cfg.run.total_steps:
        return None
    return summary


class TrainingRun:
    """One attempt of a run: call :meth:`setup`, :meth:`preflight`, :meth:`train`, then
    :meth:`summarize`; :meth:`shutdown` ends the roles whatever happened."""

    def __init__(self, cfg: OPDConfig, resume: bool, console: Any = None, preemption: Preemption | None = None,
                 chaos: Any = None):
        self.cfg, self.resume, self.console = cfg, resume, console
        self.preemption = preemption
        self.chaos = chaos  # a chaos run's fault injector (opd.runtime.chaos)
        self.restarts = 0  # of the roles from a checkpoint by this driver before this attempt
        self.last_save_s = 0.0  # how long the last checkpoint took: a preempted run's estimate
        self.log: Callable[[str], None] = console.log if console is not None else print
        self.run_dir = Path(cfg.run.output_dir)
        self.state = RunState()
        self.resumed = False
        self.workers: Workers | None = None
        self.placement: dict[str, list[dict[str, str]]] = {}  # the node of each role's actors (Ray only)

    # -- setup ----------------------------------------------------------------------------------
    def _prefix_references(self) -> Callable[[list[str]], dict] | None:
        """``tasks -> {task: Reference}`` for a prefix curriculum (``curriculum.prefix_source``):
        built and stored as ActFirst's references of that source, the teacher's played by the
        teacher replicas; None without one."""
        cfg = self.cfg
        if cfg.curriculum.prefix_source == "off":
            return None
        from omegaconf import OmegaConf

        from opd.rollout.references import load_references

        source = OmegaConf.merge(cfg, {"actfirst": {"reference_source": cfg.curriculum.prefix_source}})

        def references(tasks: list[str]) -> dict:
            def teacher_play(part: list[str]) -> list:
                return self.workers.collect("teacher", self.ctx.env_factory, part, self.ctx.eval_settings, cfg.run.seed)[0]

            return load_references(source, self.log, tasks, teacher_play)

        return references

    def setup(self) -> None:
        """Everything before the first evaluation: see the module docstring."""
        self._check_run_dir()
        require_backends(self.cfg)  # a recipe asking for an absent wandb / mlflow fails now, not after setup
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.yaml", to_yaml(self.cfg))
        start = time.perf_counter()
        student_path, teacher_paths, tokenizers = self._models()
        self._check_losses(len(tokenizers["student"]))
        self._check_space(Path(student_path))
        env_factory, train_tasks, eval_tasks = self._tasks()
        self.workers = self._start_workers(student_path, teacher_paths)
        cfg = self.cfg
        self.ctx = RunContext(cfg, self.workers, env_factory, train_tasks, eval_tasks,
                              episode_settings(cfg, cfg.rollout.temperature),
                              episode_settings(cfg, 0.0, cfg.run.eval_history),
                              ChatFormat.from_tokenizer(tokenizers["student"]),
                              RunEpisodes(self.run_dir, tokenizers, cfg.run.trajectory_every_steps,
                                          cfg.run.trajectory_episodes, cfg.run.total_steps),
                              StepRollouts(cfg.run.async_steps, cfg.run.total_steps),
                              Curriculum(cfg, self._prefix_references()),
                              TaskMix(by_environment(train_tasks, str), {str(e.name): float(e.share) for e in cfg.env.mix})
                              if cfg.env.mix else None,
                              routes_of(cfg))
        self.algorithm = get_algorithm(cfg.algorithm)
        if self.resume:
            self._load_checkpoint()
        self.metrics = MetricsLog(self.run_dir, keep_until_step=self.state.step if self.resumed else None, cfg=cfg,
                                  log=self.log)
        self.log(f"setup took {time.perf_counter() - start:.1f}s; run directory: {self.run_dir}")
        if cfg.run.async_steps:
            self.log(_pipelining_note(cfg))

    def _check_run_dir(self) -> None:
        """A fresh run needs a directory without checkpoints; a resumed one, the same recipe."""
        existing = complete_checkpoints(self.run_dir)
        if existing and not self.resume:
            # The user's input, not a failure: a message, no traceback in that run's error.log.
            raise ConfigError(f"{self.run_dir} already holds checkpoint {existing[-1].name}; pass --resume to continue "
                           "that run, or set run.output_dir to a new directory (nothing was changed).")
        if self.resume:
            check_recipe_unchanged(self.cfg)

    def _models(self) -> tuple[str, dict[str, str], dict[str, Any]]:
        """The student's model directory and each teacher model's (by group name,
        :func:`opd.mixture.routes_of`; built first where the recipe says), and the tokenizers,
        which must match unless ``supervision.cross_tokenizer`` aligns them."""
        cfg = self.cfg
        student_path = resolve_student_path(cfg, self.log)
        if cfg.student.lora.rank > 0:
            from opd.training.lora import check_model_dir

            try:
                check_model_dir(student_path, list(cfg.student.lora.target_modules), bool(cfg.student.trust_remote_code))
            except ValueError as exc:
                raise ConfigError(f"{exc} (the student at {student_path})") from None
        tokenizers = {"student": load_tokenizer(student_path, cfg.student.trust_remote_code)}
        teacher_paths = {}
        for name in routes_of(cfg).groups:
            key, section = (name, cfg.teacher) if name == DEFAULT_TEACHER else (f"teachers.{name}", cfg.teachers[name])
            teacher_paths[name] = resolve_teacher_path(cfg, self.log, name)  # a served one's: its tokenizer's
            tokenizer = load_tokenizer(teacher_paths[name], section.trust_remote_code)
            tokenizers.setdefault("teacher", tokenizer)  # the first teacher's (the run's trajectories decode with it)
            self._check_teacher_tokenizer(key, section, student_path, teacher_paths[name], tokenizers["student"],
                                          tokenizer)
        return student_path, teacher_paths, tokenizers

    def _check_teacher_tokenizer(self, key: str, section: Any, student_path: str, teacher_path: str, student_tok: Any,
                                 teacher_tok: Any) -> None:
        """Teacher ``key``'s tokenizer against the student's (and a served one's checks): a
        mismatch stops the run unless ``supervision.cross_tokenizer`` aligns the two."""
        cfg = self.cfg
        served = section.engine == "server"  # teacher_path: its tokenizer's, the student's if its path is ""
        try:
            check_tokenizers_match(student_tok, teacher_tok)
            if served:
                self._check_server(section, key, teacher_tok)
        except TokenizerMismatchError as exc:
            if not cfg.supervision.cross_tokenizer:
                keys = (f"key '{key}.server' ({', '.join(section.server.urls)}) and 'student.path' ({student_path})"
                        if served and teacher_path == student_path else
                        f"keys 'student.path' ({student_path}) and '{key}.path' ({teacher_path})")
                raise ConfigError(f"{keys}: {exc} Or set supervision.cross_tokenizer: true to align the two over "
                                  "text spans" + (f" ({key}.path then names the server's tokenizer)." if served else ".")
                                  ) from None
            if served and teacher_path == student_path:
                raise ConfigError(f"key '{key}.path' is empty, so opd renders the served teacher's view with the "
                                  f"student's tokenizer, which differs from the server's: {exc} With "
                                  f"supervision.cross_tokenizer, set {key}.path to the served model's tokenizer "
                                  "(its hub id or a directory).") from None
            self.log(f"cross-tokenizer scoring{f' ({key})' if key != 'teacher' else ''} (the tokenizers differ: "
                     f"{escape('; '.join(exc.problems)[:300])})")
            if served:
                self._check_server(section, key, teacher_tok)
        else:
            if cfg.supervision.cross_tokenizer:
                self.log("supervision.cross_tokenizer is set but the tokenizers match: scoring re-tokenises anyway")

    def _check_server(self, section: Any, key: str, tokenizer) -> None:
        """A served teacher's checks (:func:`opd.generation.server.check_server`) against the
        tokenizer opd renders its view with; a failure stops the run before any role starts."""
        from opd.generation.server import ServerError, ServerSpec, check_server

        cfg = self.cfg
        spec = ServerSpec.of(section.server)
        try:
            info = check_server(spec, tokenizer, key=f"{key}.server")
        except ServerError as exc:
            raise ConfigError(f"{key}.engine: server: {exc}") from None
        agree = (f"; {len(spec.urls)} replicas agree within {info['replica_difference']:.2g}"
                 if len(spec.urls) > 1 else "")
        self.log(f"{key} served at {', '.join(spec.urls)} ({spec.model}, max_model_len {info['max_model_len']}): "
                 f"it answers and tokenizes as {section.path or 'the student'} does{agree} "
                 f"({info['seconds']:.1f}s)")
        if 0 < info["max_model_len"] <= cfg.rollout.max_context_tokens:
            self.log(f"[yellow]warning[/]: the teacher server's max_model_len ({info['max_model_len']}) is not above "
                     f"rollout.max_context_tokens ({cfg.rollout.max_context_tokens}): a teacher sequence that long "
                     "(plus the one token a completion needs) will be refused. Serve it with a larger --max-model-len, "
                     "or lower rollout.max_context_tokens.")

    def _check_losses(self, vocab_size: int) -> None:
        """Each loss of the recipe, once, on a probe batch (:mod:`opd.training.loss_check`): a loss
        that raises stops the run now, not after the workers start and the evaluation runs."""
        from opd.training.loss_check import check_losses

        cfg = self.cfg
        try:
            check_losses(vocab_size, list(recipe_loss_terms(cfg)), cfg.supervision.scoring, cfg.supervision.top_k,
                         cfg.algorithm)
        except LossError as exc:
            raise RunError(str(exc), resumable=False) from exc

    def _check_space(self, student_dir: Path) -> None:
        """Room for one checkpoint in the run directory, before any role starts (the estimate of
        :func:`~opd.training.checkpoint.estimated_checkpoint_bytes`)."""
        problem = too_little_space(self.run_dir, student_dir)
        if problem:
            raise RunError(problem, resumable=False)

    def _tasks(self) -> tuple[EnvFactory, list[str], list[str]]:
        """The environment's factory, its train tasks and the held-out tasks evaluated."""
        env_factory = EnvFactory.of(self.cfg.env)
        probe = env_factory()
        try:
            train_tasks = probe.unwrapped.task_ids(self.cfg.env.train_split)
            # a mix's lists interleave its environments: the first eval_episodes hold each about equally
            eval_tasks = probe.unwrapped.task_ids(self.cfg.env.eval_split)[: self.cfg.run.eval_episodes]
        finally:
            probe.close()
        return env_factory, train_tasks, eval_tasks

    def _start_workers(self, student_path: str, teacher_path: dict[str, str]) -> Workers:
        """The roles: Ray actors, or with ``run.backend: local`` objects in this process."""
        if self.cfg.run.backend == "local":
            from opd.runtime.local import spawn_local_workers

            return spawn_local_workers(self.cfg, student_path, teacher_path)
        from opd.runtime.actors import spawn_workers
        from opd.runtime.cluster import init_ray

        init_ray(self.cfg.resources)
        self.workers = workers = spawn_workers(self.cfg, student_path, teacher_path)
        if self.chaos is not None:
            self.chaos.attach(workers)
        self.placement = workers.placement()
        if len({n["node_id"] for nodes in self.placement.values() for n in nodes}) > 1:
            self.log("roles on nodes: " + "; ".join(
                f"{role} on " + ", ".join(f"{n['node_ip']} ({n['node_id'][:8]})" for n in nodes)
                for role, nodes in self.placement.items()))
        return workers

    def _load_checkpoint(self) -> None:
        """The newest checkpoint that verifies, into the workers and :attr:`state`; the ones that
        do not are moved aside (``rejected-step_N``), saying why."""
        rejected = []
        for path, state, reason in verified_checkpoints(self.run_dir):
            if state is None:
                aside = path.with_name(f"rejected-{path.name}")
                if aside.exists():  # rejected once before: keep both
                    aside = path.with_name(f"rejected-{path.name}-{int(time.time())}")
                path.rename(aside)
                rejected.append(f"{path.name}: {reason}")
                self.log(f"[yellow]skipped checkpoint {path.name}[/]: {escape(str(reason))}; moved to {aside.name}")
                continue
            self._resume_from(path, state)
            return
        if rejected:
            raise RunError(f"no checkpoint in {self.run_dir / 'checkpoints'} verifies ({'; '.join(rejected)}); they were "
                           "moved aside as rejected-step_N. Start the run afresh in a new run.output_dir.", resumable=False)
        self.log(f"{self.run_dir} holds no complete checkpoint: starting from the beginning")

    def _resume_from(self, path: Path, state: dict[str, Any]) -> None:
        try:
            self.state = RunState.from_dict(state, str(path))
            self.workers.load_checkpoint(str(path))
        except StateError as exc:
            raise RunError(f"checkpoint {path} was refused: {exc}", resumable=False) from None
        except WorkerError as exc:
            if isinstance(exc.cause, CheckpointError):
                raise RunError(f"checkpoint {path} was refused: {exc.cause}. Nothing was loaded or changed.",
                               resumable=False) from None
            raise
        self.resumed = True
        self.workers.sync_weights()
        self.log(f"resumed from {path} (step {self.state.step})")

    # -- preflight ------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Step 0's held-out evaluation of the teacher and the student, and the teacher check
        (``run.teacher_check``); nothing for a resumed run, whose state has them."""
        if self.resumed:
            return
        record = {**evaluate(self.ctx, "teacher"), **evaluate(self.ctx, "student")}
        self.state.teacher_success = record["eval/teacher_success"]
        self.state.student_success_before = record["eval/student_success"]
        self.state.evals.append({"step": 0, **record})
        self.metrics.write(0, record)
        episodes = len(self.ctx.eval_tasks)
        per_env = [(k.split("/")[1], record.get(f"eval/{k.split('/')[1]}/teacher_success"), v) for k, v in record.items()
                   if k.count("/") == 2 and k.endswith("/student_success")]  # a mix's environments
        self.log(f"before training: teacher success {record['eval/teacher_success']:.2f}, "
                 f"student success {record['eval/student_success']:.2f} on {episodes} held-out tasks"
                 + ("; per environment, teacher / student: " + ", ".join(
                     f"{env} {teacher:.2f} / {student:.2f}" for env, teacher, student in per_env) if per_env else ""))
        if self.algorithm.uses_teacher and self.cfg.run.teacher_check != "ignore":
            check = check_teacher(record["eval/teacher_success"], record["eval/student_success"], episodes)
            self.state.teacher_check = check.as_dict()
            if not check.teacher_better:
                _warn_or_stop(check.message(), "run.teacher_check", self.cfg.run.teacher_check, self.log)

    # -- train ----------------------------------------------------------------------------------
    def train(self) -> None:
        """The steps from the state's up to ``run.total_steps``: each logged, evaluated and
        checkpointed at the recipe's cadence. A failure names the step it happened in."""
        progress = training_progress(self.log, self.cfg.run.total_steps, self.state.step)
        nonfinite_streak, step, finished = 0, self.state.step, False
        try:
            for step in range(self.state.step + 1, self.cfg.run.total_steps + 1):
                if self._stop_requested():  # SIGTERM before this step (during the evaluation, or a save)
                    raise self.preempted(saved=self._save_for_preemption(step - 1))
                metrics = self._step(step)
                nonfinite_streak = nonfinite_streak + 1 if metrics.get("nonfinite_loss") else 0
                self._check_sampling(step, metrics)
                if self.cfg.run.eval_every_steps and step % self.cfg.run.eval_every_steps == 0 \
                        and step < self.cfg.run.total_steps:
                    metrics.update(self._evaluate_student(step))
                self.metrics.write(step, metrics)
                progress.advance(step, step_status(metrics, progress.status_width))
                if nonfinite_streak >= self.cfg.trainer.max_nonfinite_steps:
                    self._stop_nonfinite(step, nonfinite_streak)
                self.save_checkpoint(step)
                if self._stop_requested() and step < self.cfg.run.total_steps:
                    raise self.preempted(saved=self._save_for_preemption(step))
            finished = True
        except Exception as exc:
            exc.add_note(f"during training step {step} (steps done: {self.state.step})")
            raise
        finally:
            progress.close()
            if not finished:  # an error or Ctrl-C: the wandb / MLflow runs end as failed
                self.metrics.close(failed=True)

    def _stop_requested(self) -> bool:
        return self.preemption is not None and self.preemption.requested

    def _save_for_preemption(self, step: int) -> bool:
        """A checkpoint of ``step`` (the state now) for a preempted run, if it has none yet and the
        grace period leaves time for one (half again the last save's time, and a second); whether
        the run's state at ``step`` is now in a complete checkpoint."""
        if step <= 0:
            return False
        if any(path.name == f"step_{step}" for path in complete_checkpoints(self.run_dir)):
            return True
        if self.preemption.left_s() < 1.5 * self.last_save_s + 1.0:
            self.log(f"[yellow]no time to save step {step}[/]: {max(self.preemption.left_s(), 0):.0f} s of "
                     f"run.preempt_grace_s left, a checkpoint took {self.last_save_s:.0f} s")
            return False
        self.save_checkpoint(step, force=True)
        return True

    def preempted(self, saved: bool) -> Preempted:
        """What a run stopped by SIGTERM says: the checkpoint it saved, or the last complete one."""
        last = latest_checkpoint(self.run_dir) if self.run_dir.is_dir() else None
        where = f"checkpoint {last[0]}" if last else "no checkpoint"
        if saved:
            what = f"saved {where} (step {self.state.step})"
        elif self.preemption is not None and self.preemption.abandoned:
            what = (f"the step under way did not finish within run.preempt_grace_s ({self.cfg.run.preempt_grace_s:g} s) "
                    f"and was abandoned; the last complete checkpoint is intact: {where}")
        else:
            what = f"nothing saved since the last complete checkpoint: {where}"
        return Preempted(f"stopped on SIGTERM after {self.state.step} of {self.cfg.run.total_steps} steps: {what}; "
                         "every role was ended")

    def _step(self, step: int) -> dict[str, float]:
        """The algorithm's step ``step``, with the driver's own figures; the state counts it."""
        tracked = _reset_peak_rss()
        metrics = self.algorithm.train_step(self.ctx, step)
        if tracked:
            metrics["memory/driver_peak_rss_mb"] = peak_rss_mb()
        metrics["time/trajectory_write_s"] = self.ctx.episodes.take_seconds()
        self.state.train_time_s += metrics["time/step_s"]
        self.state.step = step
        return metrics

    def _check_sampling(self, step: int, metrics: dict[str, float]) -> None:
        """After step 1: were its sampled actions valid about as often as greedy play's at step 0
        (``run.sampling_check``)?"""
        greedy_valid = self.state.evals[0].get("eval/student_valid_action_rate") if step == 1 else None
        if greedy_valid is None or self.cfg.run.sampling_check == "ignore" or "valid_action_rate" not in metrics:
            return
        check = check_sampling(greedy_valid, metrics["valid_action_rate"], self.cfg.rollout.temperature)
        self.state.sampling_check = check.as_dict()
        if not check.sampling_ok:
            _warn_or_stop(check.message(self.algorithm.uses_teacher), "run.sampling_check", self.cfg.run.sampling_check,
                          self.log)

    def _evaluate_student(self, step: int) -> dict[str, float]:
        record = evaluate(self.ctx, "student", step)
        self.state.evals.append({"step": step, **record})
        return record

    def _stop_nonfinite(self, step: int, streak: int) -> None:
        last = latest_checkpoint(self.run_dir)
        raise RunError(
            f"the loss was NaN or infinite for {streak} steps in a row (up to step {step}); those micro-batches were "
            f"skipped. Last complete checkpoint: {last[0] if last else 'none'}. Lower trainer.learning_rate or check "
            "the losses' inputs.")

    def save_checkpoint(self, step: int, force: bool = False) -> None:
        """At the recipe's cadence (``run.save_every_steps``), after the last step, whose
        held-out evaluation comes first, and when ``force``d (a preempted run): the trainer's
        state, its HF export and :attr:`state`."""
        last_step = step == self.cfg.run.total_steps
        if not (force or last_step or (self.cfg.run.save_every_steps and step % self.cfg.run.save_every_steps == 0)):
            return
        start = time.perf_counter()
        if last_step:
            record = self._evaluate_student(step)
            self.state.student_success_after = record["eval/student_success"]
            self.metrics.write(step, record)
        try:
            save_checkpoint(self.run_dir, step, self.workers.save_checkpoint, self.state.to_dict(),
                            keep=self.cfg.run.keep_checkpoints)
        except OutOfSpaceError as exc:
            raise RunError(str(exc)) from exc
        self.last_save_s = time.perf_counter() - start

    # -- summarize ------------------------------------------------------------------------------
    def summarize(self) -> dict[str, Any]:
        """``summary.json`` from the state and the metrics, the trackers closed with it,
        ``report.png``, and the table on the console."""
        state = self.state
        summary = {
            "teacher_success": state.teacher_success,
            "student_success_before": state.student_success_before,
            "student_success_after": state.student_success_after,
            "steps": state.step,
            "train_time_s": state.train_time_s,
            "eval_episodes": len(self.ctx.eval_tasks),
            **({"teacher_check": state.teacher_check} if state.teacher_check else {}),
            **({"sampling_check": state.sampling_check} if state.sampling_check else {}),
            "heldout": state.heldout_figures(),
            **({"by_environment": {env: {**figures, "teacher_name": self.ctx.routes.env_teacher.get(env, "")}
                                   for env, figures in by_env.items()}}
               if (by_env := state.by_environment()) else {}),
            "run_dir": str(self.run_dir),
            "time_split": RunDir(self.run_dir).time_split(),
            **({"restarts": self.restarts} if self.restarts else {}),
            **({"placement": self.placement} if self.placement else {}),
        }
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        self.metrics.close(summary)
        write_report_plot(self.run_dir)
        render_summary(self.console, summary, self.cfg)
        return summary

    def shutdown(self) -> None:
        """End the Ray actors and free their reservations (nothing to do on the local backend)."""
        shutdown = getattr(self.workers, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.workers = None


def _warn_or_stop(message: str, key: str, setting: str, log: Callable[[str], None]) -> None:
    """A failed pre-flight check: stop the run (``key: error``) or warn on the console."""
    if setting == "error":
        raise RunError(f"{message} ({key}: error)")
    log(f"[bold yellow]warning:[/] {escape(message)}")


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (Linux: ``/proc/self/clear_refs``), so that
    :func:`~opd.training.trainer.peak_rss_mb` gives the peak since; False where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pipelining_note(cfg: OPDConfig) -> str:
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


def recipe_changes(old_yaml: str, cfg: OPDConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every leaf where ``cfg`` differs from a saved ``config.yaml``."""
    from omegaconf import OmegaConf

    old = flatten(OmegaConf.to_container(OmegaConf.create(old_yaml), resolve=True))
    new = flatten(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)), resolve=True))
    return [(key, old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
