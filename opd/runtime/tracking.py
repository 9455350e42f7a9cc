"""Where a run's metrics go: ``metrics.jsonl`` (:class:`MetricsLog`), tensorboard always, Weights &
Biases and MLflow when the recipe asks (``logging.wandb_project``, ``logging.mlflow``; docs/logging.md).

Everything stays in the run directory and nothing needs the network unless the recipe says
``logging.wandb_mode: online``:

- ``tb/``: tensorboard event files;
- ``wandb/offline-run-*/``: the wandb run's transaction log, uploaded later with ``wandb sync``;
- ``mlruns/``: an MLflow file store, experiment = the recipe's ``name``, params = the resolved
  recipe flattened to dotted keys, one metric series per scalar;
- ``tracking_ids.json``: the wandb and MLflow run ids, so that ``--resume`` continues the same
  runs instead of starting new ones.

A backend that the recipe asks for but that is not installed is a :class:`ConfigError` at
construction, so a run fails before it trains, not at its first log call.

Example::

    trackers = Trackers(run_dir, cfg, resumed_step=None)
    trackers.log(1, {"loss": 0.5, "eval/student_success": 0.25, "note": "skipped: not a number"})
    trackers.close({"steps": 1})
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from opd.config import flatten, to_yaml
from opd.evaluation.run_dir import METRICS_FILE, parse_metrics_line
from opd.optional import optional_module
from opd.schema import ConfigError, OPDConfig
from opd.training.checkpoint import atomic_write_text

__all__ = ["IDS_FILE", "MetricsLog", "Trackers", "require_backends", "scalars"]

IDS_FILE = "tracking_ids.json"
_INSTALL = "`pip install {package}` (or `pip install -e .[tracking]`)"
# MLflow's rules for metric and param names (mlflow.utils.validation): anything else is refused.
_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- :]")
_MLFLOW_KEY_CHARS = 250
_MLFLOW_BATCH = 100  # log_batch takes at most 100 params and 1000 metrics per call


def scalars(record: dict[str, Any]) -> dict[str, int | float]:
    """The entries of ``record`` that are plottable numbers: ints and floats, not bools (a bool is
    an int to Python but a flag to a reader), non-finite values included."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    """tensorboard always; wandb when ``cfg.logging.wandb_project`` is set; MLflow when
    ``cfg.logging.mlflow``.

    Args:
        run_dir: the run directory (``run.output_dir``).
        cfg: the validated config (:func:`opd.config.load_config`).
        resumed_step: the step of the checkpoint a ``--resume`` continues from, or None for a fresh
            run. A resumed run reuses the run ids in ``tracking_ids.json``; a fresh one gets new ones.
        log: one line to the console per backend that writes somewhere worth knowing.

    Raises:
        ConfigError: a backend the recipe asks for is not installed, or wandb online cannot start.
    """

    def __init__(self, run_dir: Path, cfg: OPDConfig, resumed_step: int | None, log: Callable[[str], Any] = print):
        self.run_dir = Path(run_dir)
        self._print = log
        self._closed = False
        self._wandb_run: Any = None
        self._mlflow: Any = None  # (client, run_id)
        wandb, mlflow_tracking = require_backends(cfg)  # before any file is written
        ids = _read_ids(self.run_dir) if resumed_step is not None else {}

        tensorboard = optional_module("torch.utils.tensorboard", "the tb/ event files (metrics.jsonl has every value)",
                                      "tensorboard")
        self._tb = tensorboard.SummaryWriter(str(self.run_dir / "tb")) if tensorboard is not None else None
        try:
            if wandb is not None:
                ids["wandb"] = ids.get("wandb") or uuid.uuid4().hex[:12]
                self._wandb_run = _start_wandb(wandb, self.run_dir, cfg, ids["wandb"], log)
            if mlflow_tracking is not None:
                client, ids["mlflow"] = _start_mlflow(mlflow_tracking, self.run_dir, cfg, ids.get("mlflow"), log)
                self._mlflow = (client, ids["mlflow"])
        except BaseException:
            self.close(failed=True)
            raise
        if ids:
            atomic_write_text(self.run_dir / IDS_FILE, json.dumps(ids, indent=2) + "\n")

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Log every int/float (not bool) entry of ``record`` at ``step``; other entries are
        skipped. NaN and infinity are logged as such by all three backends.

        wandb and MLflow are extras: one that fails (a full disk, a store removed under it, a lost
        connection) is switched off for the rest of the run with one console line, and the run
        goes on, since ``metrics.jsonl`` and tensorboard still hold every step."""
        values = scalars(record)
        if not values:
            return
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb_run is not None:
            try:
                self._wandb_run.log(values, step=step)
            except Exception as exc:  # noqa: BLE001 -- any failure of an optional backend
                self._wandb_run = None
                self._print(f"[yellow]wandb failed at step {step} and is off for the rest of the run[/]: {exc!r}")
        if self._mlflow is not None:
            try:
                _mlflow_log(*self._mlflow, step, values)
            except Exception as exc:  # noqa: BLE001
                self._mlflow = None
                self._print(f"[yellow]mlflow failed at step {step} and is off for the rest of the run[/]: {exc!r}")

    def close(self, summary: dict[str, Any] | None = None, failed: bool = False) -> None:
        """Finish every run: the summary goes to wandb's run summary and to MLflow as the artifact
        ``summary.json``; ``failed`` marks the runs failed (wandb exit code 1, MLflow ``FAILED``).
        Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            if summary:
                self._wandb_run.summary.update(json.loads(json.dumps(summary, default=str)))
            self._wandb_run.finish(exit_code=1 if failed else 0)
        if self._mlflow is not None:
            client, run_id = self._mlflow
            if summary:
                client.log_text(run_id, json.dumps(summary, indent=2, default=str), "summary.json")
            client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")


class MetricsLog:
    """``metrics.jsonl`` plus :class:`Trackers` (tensorboard; wandb and MLflow when the recipe
    asks). On resume, lines past the checkpoint are dropped so the file reads as one
    uninterrupted run, and the trackers continue the same runs.

    Args:
        run_dir: the run directory.
        keep_until_step: the step of the checkpoint a ``--resume`` continues from, or None for a
            fresh run (whose directory may hold an earlier log, which is kept aside).
        cfg: the validated config.
        log: where the trackers' lines go.
    """

    def __init__(self, run_dir: Path, keep_until_step: int | None, cfg: OPDConfig, log: Callable[[str], Any] = print):
        self.path = run_dir / METRICS_FILE
        if keep_until_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if (record := parse_metrics_line(line)) is not None and record["step"] <= keep_until_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        elif keep_until_step is None and self.path.exists():
            # A fresh start in a directory whose earlier run never reached a checkpoint: keep
            # that run's log beside the new one rather than deleting it.
            self.path.rename(self.path.with_name(f"metrics.{int(time.time())}.jsonl"))
        self.trackers = Trackers(run_dir, cfg, resumed_step=keep_until_step, log=log)

    def write(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")
        self.trackers.log(step, record)

    def close(self, summary: dict[str, Any] | None = None, failed: bool = False) -> None:
        self.trackers.close(summary, failed=failed)


def require_backends(cfg: OPDConfig) -> tuple[Any, Any]:
    """Import the backends the recipe asks for: ``(wandb or None, mlflow.tracking or None)``.

    The driver calls it before setup, so that a missing package fails the run in a second rather
    than after the models are built; :class:`Trackers` calls it again (imports are cached).

    Raises:
        ConfigError: naming the key, the package and the install command.
    """
    wandb = _require("wandb", "wandb", f"logging.wandb_project ({cfg.logging.wandb_project!r})",
                     "remove logging.wandb_project") if cfg.logging.wandb_project else None
    mlflow_tracking = _require("mlflow.tracking", "mlflow-skinny", "logging.mlflow (true)",
                               "set logging.mlflow=false") if cfg.logging.mlflow else None
    return wandb, mlflow_tracking


def _require(module: str, package: str, key: str, undo: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:  # also what a package set to None in sys.modules raises
        raise ConfigError(f"key {key} needs the {package} package, which is not installed: "
                          f"{_INSTALL.format(package=package)}, or {undo}.") from None


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def _recipe(cfg: OPDConfig) -> dict[str, Any]:
    """The resolved recipe as plain data, exactly as written to ``config.yaml``."""
    import yaml

    return yaml.safe_load(to_yaml(cfg))


def _start_wandb(wandb: Any, run_dir: Path, cfg: OPDConfig, run_id: str, log: Callable[[str], Any]) -> Any:
    mode = cfg.logging.wandb_mode
    # The console is the CLI's (a progress bar and one line per event): wandb's banner, its
    # end-of-run history and its capture of stdout would interleave with it. WANDB_SILENT also
    # covers what wandb prints before it reads the settings.
    os.environ.setdefault("WANDB_SILENT", "true")
    if mode == "offline":
        # Offline means no network at all: no crash reports or usage telemetry either.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        run = wandb.init(
            project=cfg.logging.wandb_project, dir=str(run_dir), mode=mode, name=cfg.name, config=_recipe(cfg),
            id=run_id, resume="allow",
            # create_new: this run is driven through its handle only, never the global wandb.run,
            # so a second Trackers in the same process (tests, notebooks) does not reuse this one.
            settings=wandb.Settings(silent=True, console="off", reinit="create_new"),
        )
    except wandb.errors.Error as exc:
        raise ConfigError(f"key 'logging.wandb_mode' ({mode!r}): wandb could not start the run: {exc}. "
                          "Log in first (`wandb login`, or set WANDB_API_KEY), or set logging.wandb_mode=offline "
                          "and upload later with `wandb sync`.") from None
    sync_dir = run.settings.sync_dir
    if mode == "offline":
        log(f"wandb: offline run {run.id} in {sync_dir}; upload it with `wandb sync {sync_dir}`")
    else:
        log(f"wandb: {run.url} (local files in {sync_dir})")
    return run


def _start_mlflow(mlflow_tracking: Any, run_dir: Path, cfg: OPDConfig, run_id: str | None,
                  log: Callable[[str], Any]) -> tuple[Any, str]:
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    # MLflow 3 keeps the file store in maintenance mode and refuses it unless this is set. A file
    # store needs no server and no database package (mlflow-skinny suffices), and it lives inside
    # the run directory, so it is the right store for a run that must work offline.
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    store = (run_dir / "mlruns").resolve()
    client = mlflow_tracking.MlflowClient(tracking_uri=store.as_uri())
    if run_id is not None:
        try:
            client.update_run(run_id, status="RUNNING")
            log(f"mlflow: resumed run {run_id} in {store}")
            return client, run_id
        except MlflowException:
            pass  # the store was removed or never held this run: start a new one
    experiment = client.get_experiment_by_name(cfg.name)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(cfg.name)
    run = client.create_run(experiment_id, run_name=cfg.name)
    limit = _mlflow_param_chars()
    # Params only when the run is created: MLflow refuses to change a param's value, and a resumed
    # run may change a few keys (driver.RESUMABLE_KEYS).
    params = [Param(_mlflow_key(k), str(v)[:limit]) for k, v in flatten(_recipe(cfg)).items()]
    for start in range(0, len(params), _MLFLOW_BATCH):
        client.log_batch(run.info.run_id, params=params[start:start + _MLFLOW_BATCH])
    log(f"mlflow: run {run.info.run_id} in {store}; browse with `mlflow ui --backend-store-uri {store}`")
    return client, run.info.run_id


def _mlflow_log(client: Any, run_id: str, step: int, values: dict[str, int | float]) -> None:
    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    metrics = [Metric(_mlflow_key(k), float(v), now_ms, step) for k, v in values.items()]
    for start in range(0, len(metrics), _MLFLOW_BATCH):
        client.log_batch(run_id, metrics=metrics[start:start + _MLFLOW_BATCH])


def _mlflow_param_chars() -> int:
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    except ImportError:  # an MLflow that moved it: its oldest limit is safe everywhere
        return 500
    return MAX_PARAM_VAL_LENGTH


def _mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: characters it refuses become ``_``, and ``/``
    becomes ``.``. MLflow allows ``/``, but its file store makes each one a folder, so ``loss``
    (a file) and ``loss/reverse_kl`` (a file in a folder ``loss``), both in a step's record,
    could not both be stored. Leading dots would make a name MLflow reads as a path: dropped."""
    key = _MLFLOW_BAD_CHARS.sub("_", key).replace("/", ".").lstrip(".")
    return key[:_MLFLOW_KEY_CHARS] or "_"
