"""What the driver carries from step to step, and what a checkpoint keeps of it.

:class:`RunState` is the driver's whole state: the steps done, the training time, every held-out
evaluation so far and the pre-flight checks. A checkpoint stores it as JSON in its ``COMPLETE``
marker (:func:`opd.training.checkpoint.save_checkpoint`), so ``--resume`` goes on from exactly
there, and the summary is made from it at the end.

The JSON is the one checkpoints have always held (``step``, ``train_time_s``, ``evals`` and the
optional keys, each left out while unset), so a checkpoint written before this class existed
resumes as it is; one whose state holds a key this opd does not know was written by another
version, and is refused (:meth:`RunState.from_dict`) rather than half read.

Example:
    >>> state = RunState(step=50, train_time_s=120.5)
    >>> RunState.from_dict(state.to_dict(), "step_50") == state
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


class StateError(ValueError):
    """A checkpoint's driver state that this opd cannot resume from; the message says why."""


@dataclass
class RunState:
    """The driver's state.

    Attributes:
        step: training steps done.
        train_time_s: their wall time, summed (``time/step_s``).
        evals: every held-out evaluation's record, with its ``step`` (step 0: teacher and student).
        teacher_success, student_success_before: step 0's held-out success (a fresh run sets them).
        student_success_after: the last step's (set when the run reaches ``run.total_steps``).
        teacher_check: step 0's :class:`opd.evaluation.heldout.TeacherCheck`, as a dict.
        sampling_check: step 1's :class:`opd.evaluation.heldout.SamplingCheck`, as a dict.
    """

    step: int = 0
    train_time_s: float = 0.0
    evals: list[dict[str, Any]] = field(default_factory=list)
    teacher_success: float | None = None
    student_success_before: float | None = None
    student_success_after: float | None = None
    teacher_check: dict[str, Any] | None = None
    sampling_check: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON a checkpoint keeps: every field, an unset optional one left out."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> "RunState":
        """The state a checkpoint (``where``, for the message) kept.

        Raises:
            StateError: a key this version does not know, or a value of the wrong kind.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StateError(f"{where} holds driver state this version of opd does not know ({', '.join(unknown)}): "
                             "it was written by another version. Resume it with that version, or start afresh in a new "
                             "run.output_dir.")
        if not isinstance(data.get("step"), int) or not isinstance(data.get("evals", []), list):
            raise StateError(f"{where}: its driver state has no integer 'step' or no list of 'evals'")
        return cls(**data)

    def by_environment(self) -> dict[str, dict[str, float | None]]:
        """A mixed run's (``env.mix``) held-out success per environment: its teacher's, the
        student's before training and at the last evaluation (``{}`` for one environment)."""
        first = next((e for e in self.evals if e.get("step") == 0), {})
        last = next((e for e in reversed(self.evals) if e.get("step", 0) > 0 and "eval/student_success" in e), {})
        envs = [k.split("/")[1] for k in first if k.count("/") == 2 and k.startswith("eval/")
                and k.endswith("/student_success")]
        return {env: {"teacher": first.get(f"eval/{env}/teacher_success"),
                      "student_before": first.get(f"eval/{env}/student_success"),
                      "student_after": last.get(f"eval/{env}/student_success")} for env in envs}

    def heldout_figures(self) -> dict[str, dict[str, float]]:
        """The held-out figures besides success (mean return, turns and what the environment
        reports: score, value, questions asked, ...) of the teacher, the student before training
        and the student at the last evaluation."""
        def of(record: dict[str, Any], who: str) -> dict[str, float]:
            prefix = f"eval/{who}_"
            return {k[len(prefix):]: v for k, v in record.items()
                    if k.startswith(prefix) and not k.endswith(("_time_s", "_success"))}

        first = next((e for e in self.evals if e.get("step") == 0), None)
        last = next((e for e in reversed(self.evals) if e.get("step", 0) > 0 and "eval/student_success" in e), None)
        out = {}
        if first is not None:
            out["teacher"], out["student_before"] = of(first, "teacher"), of(first, "student")
        if last is not None:
            out["student_after"] = of(last, "student")
        return {k: v for k, v in out.items() if v}
