"""Packages a run can do without: what it skips when one is missing, said once.

``opd`` declares every package it uses, so an install from ``setup.cfg`` has them all. A bare
machine may not: a GPU node with only torch and transformers and the project's small
pure-Python dependencies copied beside them (``scripts/gpu_check.py``'s case). There a run still
trains, evaluates and checkpoints; what needs a missing package is skipped with one console
line naming the package, what is lost and how to get it:

=================  =============================================================================
``tensorboard``    the ``tb/`` event files (``metrics.jsonl`` has every value)
``matplotlib``     ``report.png`` (``opd report`` draws its own SVG curves)
``pyarrow``        ``trajectories/*.parquet`` (the episodes ``opd report`` shows)
=================  =============================================================================

Example:
    >>> optional_module("json", "nothing") is not None
    True
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger("opd")
_SAID: set[str] = set()


def optional_module(name: str, lost: str, package: str = "") -> ModuleType | None:
    """``import name``, or None after one warning (per package, per process) that ``lost`` is
    skipped and ``pip install package`` (default: the module's top-level name) brings it back."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        package = package or name.split(".")[0]
        if package not in _SAID:
            _SAID.add(package)
            log.warning("%s cannot be imported (%s): %s skipped; pip install %s (setup.cfg declares it)", package, exc,
                        lost, package)
        return None
