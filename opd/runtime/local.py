"""``run.backend: local``: the run's three roles in this process, without Ray.

The same algorithms, loop and evaluation as the Ray backend (:mod:`opd.runtime.actors`), over
plain instances of the same classes: :class:`~opd.runtime.workers.TeacherWorker`,
:class:`~opd.runtime.workers.RolloutWorker` and :class:`opd.training.trainer.StudentTrainer`
(DeepSpeed on one rank, its group met in an in-memory store; or, with ``trainer.engine: torch``, plain
PyTorch, so that a machine with only torch and transformers trains). Every call is a Python call, so a
``breakpoint()`` in a loss, an environment or an algorithm stops in the ``opd`` process, and
``python -m pdb $(which opd) train RECIPE run.backend=local`` steps through a whole step. It also
runs where Ray is not installed: nothing on this path imports ``ray``.

What differs from the Ray backend, and why:

- **One interpreter, one thread pool.** The roles take turns (the loop is sequential either
  way), so torch's intra-op threads are set once, to ``resources.torch_threads``; the Ray
  backend's CPU and GPU shares (``resources.*_cpus``, ``*_gpus``, ``num_cpus``) place actors and
  mean nothing here.
- **No time limit on a call.** ``resources.actor_timeout_s`` bounds a wait for another process;
  a call in this process cannot be abandoned midway, so a hang is a hang (Ctrl-C stops it, the
  last checkpoint intact).
- **Weight sync in memory.** The trainer's exported weights go straight to the rollout engine,
  which copies them into its live model in place; no object store, no serialisation.
- **Nothing overlaps.** With ``run.async_steps: 1`` the next step's rollout is played when the
  loop starts it (:meth:`LocalWorkers.collect_later`), on the same weights Ray's rollout actor
  would use while the teacher and trainer work: the same run, without the overlap.
- **Arguments are shared, not copied.** Ray pickles what crosses to an actor; here a role gets
  the caller's objects. The roles treat their inputs as read-only, so results are the same (a
  test compares the first steps of both backends).

An exception raised inside a role becomes a :class:`~opd.runtime.errors.WorkerError` naming the
role and the call, as with Ray, with the original exception chained (``error.log`` has both
tracebacks) and kept as ``cause``.

Example:
    >>> workers = spawn_local_workers(cfg, student_path, teacher_path)  # doctest: +SKIP
    >>> trajs, timing = workers.collect("student", env_factory, tasks, settings, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import time
from bdb import BdbQuit
from dataclasses import dataclass, field
from typing import Any, Callable

from opd.algorithms.base import BatchPlan, Role, Scored
from opd.envs import EnvFactory
from opd.generation.base import TokenScores
from opd.mixture import TeacherRoutes
from opd.process import configure_role_process
from opd.rollout.vanilla import EpisodeSettings
from opd.runtime.errors import RunError, WorkerError
from opd.runtime.workers import RolloutWorker, TeacherWorker, merge_collected, role_specs
from opd.schema import OPDConfig, SupervisionConfig
from opd.training.trainer import StudentTrainer
from opd.trajectory import TokenBatch, Trajectory


@dataclass
class LocalWorkers:
    """The three roles of a run as plain objects behind the :class:`opd.algorithms.base.Workers`
    handle (and the checkpoint calls the driver makes on :class:`~opd.runtime.actors.RayWorkers`)."""

    teacher: TeacherWorker
    rollout: RolloutWorker
    trainer: StudentTrainer
    teachers: dict[str, TeacherWorker] = field(default_factory=dict)  # each teacher model's worker by group
    # name (opd.mixture.TeacherRoutes); empty: `teacher` alone
    routes: TeacherRoutes = field(default_factory=TeacherRoutes.single)

    def __post_init__(self) -> None:
        if not self.teachers:
            self.teachers = {self.routes.groups[0]: self.teacher}

    def _call(self, role: str, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except BdbQuit:  # `q` at a breakpoint: the debugger leaving, not the role failing
            raise
        except Exception as exc:  # a role's failure reads as it does under Ray: role, call, cause
            raise WorkerError(role, f"the {role} failed in {call}: {type(exc).__name__}: {exc}", exc) from exc

    def _host(self, who: Role) -> tuple[str, Any]:
        return ("rollout", self.rollout) if who == "student" else ("teacher", self.teacher)

    def collect(self, who: Role, env_factory: EnvFactory, tasks: list[str], settings: EpisodeSettings,
                seed: int) -> tuple[list[Trajectory], dict[str, float]]:
        if who == "teacher":  # each task played by its environment's teacher
            return merge_collected([self._call("teacher", "collect", self.teachers[group].collect, env_factory, part,
                                               settings, seed, first)
                                    for group, first, part in self.routes.runs(tasks, str)])
        guide = self.teacher if settings.guide_share else None  # curriculum.guide_share (one teacher)
        return self._call("rollout", "collect", self.rollout.collect, env_factory, tasks, settings, seed, 0, guide)

    def collect_later(self, who: Role, env_factory: EnvFactory, tasks: list[str], settings: EpisodeSettings,
                      seed: int) -> "_Done":
        """Played now: one process has nothing to overlap it with, so the pipelined loop runs
        its steps in the same order on the same weights as on Ray, one role after another."""
        return _Done(self.collect(who, env_factory, tasks, settings, seed))

    def score(self, trajs: list[Trajectory], supervision: SupervisionConfig) -> list[TokenScores]:
        """Each trajectory scored by its environment's teacher, in order."""
        return [s for group, _, part in self.routes.runs(trajs)
                for s in self._call("teacher", "score", self.teachers[group].score, part, supervision)]

    def score_for_training(self, trajs: list[Trajectory], supervision: SupervisionConfig) -> Scored:
        whole, light, size = [], [], 0
        for group, _, part in self.routes.runs(trajs):
            scores, (part_light, part_size) = self._call("teacher", "score", self.teachers[group].score_split, part,
                                                         supervision)
            whole.append(scores)
            light += part_light
            size += part_size
        return Scored(light, size, whole)

    def train(self, batch: TokenBatch) -> dict[str, float]:
        return self._call("trainer", "train_step", self.trainer.train_step, batch)

    def train_built(self, plan: BatchPlan) -> dict[str, float]:
        parts = plan.scored.whole if plan.scored is not None else []  # one part per run of one teacher
        return self._call("trainer", "train_step", self.trainer.train_built, plan.build, plan.trajs, plan.args, *parts)

    def sync_weights(self) -> dict[str, float]:
        """Trainer -> rollout engine: the exported weights, copied into the live model in place."""
        start = time.perf_counter()
        weights = self._call("trainer", "export_weights", self.trainer.export_weights, False)  # loaded at once
        load = self._call("rollout", "update_weights", self.rollout.update_weights, weights)
        return {"weight_sync_s": time.perf_counter() - start, "weight_load_s": load["seconds"],
                "weight_sync_mb": load["bytes"] / 2**20}

    def run(self, who: Role, fn: Callable[..., Any], *args: Any) -> Any:
        role, host = self._host(who)
        return self._call(role, getattr(fn, "__name__", "run"), host.run, fn, *args)

    def save_checkpoint(self, directory: str) -> None:
        """The trainer's state and HF export into ``directory`` (see :mod:`opd.training.checkpoint`)."""
        self._call("trainer", "save_checkpoint", self.trainer.save_checkpoint, directory)

    def load_checkpoint(self, directory: str) -> None:
        self._call("trainer", "load_checkpoint", self.trainer.load_checkpoint, directory)


@dataclass
class _Done:
    """A call the local backend has already made (:meth:`LocalWorkers.collect_later`)."""

    value: Any

    def result(self) -> Any:
        return self.value


def spawn_local_workers(cfg: OPDConfig, student_path: str, teacher_path: str) -> LocalWorkers:
    """The teacher, rollout worker and trainer of :func:`opd.runtime.actors.spawn_workers`, built
    in this process with the same arguments.

    Raises:
        RunError: ``trainer.engine`` is ``deepspeed`` and DeepSpeed is not installed.
    """
    if cfg.trainer.engine == "deepspeed":
        try:
            importlib.import_module("deepspeed")
        except ImportError as exc:
            raise RunError(f"trainer.engine: deepspeed, and DeepSpeed cannot be imported here ({exc}): set "
                           "trainer.engine=torch (plain PyTorch, one rank) or pip install deepspeed (on CPU it needs "
                           "no compiler). Ray is not needed.", resumable=False) from None
    specs = role_specs(cfg, student_path, teacher_path)
    # Once for the process: every role runs in it, one after another (each constructor below sets
    # the same count again, as it does in its own actor).
    configure_role_process(specs.threads)
    teachers = {name: TeacherWorker(group.spec) for name, group in specs.teachers.items()}
    teacher_worker, rollout_worker = next(iter(teachers.values())), RolloutWorker(specs.rollout)
    trainer = StudentTrainer(specs.trainer)
    if cfg.supervision.scoring == "hidden":
        trainer.set_teacher_head(teacher_worker.output_head())
    return LocalWorkers(teacher=teacher_worker, rollout=rollout_worker, trainer=trainer, teachers=teachers,
                        routes=specs.routes)
