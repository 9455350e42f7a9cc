"""How a run fails: errors that carry what failed and where, for the one message the CLI prints.

Everything that stops a run reaches :func:`opd.cli.main` as one of these or as an unexpected
exception; the CLI prints a short account (what failed, in which role, the last complete
checkpoint, the command to resume) and writes the full traceback, the remote one included, to
the run directory's ``error.log``.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that must stop; the message says why and what was kept.

    ``resumable`` is False where ``--resume`` with the same command cannot help (a recipe that
    differs from the run's, a checkpoint refused as tampered): the CLI then offers no resume
    command.
    """

    def __init__(self, message: str, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable


class WorkerError(RunError):
    """A call to one of the run's actors raised, died or hung.

    Attributes:
        role: ``teacher``, ``rollout`` or ``trainer``.
        cause: the exception raised inside the actor, when Ray could bring it back (``None`` for
            a dead or hung actor).
        detail: the remote traceback or Ray's account of the death, for the log.
        kind: ``raised`` (an exception inside the actor), ``died`` (its process is gone) or
            ``hung`` (no answer within ``resources.actor_timeout_s``).
    """

    def __init__(self, role: str, message: str, cause: BaseException | None = None, detail: str = "",
                 kind: str = "raised"):
        super().__init__(message, resumable=True)
        self.role = role
        self.cause = cause
        self.detail = detail
        self.kind = kind
