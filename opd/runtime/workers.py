"""The worker classes a run's roles are made of, plain Python: no Ray here.

``TeacherWorker`` (the frozen teacher: scores the student's responses) and ``RolloutWorker`` (the
student's inference engine: plays episodes, takes the trainer's weights) each hold one engine
with its tokenizer and environment pool. :mod:`opd.runtime.actors` hosts them as Ray actors,
:mod:`opd.runtime.local` as objects in the driver's process, and ``opd eval`` / ``opd compare``
(:mod:`opd.runtime.offline`) play a ``RolloutWorker`` in their own process. The third role, the
trainer, is :class:`opd.training.trainer.StudentTrainer`.

Each is built from a spec, a small frozen dataclass that crosses to a Ray actor as it is:
:class:`EngineSpec` (a policy's engine), :class:`TeacherSpec` (the teacher's engine and the
student's tokenizer for cross-tokenizer scoring) and :class:`opd.training.trainer.TrainerSpec`.
:func:`role_specs` makes the three from a recipe, one place for every backend.

Example:
    >>> specs = role_specs(cfg, student_path, teacher_path)  # doctest: +SKIP
    >>> student = RolloutWorker(specs.rollout)  # doctest: +SKIP
    >>> trajs, timing = student.collect(env_factory, tasks, settings, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from opd.envs import EnvFactory
from opd.generation.base import TokenScores
from opd.generation.server import ServerSpec
from opd.mixture import DEFAULT_TEACHER, TeacherRoutes, routes_of, teacher_resources
from opd.process import configure_role_process
from opd.rollout.vanilla import EpisodeSettings
from opd.schema import ModelConfig, OPDConfig, SupervisionConfig
from opd.training.trainer import TrainerSpec
from opd.trajectory import Trajectory


@dataclass(frozen=True)
class EngineSpec:
    """A policy's inference engine as a worker loads it (:func:`opd.generation.make_engine`).

    Attributes:
        path: the model directory (or hub id).
        engine, dtype, trust_remote_code, prefix_cache_mb, tensor_parallel_size: the role's
            :class:`opd.schema.ModelConfig` keys of the same names.
        torch_threads: torch's intra-op threads in the worker's process (0: every core).
        server: where a served teacher is (``engine: server``; ``path`` then holds its tokenizer).
    """

    path: str
    engine: str = "auto"
    dtype: str = "float32"
    trust_remote_code: bool = False
    prefix_cache_mb: float = 0.0
    tensor_parallel_size: int = 1
    torch_threads: int = 0
    server: ServerSpec | None = None

    @classmethod
    def of(cls, model_cfg: ModelConfig, path: str, torch_threads: int) -> "EngineSpec":
        """The spec of the model a recipe's ``student`` or ``teacher`` section names, at ``path``."""
        return cls(path=path, engine=str(model_cfg.engine), dtype=str(model_cfg.dtype),
                   trust_remote_code=bool(model_cfg.trust_remote_code), prefix_cache_mb=float(model_cfg.prefix_cache_mb),
                   tensor_parallel_size=int(model_cfg.tensor_parallel_size), torch_threads=int(torch_threads),
                   server=ServerSpec.of(model_cfg.server) if model_cfg.engine == "server" else None)


@dataclass(frozen=True)
class TeacherSpec:
    """The teacher's engine and, for ``supervision.cross_tokenizer``, the student's tokenizer
    (``student_path``; ``None`` when the two share a tokenizer)."""

    engine: EngineSpec
    student_path: str | None = None
    student_trust_remote_code: bool = False


@dataclass(frozen=True)
class TeacherGroup:
    """One teacher model's actors: its spec, how many and each one's CPU and GPU share (a run of
    several teachers has one group per model, :class:`opd.mixture.TeacherRoutes`)."""

    spec: TeacherSpec
    replicas: int = 1
    cpus: float = 0.5
    gpus: float = 0.0


@dataclass(frozen=True)
class RoleSpecs:
    """What each role of a run is built from, and the torch threads every role's process uses.
    ``teachers`` holds each teacher model's group by name (one, ``teacher``, unless ``env.mix``
    routes to several), in the order :attr:`routes` first names them; ``teacher`` is the first's spec."""

    threads: int
    teacher: TeacherSpec
    rollout: EngineSpec
    trainer: TrainerSpec
    teachers: dict[str, TeacherGroup]
    routes: TeacherRoutes


def recipe_loss_terms(cfg: OPDConfig) -> tuple[tuple[str, float, dict], ...]:
    """``(name, weight, args)`` of each term of the recipe's ``losses``, as the trainer takes them."""
    from omegaconf import OmegaConf

    return tuple((loss.name, float(loss.weight), OmegaConf.to_container(loss.args, resolve=True))
                 for loss in cfg.losses)


def role_specs(cfg: OPDConfig, student_path: str, teacher_path: str | dict[str, str]) -> RoleSpecs:
    """The specs of a recipe's teachers, rollout worker and trainer (each rank's is the same).
    ``teacher_path`` is the teacher's model directory, or with several teachers each group's
    (:func:`opd.mixture.routes_of`) by name."""
    threads = cfg.resources.torch_threads or os.cpu_count() or 1
    loss_terms = recipe_loss_terms(cfg)
    cross = cfg.supervision.cross_tokenizer
    routes = routes_of(cfg)
    paths = teacher_path if isinstance(teacher_path, dict) else {g: teacher_path for g in routes.groups}
    sections = {DEFAULT_TEACHER: cfg.teacher, **dict(cfg.teachers)}
    res = cfg.resources
    teachers = {}
    for name in routes.groups:
        section = sections[name]
        spec = TeacherSpec(EngineSpec.of(section, paths[name], threads), student_path if cross else None,
                           bool(cfg.student.trust_remote_code))
        teachers[name] = TeacherGroup(spec, *teacher_resources(name, section, res))
    return RoleSpecs(
        threads=threads,
        teacher=next(iter(teachers.values())).spec,
        teachers=teachers,
        routes=routes,
        rollout=EngineSpec.of(cfg.student, student_path, threads),
        trainer=TrainerSpec(trainer=cfg.trainer, loss_terms=loss_terms, model_dir=student_path,
                            episodes_per_step=cfg.rollout.episodes_per_step, dtype=str(cfg.student.dtype),
                            trust_remote_code=bool(cfg.student.trust_remote_code), torch_threads=threads,
                            total_steps=cfg.run.total_steps, temperature=cfg.rollout.temperature,
                            lora=cfg.student.lora if cfg.student.lora.rank > 0 else None))


def shares(items: list, parts: int) -> list[tuple[int, list]]:
    """``items`` cut in order into at most ``parts`` runs of near-equal length (the longer ones
    first), each with the index of its first item; empty runs left out.

    Example:
        >>> shares(list("abcde"), 2)
        [(0, ['a', 'b', 'c']), (3, ['d', 'e'])]
    """
    size, extra = divmod(len(items), max(1, parts))
    out, start = [], 0
    for p in range(max(1, parts)):
        n = size + (1 if p < extra else 0)
        if n:
            out.append((start, items[start : start + n]))
        start += n
    return out or [(0, [])]


def merge_collected(parts: list[tuple[list[Trajectory], dict[str, float]]]) -> tuple[list[Trajectory], dict[str, float]]:
    """The replicas' ``collect`` answers as one: trajectories in order, the wall time of the
    slowest, counts added up."""
    trajs = [t for part, _ in parts for t in part]
    timing: dict[str, float] = {}
    for _, part in parts:
        for k, v in part.items():
            timing[k] = max(timing.get(k, 0.0), v) if k.endswith("_s") else timing.get(k, 0.0) + v
    return trajs, timing


class PolicyWorker:
    """What a process that holds one policy shares: its engine, tokenizer, ChatML ids and
    environment pool (the :class:`opd.algorithms.base.PolicyHost` an algorithm's function sees)."""

    def __init__(self, spec: EngineSpec):
        configure_role_process(spec.torch_threads)
        from opd.chat import ChatFormat
        from opd.generation import make_engine
        from opd.models import load_tokenizer

        self.engine = make_engine(spec.engine, spec.path, spec.dtype, spec.trust_remote_code, spec.prefix_cache_mb,
                                  spec.tensor_parallel_size, spec.server)
        self.path = spec.path
        self.merger = None  # a LoRA student's starting weights, for its adapters' updates
        self.tokenizer = load_tokenizer(spec.path, spec.trust_remote_code)
        self.fmt = ChatFormat.from_tokenizer(self.tokenizer)
        self._pool = None
        self._pool_key: tuple | None = None

    def envs(self, env_factory: EnvFactory, settings: EpisodeSettings):
        """The environment pool for ``env_factory``: child processes kept from call to call
        (``None`` with ``env_isolation: inprocess``)."""
        from opd.rollout.env_pool import EnvWorkerPool

        if settings.env_isolation != "subprocess":
            return None
        limits = dict(memory_limit_mb=settings.env_memory_limit_mb, cpu_time_limit_s=settings.env_cpu_time_limit_s)
        key = (env_factory, settings.env_timeout_s, tuple(limits.values()))
        if self._pool is None or self._pool_key != key:
            self.close()
            preload = ("environments",) + ((env_factory.module,) if getattr(env_factory, "module", "") else ())
            self._pool = EnvWorkerPool(env_factory, settings.env_timeout_s, preload, **limits)
            self._pool_key = key
        return self._pool

    def close(self) -> None:
        """End the environment processes of the pool (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def collect(self, env_factory: EnvFactory, tasks: list[str], settings: EpisodeSettings, seed: int,
                first_index: int = 0, guide: Any = None) -> tuple[list[Trajectory], dict[str, float]]:
        """Play one episode per task (``tasks[0]`` the step's episode ``first_index``, see
        :func:`opd.rollout.vanilla.run_episodes`); returns the trajectories and timing. ``guide``
        (the teacher's worker, or a caller of its Ray actor) plays ``settings.guide_share`` of the
        turns."""
        from opd.rollout.env_pool import pool_counts
        from opd.rollout.vanilla import run_episodes

        start = time.perf_counter()
        envs = self.envs(env_factory, settings)
        before = pool_counts(envs)
        trajs = run_episodes(self.engine, env_factory, tasks, self.tokenizer, self.fmt, settings, seed, envs=envs,
                             first_index=first_index, guide=guide_engine(guide))
        seconds = time.perf_counter() - start
        tokens = sum(t.num_response_tokens for t in trajs)
        return trajs, {"generation_s": seconds, "generated_tokens": float(tokens),
                       **{key: n - before[key] for key, n in pool_counts(envs).items()}}

    def generate(self, prompts: list[list[int]], params: Any) -> list:
        """This worker's engine continues ``prompts`` (another worker's episodes: a teacher
        playing turns inside the student's, :func:`guide_engine`)."""
        return self.engine.generate(prompts, params)

    def run(self, fn, *args, **kwargs):
        """``fn(self, *args, **kwargs)`` inside this worker: how an algorithm runs its own rollout
        or scoring code next to the engine (``fn`` must be importable, e.g. a module function)."""
        return fn(self, *args, **kwargs)


def guide_engine(guide: Any) -> Any:
    """What generates a guided turn: the engine of ``guide`` (a worker in this process), or
    ``guide`` itself (anything with ``generate``, e.g. :class:`opd.runtime.actors.ActorGuide`)."""
    return guide.engine if isinstance(guide, PolicyWorker) else guide


class TeacherWorker(PolicyWorker):
    """The frozen teacher: scores the student's responses in the recipe's view and scoring mode.

    With ``spec.student_path`` (``supervision.cross_tokenizer``) the teacher's tokenizer may differ
    from the student's: responses are re-tokenised and scores aligned over text spans.
    """

    def __init__(self, spec: TeacherSpec):
        super().__init__(spec.engine)
        self.cross = None
        if spec.student_path is not None:
            from opd.models import load_tokenizer
            from opd.supervision.cross_tokenizer import CrossTokenizerScorer

            self.cross = CrossTokenizerScorer(load_tokenizer(spec.student_path, spec.student_trust_remote_code),
                                              self.tokenizer)

    def score(self, trajs: list[Trajectory], supervision: SupervisionConfig) -> list[TokenScores]:
        """:class:`opd.generation.base.TokenScores` of each trajectory's response tokens."""
        from opd.supervision.teacher_view import score_trajectories

        if self.cross is not None:
            return self.cross.score(self.engine, trajs, supervision.teacher_view, supervision.score_batch_size,
                                    supervision.score_batch_tokens)
        return score_trajectories(self.engine, trajs, supervision.teacher_view, self.fmt, supervision.score_batch_size,
                                  supervision.scoring, supervision.top_k, supervision.score_batch_tokens)

    def output_head(self):
        """The teacher's LM head (``scoring: hidden``), :meth:`opd.generation.hf.HFEngine.output_head`."""
        if not hasattr(self.engine, "output_head"):
            raise ValueError(f"supervision.scoring: hidden needs the teacher on the hf engine; it runs on "
                             f"{type(self.engine).__name__}")
        return self.engine.output_head()

    def score_split(self, trajs: list[Trajectory],
                    supervision: SupervisionConfig) -> tuple[list[TokenScores], tuple[list[TokenScores], int]]:
        """:meth:`score`, and beside it the light part for the driver: each trajectory's scores
        of the sampled tokens only, and the whole answer's size in bytes (under Ray, two
        returns: the whole answer stays in the object store until the trainer takes it)."""
        scores = self.score(trajs, supervision)
        return scores, ([TokenScores(s.logprobs) for s in scores], sum(s.nbytes() for s in scores))


class RolloutWorker(PolicyWorker):
    """The student's inference engine: plays episodes and takes the trainer's weights."""

    def update_weights(self, state_dict) -> dict[str, float]:
        """Load the trainer's weights: a state dict, or a LoRA student's adapters
        (:class:`opd.training.lora.LoraUpdate`), merged here into the starting weights of the
        layers they adapt and loaded as those layers' weights. Returns the seconds it took and
        the bytes it received (a tensor tied under two names counted once)."""
        start = time.perf_counter()
        if isinstance(state_dict, dict):
            received = sum(t.numel() * t.element_size() for t in {id(t): t for t in state_dict.values()}.values())
        else:  # a LoraUpdate
            from opd.training.lora import LoraMerger

            received = state_dict.nbytes()
            if self.merger is None:
                self.merger = LoraMerger(self.path)
            state_dict = self.merger.merged(state_dict, whole=not getattr(self.engine, "partial_updates", False))
        self.engine.update_weights(state_dict)
        return {"seconds": time.perf_counter() - start, "bytes": float(received)}

    def state_dict(self):
        return self.engine.state_dict()


def local_teacher_player(cfg: OPDConfig, log: Callable[[str], None]) -> Callable[[list[str]], list[Trajectory]]:
    """``tasks -> trajectories``: the teacher's greedy episodes played in this process, without
    Ray (``opd references build`` uses it for ``actfirst.reference_source: teacher``); the
    teacher is provisioned first (built, for a ``bootstrap`` section)."""
    from opd.bootstrap import resolve_teacher_path

    path = resolve_teacher_path(cfg, log)
    worker = TeacherWorker(TeacherSpec(EngineSpec.of(cfg.teacher, path, cfg.resources.torch_threads)))
    settings = EpisodeSettings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0,
                               max_context_tokens=cfg.rollout.max_context_tokens, system_prompt=cfg.rollout.system_prompt,
                               env_isolation="inprocess")
    return lambda tasks: worker.collect(EnvFactory.of(cfg.env), tasks, settings, cfg.run.seed)[0]
