"""The Ray side of the loop: the worker classes, how they are placed, and weight sync.

``TeacherWorker`` and ``RolloutWorker`` are plain classes; :func:`spawn_workers` hosts them and
:class:`opd.training.trainer.StudentTrainer` as Ray actors with the recipe's CPU/GPU shares, and
returns :class:`RayWorkers`, the :class:`opd.algorithms.base.Workers` handle that algorithms and
the evaluation call (each call a remote call, awaited). On one machine ``ray.init`` starts a
local Ray bound to loopback; with ``RAY_ADDRESS`` set the same code joins that cluster. Without
Ray, a plain ``TeacherWorker`` plays in this process (:func:`local_teacher_player`).

Weight sync: the trainer puts its full weights into the Ray object store once
(``export_weights``), the rollout worker copies them into its live model in place. On one
machine the object store is shared memory; across nodes Ray moves the bytes.

Example:
    >>> workers = spawn_workers(cfg, student_path, teacher_path)  # doctest: +SKIP
    >>> timings = workers.sync_weights()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from opd.algorithms.base import Role
from opd.trajectory import Trajectory


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(max(1, n or os.cpu_count() or 1))


class _PolicyHost:
    """Shared mechanics of a process that holds one engine plus its tokenizer."""

    def __init__(self, model_cfg: Any, path: str, torch_threads: int):
        _set_threads(torch_threads)
        from opd.chat import ChatFormat
        from opd.generation import make_engine
        from opd.models import load_tokenizer

        self.engine = make_engine(model_cfg["engine"], path, model_cfg["dtype"], model_cfg["trust_remote_code"],
                                  model_cfg.get("prefix_cache_mb", 0.0))
        self.tokenizer = load_tokenizer(path, model_cfg["trust_remote_code"])
        self.fmt = ChatFormat.from_tokenizer(self.tokenizer)

    def envs(self, env_factory, settings):
        """The environment pool for ``env_factory``: child processes kept from call to call
        (``None`` with ``env_isolation: inprocess``)."""
        from opd.rollout.env_pool import EnvWorkerPool

        if settings.env_isolation != "subprocess":
            return None
        pool = getattr(self, "_pool", None)
        if pool is None or pool.factory != env_factory or pool.timeout_s != settings.env_timeout_s:
            if pool is not None:
                pool.close()
            preload = ("environments",) + ((env_factory.module,) if getattr(env_factory, "module", "") else ())
            self._pool = EnvWorkerPool(env_factory, settings.env_timeout_s, preload)
        return self._pool

    def collect(self, env_factory, tasks: list[str], settings, seed: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Play one episode per task; returns the trajectories and timing."""
        from opd.rollout.vanilla import run_episodes

        start = time.perf_counter()
        envs = self.envs(env_factory, settings)
        restarts_before = envs.restarts if envs is not None else 0
        trajs = run_episodes(self.engine, env_factory, tasks, self.tokenizer, self.fmt, settings, seed, envs=envs)
        seconds = time.perf_counter() - start
        tokens = sum(t.num_response_tokens for t in trajs)
        restarts = (envs.restarts - restarts_before) if envs is not None else 0
        return trajs, {"generation_s": seconds, "generated_tokens": float(tokens), "env_restarts": float(restarts)}

    def run(self, fn, *args, **kwargs):
        """``fn(self, *args, **kwargs)`` inside this worker: how an algorithm runs its own rollout
        or scoring code next to the engine (``fn`` must be importable, e.g. a module function)."""
        return fn(self, *args, **kwargs)


class TeacherWorker(_PolicyHost):
    """The frozen teacher: scores the student's responses in the recipe's view and scoring mode.

    With ``student_path`` (``supervision.cross_tokenizer``) the teacher's tokenizer may differ
    from the student's: responses are re-tokenised and scores aligned over text spans.
    """

    def __init__(self, model_cfg: Any, path: str, torch_threads: int, student_path: str | None = None,
                 student_trust_remote_code: bool = False):
        super().__init__(model_cfg, path, torch_threads)
        self.cross = None
        if student_path is not None:
            from opd.models import load_tokenizer
            from opd.supervision.cross_tokenizer import CrossTokenizerScorer

            self.cross = CrossTokenizerScorer(load_tokenizer(student_path, student_trust_remote_code), self.tokenizer)

    def score(self, trajs: list[Trajectory], supervision: Any) -> list:
        """:class:`opd.generation.base.TokenScores` of each trajectory's response tokens."""
        from opd.supervision.teacher_view import score_trajectories

        if self.cross is not None:
            return self.cross.score(self.engine, trajs, supervision.teacher_view, supervision.score_batch_size,
                                    supervision.score_batch_tokens)
        return score_trajectories(self.engine, trajs, supervision.teacher_view, self.fmt, supervision.score_batch_size,
                                  supervision.scoring, supervision.top_k, supervision.score_batch_tokens)


class RolloutWorker(_PolicyHost):
    """The student's inference engine: plays episodes and takes the trainer's weights."""

    def update_weights(self, state_dict) -> float:
        start = time.perf_counter()
        self.engine.update_weights(state_dict)
        return time.perf_counter() - start

    def state_dict(self):
        return self.engine.state_dict()


@dataclass
class RayWorkers:
    """The three actors of a run behind the :class:`opd.algorithms.base.Workers` handle."""

    teacher: Any
    rollout: Any
    trainer: Any

    def _host(self, who: Role):
        return self.rollout if who == "student" else self.teacher

    @staticmethod
    def _await(ref: Any) -> Any:
        import ray  # here, not at import: the module's plain classes run without Ray

        return ray.get(ref)

    def collect(self, who: Role, env_factory, tasks: list[str], settings, seed: int):
        return self._await(self._host(who).collect.remote(env_factory, tasks, settings, seed))

    def score(self, trajs: list[Trajectory], supervision: Any) -> list:
        return self._await(self.teacher.score.remote(trajs, supervision))

    def train(self, batch) -> dict[str, float]:
        return self._await(self.trainer.train_step.remote(batch))

    def sync_weights(self) -> dict[str, float]:
        """Trainer -> rollout engine, in place: the weights are put in the object store once."""
        start = time.perf_counter()
        weights_ref = self.trainer.export_weights.remote()
        load_s = self._await(self.rollout.update_weights.remote(weights_ref))
        return {"weight_sync_s": time.perf_counter() - start, "weight_load_s": load_s}

    def run(self, who: Role, fn: Callable[..., Any], *args: Any) -> Any:
        return self._await(self._host(who).run.remote(fn, *args))

    def save_checkpoint(self, directory: str) -> None:
        """The trainer's state and HF export into ``directory`` (see :mod:`opd.training.checkpoint`)."""
        self._await(self.trainer.save_checkpoint.remote(directory))

    def load_checkpoint(self, directory: str) -> None:
        self._await(self.trainer.load_checkpoint.remote(directory))


def init_ray(resources: Any) -> None:
    """Start a local Ray on loopback, or join ``RAY_ADDRESS``'s cluster."""
    import ray

    if ray.is_initialized():
        return
    # Workers import the user's loss modules by dotted path: give them the driver's sys.path.
    env_vars = {"PYTHONPATH": os.pathsep.join([os.getcwd(), *[p for p in sys.path if p]])}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env_vars}, log_to_driver=True)
        return
    ray.init(
        num_cpus=resources.num_cpus or os.cpu_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": env_vars},
        log_to_driver=True,
        configure_logging=False,
    )


def spawn_workers(cfg: Any, student_path: str, teacher_path: str) -> RayWorkers:
    """Create the teacher, rollout and trainer actors with the recipe's resource shares."""
    import ray
    from omegaconf import OmegaConf

    from opd.training.trainer import StudentTrainer

    res = cfg.resources
    threads = res.torch_threads or os.cpu_count() or 1
    # Ray would set OMP_NUM_THREADS to an actor's (rounded-down) CPU share; on a small machine
    # the phases run one after another, so each actor may use every core while it works.
    thread_env = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    student = OmegaConf.to_container(cfg.student, resolve=True)
    teacher = OmegaConf.to_container(cfg.teacher, resolve=True)
    teacher_actor = ray.remote(TeacherWorker).options(
        num_cpus=res.teacher_cpus, num_gpus=res.teacher_gpus, runtime_env=thread_env
    ).remote(teacher, teacher_path, threads, student_path if cfg.supervision.cross_tokenizer else None,
             student["trust_remote_code"])
    rollout_actor = ray.remote(RolloutWorker).options(
        num_cpus=res.rollout_cpus, num_gpus=res.rollout_gpus, runtime_env=thread_env
    ).remote(student, student_path, threads)
    loss_terms = [(loss.name, float(loss.weight), OmegaConf.to_container(loss.args, resolve=True)) for loss in cfg.losses]
    trainer_actor = ray.remote(StudentTrainer).options(
        num_cpus=res.trainer_cpus, num_gpus=res.trainer_gpus, runtime_env=thread_env
    ).remote(cfg.trainer, loss_terms, student_path, cfg.rollout.episodes_per_step, student["dtype"],
             student["trust_remote_code"], threads, cfg.run.total_steps, cfg.rollout.temperature)
    return RayWorkers(teacher=teacher_actor, rollout=rollout_actor, trainer=trainer_actor)



def local_teacher_player(cfg: Any, log: Callable[[str], None]) -> Callable[[list[str]], list[Trajectory]]:
    """``tasks -> trajectories``: the teacher's greedy episodes played in this process, without
    Ray (``opd references build`` uses it for ``actfirst.reference_source: teacher``); the
    teacher is provisioned first (built, for a ``bootstrap`` section)."""
    from omegaconf import OmegaConf

    from opd.envs import EnvFactory
    from opd.provisioning import resolve_model_path
    from opd.rollout.vanilla import EpisodeSettings

    path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, log)
    worker = TeacherWorker(OmegaConf.to_container(cfg.teacher, resolve=True), path, cfg.resources.torch_threads)
    settings = EpisodeSettings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0,
                               max_context_tokens=cfg.rollout.max_context_tokens, system_prompt=cfg.rollout.system_prompt,
                               env_isolation="inprocess")
    factory = EnvFactory(cfg.env.id, dict(cfg.env.kwargs), cfg.env.module)
    return lambda tasks: worker.collect(factory, tasks, settings, cfg.run.seed)[0]
