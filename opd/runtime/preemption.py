"""Preemption: a SIGTERM (a spot instance reclaimed, a Kubernetes eviction, SLURM's time limit,
``ray job stop``) asks the run to stop within ``run.preempt_grace_s``.

The driver's handler (:class:`Preemption`) only records the request: the training loop finishes
the step under way, writes a checkpoint of it if the grace period leaves time for one (the last
save's duration is the estimate), ends every role and raises :class:`Preempted`, which the CLI
turns into what was saved, the resume command and exit status 143 (128 + SIGTERM). A step that
has not finished when the grace period runs out is abandoned (the main thread is interrupted):
the last complete checkpoint is intact and the message names it. A second SIGTERM, or Ctrl-C
after one, abandons the step at once.

Ray's core worker installs a SIGTERM handler of its own in the driver when Ray starts (it dumps
a stack and aborts): :meth:`Preemption.install` is called again after the roles start, so the
handler in force is this one.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from types import FrameType
from typing import Callable

from opd.runtime.errors import RunError

__all__ = ["Preempted", "Preemption"]

EXIT_STATUS = 128 + signal.SIGTERM  # 143, what a process ended by SIGTERM reports


class Preempted(RunError):
    """The run stopped on SIGTERM; the message says what was saved (resumable: yes)."""

    exit_status = EXIT_STATUS


class Preemption:
    """The driver's SIGTERM handler and the grace period it starts; :attr:`requested_at` is the
    monotonic time of the first signal (None: none yet)."""

    def __init__(self, grace_s: float, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.grace_s, self.log, self.clock = grace_s, log, clock
        self.requested_at: float | None = None
        self.abandoned = False  # the grace period ran out before the loop stopped
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """Handle SIGTERM in this (the main) thread; False where signals cannot be handled here
        (a thread other than the main one, as under some test runners)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous.setdefault(signal.SIGTERM, previous)
        return True

    def uninstall(self) -> None:
        """The handlers in force before :meth:`install`, and no timer left running."""
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._previous.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def left_s(self) -> float:
        """Seconds of the grace period left (infinite before a signal)."""
        if self.requested_at is None:
            return float("inf")
        return self.grace_s - (self.clock() - self.requested_at)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_at is not None:  # a second signal: abandon the step now
            self.abandoned = True
            raise KeyboardInterrupt
        self.requested_at = self.clock()
        self.log(f"[yellow]{signal.Signals(signum).name} received[/]: finishing the step under way, then a checkpoint "
                 f"and a clean stop within {self.grace_s:g} s (run.preempt_grace_s); send it again to stop at once")
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        """The grace period ran out: interrupt the main thread (the step is abandoned). SIGTERM
        again, aimed at the main thread, where this handler takes it as the second signal: a
        blocking wait there (a sleep, Ray's ``get``) wakes now, and whatever a library did to
        SIGINT's handler does not matter."""
        self.abandoned = True
        try:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        except (AttributeError, OSError):  # no pthread_kill on this platform: the flag, at the next bytecode
            _thread.interrupt_main()
