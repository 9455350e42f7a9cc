"""Checkpoints that prove themselves: atomic, hashed, and loaded without running code.

A checkpoint is written into ``checkpoints/.partial-step_N/`` and renamed to
``checkpoints/step_N/`` only once every file is on disk and the ``COMPLETE`` marker records the
driver's state and each file's size and SHA-256. A run killed at any moment therefore leaves
either a complete checkpoint or a partial directory that resume ignores and the next save
clears; a file damaged or swapped afterwards no longer matches its record, and resume
(:func:`verified_checkpoints`) falls back to the newest checkpoint that still verifies, saying
which it skipped and why.

DeepSpeed stores its state with ``torch.save`` (pickle). :func:`safe_torch_load` makes every
``torch.load`` inside it weights-only: tensors, containers and the few DeepSpeed data classes in
:data:`ALLOWED_GLOBALS`, nothing that runs code. A crafted pickle is refused with
:class:`CheckpointError` instead of executed.

Layout::

    checkpoints/step_N/ds/        DeepSpeed state for exact resume (weights, optimizer, scheduler)
    checkpoints/step_N/hf/        HF export: config.json, model.safetensors, tokenizer
    checkpoints/step_N/COMPLETE   JSON: {"state": driver state, "files": {path: {bytes, sha256}}}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

_STEP_DIR = re.compile(r"^step_(\d+)$")
MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used; the message names the file and what is wrong."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_manifest(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes": size, "sha256": digest}}`` of every file under ``root``,
    fsynced on the way (the manifest vouches for what is on disk)."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(root).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    return files


def save_checkpoint(run_dir: Path, step: int, write_state: Callable[[str], None], driver_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep`` complete ones.

    Args:
        run_dir: the run directory.
        step: the number of completed training steps.
        write_state: writes the trainer's files into the directory it is given.
        driver_state: JSON-safe state of the driver, stored in the ``COMPLETE`` marker.
        keep: complete checkpoints to keep (at least 1).
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f".partial-step_{step}"
    final = root / f"step_{step}"
    partial.mkdir()
    try:
        write_state(str(partial))
        marker = {"state": driver_state, "files": file_manifest(partial)}
        atomic_write_text(partial / MARKER, json.dumps(marker))
    except Exception as exc:  # a kill (or Ctrl-C) leaves the partial directory: the next save clears it
        written, free = tree_bytes(partial), shutil.disk_usage(root).free
        shutil.rmtree(partial, ignore_errors=True)  # never a half-written checkpoint, and its space back
        # A full disk by its errno or text, or by the disk itself: torch.save reports one as
        # "PytorchStreamWriter failed writing file", naming no cause.
        if out_of_space(exc) or free < 2**20:
            raise OutOfSpaceError(out_of_space_message(run_dir, step, written)) from exc
        raise
    if final.exists():  # an older copy of the same step (a resumed run repeating it)
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in complete_checkpoints(run_dir)[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class OutOfSpaceError(CheckpointError):
    """A checkpoint save ran out of disk space; the message gives the bytes needed and free."""


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 where it is gone)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc``, or what it wraps (a role's error carries the actor's as ``cause``), is a
    full disk (``ENOSPC``, or its text where a library re-raised it as another type)."""
    import errno

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        one = todo.pop()
        if one is None or id(one) in seen:
            continue
        seen.add(id(one))
        if getattr(one, "errno", None) == errno.ENOSPC or "No space left on device" in str(one):
            return True
        todo += [getattr(one, "cause", None), one.__cause__, one.__context__]
    return False


def out_of_space_message(run_dir: Path, step: int, written: int) -> str:
    """What a save that ran out of space says: where, the bytes a checkpoint takes (the last
    complete one's size, else at least what was written) and the bytes free, what is intact."""
    root = Path(run_dir) / "checkpoints"
    last = complete_checkpoints(Path(run_dir))
    needed = f"about {_size(tree_bytes(last[-1]))} (the size of {last[-1].name})" if last else \
        f"more than {_size(written)} (written before the disk filled)"
    free = shutil.disk_usage(root).free
    kept = f"the last complete checkpoint, {last[-1]}, is intact" if last else "there is no complete checkpoint yet"
    return (f"no space left on the device of {root} while saving checkpoint step_{step}: a checkpoint takes {needed}, "
            f"{_size(free)} are free. The partial save was removed; {kept}. Free space there (or lower "
            "run.keep_checkpoints, or move run.output_dir), then resume.")


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def estimated_checkpoint_bytes(model_dir: Path) -> int | None:
    """About what one checkpoint of a student in ``model_dir`` takes: its weights twice (the HF
    export and the engine's module states) and three float32 copies for AdamW (master weights,
    two moments); None where the directory holds no safetensors to measure."""
    files = list(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    weights = sum(f.stat().st_size for f in files)
    try:
        dtype = json.loads((Path(model_dir) / "config.json").read_text()).get("torch_dtype") or "float32"
    except (OSError, ValueError):
        dtype = "float32"
    per_value = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype), 4)
    return 2 * weights + 3 * weights * 4 // per_value


def too_little_space(run_dir: Path, model_dir: Path) -> str | None:
    """Why ``run_dir`` (or, before it exists, the directory it will be made in) cannot hold one
    checkpoint of the student in ``model_dir`` (:func:`estimated_checkpoint_bytes` against the
    bytes free), or None where it can or the size cannot be told."""
    needed = estimated_checkpoint_bytes(model_dir)
    where = Path(run_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed is None or free >= needed:
        return None
    return (f"too little space in {run_dir} for one checkpoint: it takes about {_size(needed)} (the student's "
            f"weights twice and AdamW's three float32 copies), {_size(free)} are free. Free space there or set "
            "run.output_dir elsewhere.")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints that have a ``COMPLETE`` marker (not yet verified), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The driver state of checkpoint ``path`` once its marker parses and every file it lists
    has the recorded size and hash.

    Raises:
        CheckpointError: naming the marker or the first file that does not match.
    """
    marker_path = path / MARKER
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{marker_path} is unreadable ({type(exc).__name__}: {exc}); a crash cut it short "
                              "or it was edited") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict) or not marker["files"] \
            or not isinstance(marker.get("state"), dict) or not isinstance(marker["state"].get("step"), int):
        raise CheckpointError(f"{marker_path} holds {json.dumps(marker)[:80]}, not a checkpoint record "
                              '({"state": {"step": N, ...}, "files": {...}}); it was written by another tool or edited')
    for name, record in marker["files"].items():
        file = path / name
        if not isinstance(record, dict) or not file.resolve().is_relative_to(path.resolve()):
            raise CheckpointError(f"{marker_path}: entry {name!r} is not a file record inside the checkpoint")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != record.get("bytes"):
            raise CheckpointError(f"{file} has {size} bytes, {record.get('bytes')} were written (truncated or replaced)")
        if _sha256(file) != record.get("sha256"):
            raise CheckpointError(f"{file} does not match its SHA-256 recorded at save time (altered since)")
    return marker["state"]


def verified_checkpoints(run_dir: Path) -> Iterator[tuple[Path, dict[str, Any] | None, str]]:
    """Newest first: ``(path, driver state, "")`` for a checkpoint that verifies, ``(path, None,
    reason)`` for one that does not (the caller says it skips it)."""
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            yield path, verify_checkpoint(path), ""
        except CheckpointError as exc:
            yield path, None, str(exc)


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, and its driver state, or None."""
    for path, state, _ in verified_checkpoints(run_dir):
        if state is not None:
            return path, state
    return None


EXPORT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")


def export_model(run_dir: Path, out: Path, step: int | None = None) -> tuple[int, list[str]]:
    """Copy checkpoint ``step`` (default: the newest that verifies) of ``run_dir`` out as a
    standard Hugging Face model directory ``out``: safetensors weights (gathered from the ZeRO
    shards when the checkpoint was saved), config, generation config, tokenizer and chat
    template; for a LoRA student that is the merged model, and ``out/adapter`` holds the adapters
    alone (``peft``'s directory: ``PeftModel.from_pretrained(base, out / "adapter")``). The
    checkpoint is verified against its recorded hashes first; ``out`` appears whole (written under
    a partial name, then renamed). Returns the step and the files written.

    Raises:
        CheckpointError: no such checkpoint, one that does not verify, an export missing a file,
            or an ``out`` that already holds files.
    """
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already holds files; export into a new directory")
    found = [(path, state, reason) for path, state, reason in verified_checkpoints(run_dir)]
    if not found:
        raise CheckpointError(f"{run_dir} holds no complete checkpoint (looked in {run_dir / 'checkpoints'})")
    if step is None:
        good = next(((path, state) for path, state, _ in found if state is not None), None)
        if good is None:
            raise CheckpointError(f"no checkpoint of {run_dir} verifies: " + "; ".join(f"{p.name}: {r}" for p, _, r in found))
        path, state = good
    else:
        match = [(p, s, r) for p, s, r in found if p.name == f"step_{step}"]
        if not match:
            raise CheckpointError(f"{run_dir} has no complete checkpoint of step {step} (it has "
                                  f"{', '.join(p.name for p, _, _ in found)})")
        path, state, reason = match[0]
        if state is None:
            raise CheckpointError(f"{path} does not verify: {reason}")
    source = path / "hf"
    missing = [name for name in EXPORT_FILES if not (source / name).is_file()]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)}: this checkpoint predates the full export")
    partial = out.with_name(f".partial-{out.name}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    if (path / "adapter").is_dir():  # a LoRA student's adapters (opd.training.lora.ADAPTER_DIR)
        shutil.copytree(path / "adapter", partial / "adapter")
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(partial, out)
    return int(state["step"]), sorted(p.name for p in out.iterdir())


def _allowed_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed's checkpoints pickle (ZeRO 0-3, fp32 and bf16): plain data
    holders whose unpickling sets fields and runs no code of the file's choosing. And, under the
    name ``builtins.getattr``, :func:`_enum_member`: Python 3.11.0 to 3.11.4 (Debian 12's 3.11.2,
    the image's) pickle an enum member as ``getattr(ZeroStageEnum, "optimizer_states")``."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address, (_enum_member, "builtins.getattr")]


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as a weights-only load allows it: a member of an allowed enum, by name, and
    nothing else (no attribute of any other object)."""
    import enum

    from deepspeed.runtime.zero.config import ZeroStageEnum

    if cls in (ZeroStageEnum,) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    what = cls.__name__ if isinstance(cls, type) else type(cls).__name__
    kind = "enum" if isinstance(cls, type) and issubclass(cls, enum.Enum) else "object"
    raise pickle.UnpicklingError(f"GLOBAL getattr({what}, {name!r}) reaches past the allowed enum members "
                                 f"(an {kind} attribute)")


@contextlib.contextmanager
def safe_torch_load() -> Iterator[None]:
    """Every ``torch.load`` inside is weights-only with :func:`_allowed_globals`, whatever its
    caller passes (DeepSpeed passes ``weights_only=False``)."""
    import torch

    saved = {key: os.environ.pop(key, None) for key in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _pickle_reason(message: str) -> str:
    lines = [line for line in message.splitlines() if line.strip() and "weights_only" not in line
             and "Weights only" not in line and "documentation" not in line]
    return (lines[0] if lines else message.splitlines()[0])[:200]


def check_pickles(directory: Path) -> None:
    """Open every ``*.pt`` under ``directory`` weights-only (memory-mapped, so nothing is read
    twice in full) before DeepSpeed does, so that a refusal names its file.

    Raises:
        CheckpointError: a file holds objects outside the allow-list, or is not a torch file.
    """
    import torch

    with safe_torch_load():
        for file in sorted(directory.rglob("*.pt")):
            try:
                torch.load(file, map_location="cpu", mmap=True)
            except pickle.UnpicklingError as exc:
                found = re.search(r"GLOBAL ([\w.]+)", str(exc))
                what = f"it names {found.group(1)}" if found else _pickle_reason(str(exc))
                raise CheckpointError(f"{file} holds a pickled object outside the weights-only allow-list ({what}); "
                                      "it was not loaded. Someone or something other than opd wrote this file; "
                                      "do not trust this run directory's checkpoints") from None
            except (RuntimeError, OSError, EOFError, ValueError) as exc:
                raise CheckpointError(f"{file} is not a readable torch file ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0][:200]})") from None
