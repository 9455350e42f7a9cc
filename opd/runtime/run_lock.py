"""One driver per run directory: a second ``opd train`` pointed at a directory that a live driver
is writing (a resume started by mistake beside the run, a job resubmitted while the first still
runs) is refused at once, naming the other process, instead of loading a checkpoint the first is
rotating.

The lock is an advisory ``flock`` on ``RUN_DIR/.opd.lock``, held from the start of ``train`` to
its end: the kernel releases it when the holding process ends, however it ends (SIGKILL
included), so a lock left by a dead driver never blocks a resume. The file names its holder (pid,
host, start time, command) for the message. ``flock`` is per machine: on a filesystem shared by
several machines it guards drivers on the same machine only (NFS may not support it at all;
then the lock is skipped with a warning).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from rich.markup import escape

from opd.config import ConfigError

__all__ = ["LOCK_NAME", "RunDirectoryLock"]

LOCK_NAME = ".opd.lock"


class RunDirectoryLock:
    """``with RunDirectoryLock(run_dir):`` the run directory is this process's, or a
    :class:`~opd.config.ConfigError` says whose it is (the user's to resolve, like a recipe
    error: nothing is written there, not even an ``error.log``)."""

    def __init__(self, run_dir: Path, log: Callable[[str], None] = print):
        self.path = Path(run_dir) / LOCK_NAME
        self.log = log
        self.file: TextIO | None = None

    def __enter__(self) -> "RunDirectoryLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = _describe(file.read())
            file.close()
            raise ConfigError(f"{self.path.parent} is being written by another opd process ({holder}); wait for it "
                              "to end (or stop it), or set run.output_dir to another directory. Nothing was changed.") \
                from None
        except OSError as exc:  # a filesystem without flock (some NFS mounts): run unguarded, and say so
            self.log(f"[yellow]warning:[/] cannot lock {self.path} ({escape(str(exc))}); nothing stops a second driver from "
                     "writing this run directory at the same time")
            file.close()
            return self
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                               "command": shlex.join(sys.argv)}))
        file.flush()
        self.file = file
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


def _describe(text: str) -> str:
    """The holder named in a lock file: pid, host, since when and its command."""
    try:
        holder = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        return f"pid {holder['pid']} on {holder['host']}, since {started}: {holder['command']}"
    except (ValueError, KeyError, TypeError):
        return "a process that did not say who it is"
