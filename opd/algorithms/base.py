"""The contract an algorithm is written against: what it is given and what it declares.

An algorithm is one module in :mod:`opd.algorithms` ending with an :class:`Algorithm`: its
``train_step(ctx, step) -> metrics``, which the driver calls once per training step, and the
recipe rules that only it knows. ``ctx`` is a :class:`RunContext`: the validated config, the
environment, the task splits, the sampling settings and :class:`Workers`, the handle through which
the algorithm reaches the run's roles (the student's rollout engine, the teacher, the trainer)
without knowing how or where they are hosted. The runtime implements that handle over Ray actors
(:class:`opd.runtime.actors.RayWorkers`); an algorithm never imports the runtime.

Example:
    >>> def train_step(ctx: RunContext, step: int) -> dict[str, float]:  # doctest: +SKIP
    ...     trajs, gen = ctx.workers.collect("student", ctx.env_factory, tasks, ctx.train_settings, seed)
    ...     scores = ctx.workers.score(trajs, ctx.cfg.supervision)
    ...     ...
    >>> ALGORITHM = Algorithm("my_opd", train_step)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from opd.chat import ChatFormat
from opd.curriculum import Curriculum
from opd.envs import EnvFactory
from opd.generation.base import Engine, TokenScores
from opd.mixture import TaskMix, TeacherRoutes
from opd.rollout.vanilla import EpisodeSettings
from opd.schema import ConfigError, OPDConfig, SupervisionConfig
from opd.trajectory import TokenBatch, Trajectory

Role = Literal["student", "teacher"]
"""Who plays: the student (the rollout worker's engine) or the teacher."""


class PolicyHost(Protocol):
    """A worker's insides, as a function sent with :meth:`Workers.run` sees them: the engine, its
    tokenizer and ChatML ids, and the worker's environment pool."""

    engine: Engine
    tokenizer: Any
    fmt: ChatFormat

    def envs(self, env_factory: EnvFactory, settings: EpisodeSettings) -> Any:
        """The worker's environment pool for ``env_factory`` (``None`` for in-process envs)."""


class Workers(Protocol):
    """The run's roles as an algorithm (and the evaluation) reach them; every call blocks until
    its answer is in."""

    def collect(self, who: Role, env_factory: EnvFactory, tasks: list[str], settings: EpisodeSettings,
                seed: int) -> tuple[list[Trajectory], dict[str, float]]:
        """``who`` plays one episode per task (:func:`opd.rollout.vanilla.run_episodes`); also
        returns ``generation_s``, ``generated_tokens``, ``env_restarts`` and ``env_replays``."""

    def score(self, trajs: list[Trajectory], supervision: SupervisionConfig) -> list[TokenScores]:
        """The teacher's scores of every response token of each trajectory, in its view."""

    def score_for_training(self, trajs: list[Trajectory], supervision: SupervisionConfig) -> Scored:
        """:meth:`score`, with the scores kept where they are made: the caller gets each
        trajectory's sampled-token logprobs (:attr:`Scored.light`) and the payload's size; the
        whole answer (top-k or full distributions) goes to the trainer with :meth:`train_built`."""

    def train(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer update of the student over ``batch``; the trainer's metrics."""

    def train_built(self, plan: BatchPlan) -> dict[str, float]:
        """:meth:`train` on the batch ``plan`` builds, built next to the trainer (every rank) from
        the scores of :meth:`score_for_training`, which never pass through the caller."""

    def sync_weights(self) -> dict[str, float]:
        """The trainer's weights into the student's rollout engine; ``weight_sync_s`` (end to end),
        ``weight_load_s`` (the copy inside the rollout worker) and ``weight_sync_mb`` (what one
        replica received: the model, or a LoRA student's adapters)."""

    def collect_later(self, who: Role, env_factory: EnvFactory, tasks: list[str], settings: EpisodeSettings,
                      seed: int) -> Pending:
        """:meth:`collect`, started now and answered by the returned :class:`Pending`'s
        ``result()``: the worker plays while the caller goes on (the pipelined loop). A later
        call to the same worker waits for it; the local backend plays at once."""

    def run(self, who: Role, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(host, *args)`` inside ``who``'s worker (``host`` a :class:`PolicyHost`): how an
        algorithm runs its own rollout or scoring code next to an engine. ``fn`` must be
        importable (a module-level function)."""


@dataclass
class Scored:
    """A step's teacher scores (:meth:`Workers.score_for_training`): ``light`` (each
    trajectory's :class:`TokenScores` of the sampled tokens only) and ``payload_bytes`` (the
    whole answer's size) here; ``whole``, the full answer, is the workers' handle on it (Ray
    object refs, or the scores themselves on the local backend)."""

    light: list[TokenScores]
    payload_bytes: int
    whole: Any


@dataclass
class BatchPlan:
    """A step's batch as ``build(trajs, scores, *args)`` makes it, where ``scores`` are the
    whole scores of ``scored`` (:meth:`Workers.train_built` runs it next to the trainer)."""

    build: Callable[..., TokenBatch]
    trajs: list[Trajectory]
    scored: Scored | None
    args: tuple = ()


class Pending(Protocol):
    """A call in flight (:meth:`Workers.collect_later`)."""

    def result(self) -> Any:
        """Its answer, waiting for it (bounded as every wait for a worker is)."""


class EpisodeRecorder(Protocol):
    """Where a run keeps episodes token by token (:mod:`opd.evaluation.trajectories`): a sample
    of the training episodes with the teacher's scores, and every evaluation episode."""

    def train_sample(self, step: int, trajs: list[Trajectory], scores: list[TokenScores] | None = None,
                     marks: dict[int, dict[int, list[str]]] | None = None) -> None:
        """Called by every algorithm once per step after scoring; keeps the step's first
        episodes when the step is due (``run.trajectory_every_steps``). ``marks`` names turns
        (``{episode: {turn: ["pivot"]}}``)."""

    def evaluation(self, step: int, who: Role, trajs: list[Trajectory]) -> None:
        """Keeps every episode of a held-out evaluation."""


class NoRecorder:
    """An :class:`EpisodeRecorder` that keeps nothing (tests, scripts)."""

    def train_sample(self, step, trajs, scores=None, marks=None) -> None:
        pass

    def evaluation(self, step, who, trajs) -> None:
        pass


@dataclass
class RunContext:
    """What an algorithm's ``train_step`` and the evaluation get from the driver.

    Attributes:
        cfg: the validated recipe.
        workers: the handle to the run's roles.
        env_factory: makes the recipe's environment (picklable: it crosses to the workers).
        train_tasks, eval_tasks: the task ids of the train split and the held-out ones evaluated.
        train_settings: sampling for training rollouts (the recipe's temperature).
        eval_settings: greedy, past turns shown as ``run.eval_history`` says.
        fmt: the student's ChatML ids.
        episodes: where episodes are kept for ``opd report`` (the driver's writes
            ``trajectories/*.parquet``).
        rollouts: the student's training episodes of each step, played when asked or one step
            ahead (``run.async_steps``); the algorithms take them through
            :func:`opd.algorithms.step.student_episodes`.
        curriculum: the curriculum (:mod:`opd.curriculum`): each step's episode settings
            (:meth:`settings_for`) and which of its turns train.
        mix: with ``env.mix``, the training tasks by environment and their shares of a step
            (:mod:`opd.mixture`); None for one environment.
        routes: which teacher grades each environment's episodes (:class:`opd.mixture.TeacherRoutes`).
    """

    cfg: OPDConfig
    workers: Workers
    env_factory: EnvFactory
    train_tasks: list[str]
    eval_tasks: list[str]
    train_settings: EpisodeSettings
    eval_settings: EpisodeSettings
    fmt: ChatFormat
    episodes: EpisodeRecorder = field(default_factory=NoRecorder)
    rollouts: StepRollouts = field(default_factory=lambda: StepRollouts(0, 0))
    curriculum: Curriculum | None = None
    mix: TaskMix | None = None
    routes: TeacherRoutes = field(default_factory=TeacherRoutes.single)

    def settings_for(self, step: int, tasks: list[str] | None = None) -> EpisodeSettings:
        """Step ``step``'s training episode settings for its ``tasks`` (a forward depth curriculum
        plays fewer turns; a prefix curriculum starts them from replayed reference turns)."""
        if self.curriculum is None:
            return self.train_settings
        return self.curriculum.settings(self.train_settings, step, tasks)


@dataclass
class StepRollouts:
    """The student's training episodes, step by step; with ``ahead`` = 1 (``run.async_steps``)
    each step also starts the next step's rollout before it is scored and trained, so the rollout
    worker plays step k+1 while the teacher scores and the trainer trains step k.

    Step k+1's rollout then runs on the weights synced after step k-1: one update older than the
    policy that trains on it (``staleness`` 1). The losses' importance ratio against the
    behaviour logprobs recorded with each token corrects for that, as for any off-policy sample.
    ``updates`` counts the weight syncs, so the staleness is measured, not assumed.

    Attributes:
        ahead: 0 (play each step when asked) or 1 (one step ahead).
        last_step: the run's last step (nothing is started beyond it).
        updates: weight syncs so far (:func:`opd.algorithms.step.train_and_sync` counts them).
    """

    ahead: int
    last_step: int
    updates: int = 0
    _next: tuple[int, Pending, int] | None = None  # (step, its rollout in flight, updates at its start)

    def wants(self, step: int) -> bool:
        """Whether step ``step`` starts step ``step + 1``'s rollout."""
        return bool(self.ahead) and step < self.last_step

    def episodes(self, ctx: RunContext, step: int, draw: tuple[list[str], int],
                 next_draw: tuple[list[str], int] | None = None) -> tuple[list[Trajectory], dict[str, float], int]:
        """Step ``step``'s episodes of its ``(tasks, seed)`` and their generation figures, and how
        many updates older than the current weights the ones that played them are; with
        ``next_draw``, step ``step + 1``'s rollout is started before this returns."""
        if self._next is not None and self._next[0] == step:
            _, pending, started_at = self._next
            self._next = None
            trajs, gen = pending.result()
            staleness = self.updates - started_at
        else:
            self._next = None  # a step other than the one started (a resumed run): play it now
            settings = ctx.settings_for(step, draw[0])
            trajs, gen = ctx.workers.collect("student", ctx.env_factory, draw[0], settings, draw[1])
            staleness = 0
        if next_draw is not None:
            settings = ctx.settings_for(step + 1, next_draw[0])
            pending = ctx.workers.collect_later("student", ctx.env_factory, next_draw[0], settings, next_draw[1])
            self._next = (step + 1, pending, self.updates)
        return trajs, gen, staleness


def no_rules(cfg: OPDConfig, source: str) -> None:
    """An algorithm that adds no rule of its own to the recipe's."""


@dataclass(frozen=True)
class Algorithm:
    """What an algorithm module declares (its last lines), read by the driver and the config.

    Attributes:
        name: the recipe's ``algorithm:`` value (its key in :data:`opd.algorithms.ALGORITHMS`).
        train_step: ``(ctx, step) -> metrics``: one training step, top to bottom.
        check_config: ``(cfg, source)`` raises :class:`opd.schema.ConfigError` for a recipe this
            algorithm cannot run, naming the key; called when the recipe is loaded.
        uses_teacher: whether it consults the teacher; losses that need the teacher's grades
            (``needs_teacher``) are refused when it does not.
        masks: the named token masks its batches carry (:attr:`opd.trajectory.TokenBatch.masks_BT`);
            a loss that trains on one of them (``token_mask``) is refused by the others.
        eval_history: how evaluation shows past turns when ``run.eval_history`` is ``auto``.
        pipelines: whether its steps take their episodes through
            :func:`opd.algorithms.step.student_episodes`, so that ``run.async_steps: 1`` can play
            the next step's while this one trains (refused for the others).
    """

    name: str
    train_step: Callable[[RunContext, int], dict[str, float]]
    check_config: Callable[[OPDConfig, str], None] = no_rules
    uses_teacher: bool = True
    masks: tuple[str, ...] = ()
    eval_history: Literal["full", "state_grounded"] = "full"
    pipelines: bool = False


def require_groups(cfg: OPDConfig, source: str, name: str) -> None:
    """The rule of algorithms that compare episodes of the same task (GRPO advantages)."""
    if cfg.rollout.group_size < 2:
        raise ConfigError(f"{source}: key 'rollout.group_size' is {cfg.rollout.group_size}; algorithm "
                          f"{name!r} compares episodes of the same task, so it needs groups of 2 or more.")
