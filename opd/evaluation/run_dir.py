"""Reading a run directory: the one place that knows what its files hold and how to parse them.

A run (``opd train``) writes, under ``run.output_dir``, ``config.yaml`` (the resolved recipe),
``metrics.jsonl`` (one JSON record per training step, and one per held-out evaluation; a kill can
leave its last line cut short), ``summary.json`` (when the run finished), ``checkpoints/step_N/``,
``trajectories/*.parquet`` (:mod:`opd.evaluation.trajectories`) and, after ``opd eval`` and
``opd compare``, ``eval/*.json``. :class:`RunDir` reads each of them; ``opd report``, ``opd eval``,
the driver's summary, the benchmarks and the scripts read a run through it, not by hand.

Example:
    >>> run = RunDir("runs/quickstart")  # doctest: +SKIP
    >>> [r["time/step_s"] for r in run.steps()][:2]  # doctest: +SKIP
    [2.31, 2.05]
    >>> run.summary()["student_success_after"]  # doctest: +SKIP
    0.68
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STEP_TIME_KEY = "time/step_s"  # a training step's record has it; an evaluation's does not
# The phases every step reports (opd.algorithms.step.StepClock), averaged in the summary's time split.
TIME_PHASES = ("generation", "teacher_scoring", "training", "weight_sync")


def parse_metrics_line(line: str) -> dict[str, Any] | None:
    """One line of ``metrics.jsonl`` as its record, or ``None`` for a line that is not one: blank,
    cut short by a kill, or without a finite numeric ``step``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return record


def read_json(path: Path) -> Any:
    """The JSON document at ``path``, or ``None`` when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


class RunDir:
    """The files of one run directory, read on demand (nothing is cached: a run that is still
    training shows its newest lines).

    Args:
        path: the run directory (``run.output_dir``).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def is_run(self) -> bool:
        """Whether ``opd train`` has written here (``metrics.jsonl`` exists)."""
        return (self.path / METRICS_FILE).is_file()

    def config(self) -> dict[str, Any]:
        """``config.yaml`` as plain containers; ``{}`` when it is missing or unreadable."""
        import yaml

        try:
            config = yaml.safe_load((self.path / CONFIG_FILE).read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return config if isinstance(config, dict) else {}

    def metrics(self) -> list[dict[str, Any]]:
        """Every record of ``metrics.jsonl`` in the order written (lines that do not parse are
        skipped: :func:`parse_metrics_line`); ``[]`` before the first."""
        path = self.path / METRICS_FILE
        if not path.is_file():
            return []
        return [record for line in path.read_text().splitlines() if (record := parse_metrics_line(line)) is not None]

    def steps(self) -> list[dict[str, Any]]:
        """The training steps' records (each has ``time/step_s``), in step order."""
        return [record for record in self.metrics() if STEP_TIME_KEY in record]

    def evaluations(self) -> list[dict[str, Any]]:
        """The records that hold held-out figures (``eval/...`` keys): step 0's, the ones every
        ``run.eval_every_steps`` and the last step's."""
        return [record for record in self.metrics() if any(key.startswith("eval/") for key in record)]

    def series(self, key: str) -> list[tuple[float, float]]:
        """``(step, value)`` of every record with a finite number under ``key``."""
        return [(float(r["step"]), float(r[key])) for r in self.metrics()
                if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]

    def time_split(self) -> dict[str, float]:
        """The mean seconds per training step of each phase and of the whole step
        (``generation_s_per_step`` ... ``step_s_per_step``)."""
        steps = self.steps()
        keys = [f"time/{phase}_s" for phase in TIME_PHASES] + [STEP_TIME_KEY]
        return {key.split("/")[1].removesuffix("_s") + "_s_per_step": sum(r.get(key, 0.0) for r in steps) / max(len(steps), 1)
                for key in keys}

    def summary(self) -> dict[str, Any] | None:
        """``summary.json`` (written when a run finishes), or ``None``."""
        summary = read_json(self.path / SUMMARY_FILE)
        return summary if isinstance(summary, dict) else None

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints, oldest first (not verified: :func:`opd.training.checkpoint.verify_checkpoint`)."""
        from opd.training.checkpoint import complete_checkpoints

        return complete_checkpoints(self.path)

    def episode_files(self) -> list[Path]:
        """``trajectories/*.parquet``, by step then name (:func:`opd.evaluation.trajectories.read_episodes`)."""
        from opd.evaluation.trajectories import run_episode_files

        return run_episode_files(self.path)

    def eval_results(self) -> list[tuple[Path, dict[str, Any]]]:
        """``(path, result)`` of each ``eval/*.json`` that parses: ``opd eval``'s grids and ``opd
        compare``'s comparisons (``compare_*.json``), in the order they were written (``before``
        then ``after``, not by name)."""
        found = []
        for path in sorted((self.path / "eval").glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name)):
            data = read_json(path)
            if isinstance(data, dict):
                found.append((path, data))
        return found
