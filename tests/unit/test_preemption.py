"""The driver's SIGTERM handler (issue 51, item 1): the first signal starts the grace period and
only records the request; when the period runs out, or at a second signal, the main thread is
interrupted (the step under way is abandoned). The run-level behaviour (a saved step, exit 143,
an exact resume) is tests/integration/test_actor_faults.py's."""

from __future__ import annotations

import os
import signal
import time

import pytest

from opd.runtime.preemption import EXIT_STATUS, Preemption


def test_the_first_sigterm_is_recorded_and_the_grace_period_then_interrupts_the_main_thread():
    said: list[str] = []
    preemption = Preemption(grace_s=0.5, log=said.append)
    assert preemption.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes: the test goes on
        assert preemption.requested and not preemption.abandoned and 0.3 < preemption.left_s() <= 0.5
        assert "SIGTERM received" in said[0] and "within 0.5 s (run.preempt_grace_s)" in said[0]
        with pytest.raises(KeyboardInterrupt):
            time.sleep(5)  # a step that would outlast the grace period
        assert preemption.abandoned and preemption.left_s() <= 0
    finally:
        preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler) or \
        signal.getsignal(signal.SIGTERM) != preemption._on_signal
    assert EXIT_STATUS == 143


def test_a_second_sigterm_abandons_the_step_at_once():
    preemption = Preemption(grace_s=60, log=lambda _: None)
    preemption.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert preemption.requested and preemption.left_s() > 59
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert preemption.abandoned
    finally:
        preemption.uninstall()
