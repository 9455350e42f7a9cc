"""One driver per run directory (issue 51, item 5): a second driver is refused at once, naming
the first; the lock of a driver that died (SIGKILL) does not block the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from opd.config import ConfigError
from opd.runtime.run_lock import LOCK_NAME, RunDirectoryLock

HOLD = """
import sys, time
from pathlib import Path
from opd.runtime.run_lock import RunDirectoryLock
with RunDirectoryLock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_live_driver_keeps_the_directory_and_a_dead_one_does_not(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run), "train", "recipe.yaml"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            with RunDirectoryLock(run):
                pass
        assert time.monotonic() - start < 1.0  # at once, not after a timeout
        message = str(caught.value)
        assert f"{run} is being written by another opd process (pid {holder.pid} on " in message
        assert "set run.output_dir to another directory. Nothing was changed." in message
        os.kill(holder.pid, signal.SIGKILL)  # the driver dies without cleaning up
        holder.wait(timeout=10)
        assert (run / LOCK_NAME).exists()  # its file is left behind...
        with RunDirectoryLock(run) as lock:  # ...and does not block the next driver
            assert f'"pid": {os.getpid()}' in (run / LOCK_NAME).read_text() and lock.file is not None
        with RunDirectoryLock(run):  # released on exit
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
