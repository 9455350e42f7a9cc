"""Greedy success on the held-out tasks, played by the student or the teacher, with every
episode kept token by token in the run directory (``trajectories/eval_{who}_step_N.parquet``,
:mod:`opd.evaluation.trajectories`).

Example:
    >>> record = evaluate(ctx, "student", step=25)  # doctest: +SKIP
    >>> record["eval/student_success"]  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from opd.algorithms.base import Role, RunContext
from opd.mixture import by_environment
from opd.trajectory import Trajectory, success_rate


def evaluate(ctx: RunContext, who: Role, step: int = 0) -> dict[str, float]:
    """``who`` plays each of ``ctx.eval_tasks`` once, greedily (``ctx.eval_settings``); returns
    ``eval/{who}_success``, ``eval/{who}_return`` and ``eval/{who}_turns`` (means per episode),
    ``eval/{who}_time_s``, ``eval/{who}_valid_action_rate`` (where the environment says which
    actions it accepted) and each figure the environment reports (its ``report_keys``:
    ``eval/{who}_score``, ``eval/{who}_value`` ...); in a mixed run also each environment's
    (:func:`by_env_figures`)."""
    trajs, gen = ctx.workers.collect(who, ctx.env_factory, ctx.eval_tasks, ctx.eval_settings, ctx.cfg.run.seed)
    ctx.episodes.evaluation(step, who, trajs)
    keys = ctx.eval_settings.report_keys
    return {**(by_env_figures(trajs, who, keys) if ctx.mix is not None else {}),
            **figures(trajs, who, gen["generation_s"], keys)}


def by_env_figures(trajs: list[Trajectory], who: Role, keys: tuple[str, ...]) -> dict[str, float]:
    """A mixed run's (``env.mix``) held-out figures per environment: ``eval/<env>/{who}_success``
    and the rest of :func:`figures` but time; nothing for a run of one environment (the teacher
    that plays a mixed run's ``who="teacher"`` evaluation is each environment's own)."""
    groups = by_environment(trajs)
    if list(groups) == [""]:
        return {}
    return {key.replace("eval/", f"eval/{env}/", 1): value for env, part in groups.items()
            for key, value in figures(part, who, None, keys).items()}


def figures(trajs: list[Trajectory], who: Role, seconds: float | None, keys: tuple[str, ...]) -> dict[str, float]:
    """``eval/{who}_success``, ``_return``, ``_turns``, ``_time_s`` (unless ``seconds`` is None),
    ``_valid_action_rate`` and the environment's own figures (``keys``) of ``trajs``."""
    return {
        f"eval/{who}_success": success_rate(trajs),
        f"eval/{who}_return": sum(t.total_reward for t in trajs) / max(len(trajs), 1),
        f"eval/{who}_turns": sum(len(t.turns) for t in trajs) / max(len(trajs), 1),
        **({f"eval/{who}_time_s": seconds} if seconds is not None else {}),
        **({f"eval/{who}_valid_action_rate": valid} if (valid := valid_action_rate(trajs)) is not None else {}),
        **{f"eval/{who}_{k}": v for k, v in env_figures(trajs, keys).items()},
    }


def valid_action_rate(trajs: list[Trajectory]) -> float | None:
    """The share of turns whose action the environment accepted, over the turns whose info says
    (``valid_action``); ``None`` when no turn does."""
    flags = [bool(turn.info["valid_action"]) for t in trajs for turn in t.turns if "valid_action" in turn.info]
    return sum(flags) / len(flags) if flags else None


def env_figures(trajs: list[Trajectory], keys: tuple[str, ...]) -> dict[str, float]:
    """The mean of each of ``keys`` (the environment's ``report_keys``) in the episodes' last info
    (a bool as a share), over the episodes that report it."""
    out = {}
    for key in keys:
        values = [float(t.turns[-1].info[key]) for t in trajs if t.turns and isinstance(t.turns[-1].info.get(key),
                                                                                         (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    return out


@dataclass(frozen=True)
class TeacherCheck:
    """Whether the teacher beats the student on the held-out tasks before training: ``margin``
    (teacher minus student success) against ``noise`` (two standard errors of that difference,
    binomial, over ``episodes`` each)."""

    teacher_success: float
    student_success: float
    episodes: int
    margin: float
    noise: float
    teacher_better: bool

    def as_dict(self) -> dict:
        return asdict(self)

    def message(self) -> str:
        """What is wrong and what to do (for a teacher that is not better)."""
        where = "below" if self.margin < 0 else "not clearly above"
        return (f"the teacher is {where} the student on the {self.episodes} held-out tasks before training: teacher "
                f"{100 * self.teacher_success:.1f}%, student {100 * self.student_success:.1f}% (a margin of "
                f"{100 * self.margin:+.1f} points; noise, two standard errors: {100 * self.noise:.1f}). OPD pulls the "
                "student toward the teacher, so the student will likely not improve and may get worse. Use a stronger "
                "teacher (teacher.path, or more teacher.bootstrap.sft_steps / n_episodes), evaluate on more tasks "
                "(run.eval_episodes), or try the other view (supervision.teacher_view). run.teacher_check: error "
                "stops a run here; ignore silences it.")


def check_teacher(teacher_success: float, student_success: float, episodes: int) -> TeacherCheck:
    """:class:`TeacherCheck` of the step-0 evaluation: the teacher counts as better when its
    success exceeds the student's by more than two standard errors of the difference (and by
    something: two policies at 0% or at 100% are not told apart)."""
    n = max(int(episodes), 1)
    t, s = float(teacher_success), float(student_success)
    noise = 2 * math.sqrt(t * (1 - t) / n + s * (1 - s) / n)
    margin = t - s
    return TeacherCheck(t, s, n, margin, noise, margin > noise and margin > 0)


@dataclass(frozen=True)
class SamplingCheck:
    """Whether the student's sampled actions (the first training step's, at the rollout
    temperature) are about as often valid as its greedy ones (the step-0 evaluation's): where
    sampling breaks the responses, the teacher grades text unlike anything it was trained on."""

    greedy_valid: float
    sampled_valid: float
    temperature: float
    gap: float
    sampling_ok: bool

    def as_dict(self) -> dict:
        return asdict(self)

    def message(self, graded_by_teacher: bool = True) -> str:
        """What is wrong and what to do (for samples much less valid than greedy play), for an
        algorithm whose teacher grades the samples or, ``graded_by_teacher=False``, one whose
        reward does (GRPO)."""
        why = ("OPD trains on the samples, and the teacher grades their broken text outside anything it was "
               "trained on: the student can get worse while the KL to the teacher falls (docs/results.md, the view "
               "study)." if graded_by_teacher else
               "RL trains on the samples, and their rewards are then mostly the price of invalid turns: the policy "
               "that acts least can win, whatever the task (docs/results.md, the clinical reward study: every "
               "student learnt to commit at once).")
        return (f"the student's sampled responses (rollout.temperature {self.temperature:g}) made a valid action "
                f"in {100 * self.sampled_valid:.1f}% of the first step's turns, against {100 * self.greedy_valid:.1f}% "
                f"greedily before training. {why} Bootstrap the student longer (student.bootstrap.sft_steps), "
                "shorten its reasoning, or lower rollout.temperature. run.sampling_check: error stops a run here; "
                "ignore silences it.")


# How far (a share of turns) sampled play may fall below greedy play in valid actions.
SAMPLING_GAP = 0.25


def check_sampling(greedy_valid: float, sampled_valid: float, temperature: float) -> SamplingCheck:
    """:class:`SamplingCheck` of the first training step: the samples count as sound unless their
    valid-action rate is more than :data:`SAMPLING_GAP` below the greedy one."""
    gap = float(greedy_valid) - float(sampled_valid)
    return SamplingCheck(float(greedy_valid), float(sampled_valid), float(temperature), gap, gap <= SAMPLING_GAP)
