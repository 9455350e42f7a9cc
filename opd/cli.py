"""The ``opd`` command.

    opd train RECIPE [key=value ...] [--resume]   train; overrides use dotted keys
    opd check RECIPE [key=value ...]              validate a recipe without running it
    opd envs [--module M]                         list the registered environments (and M's)
    opd eval SOURCE [key=value ...]               pass@k over a turn-budget grid, without training
    opd compare A B [key=value ...]               matched-state comparison of two policies' next actions
    opd report RUN_DIR                            one self-contained report.html with a trajectory viewer
    opd references build RECIPE [key=value ...]   build ActFirst's reference trajectories once
    opd verify RUN_DIR                            check every checkpoint's files against their hashes

A SOURCE (``opd eval``, ``opd compare``) is a run directory (its newest checkpoint; ``RUN_DIR@N``
step N's, ``RUN_DIR@0`` the starting student, ``RUN_DIR@teacher`` its teacher), a model directory
(with ``--recipe``) or a recipe (``RECIPE.yaml@student``, the default, or ``@teacher``); see
:mod:`opd.runtime.offline`.

Predictable mistakes (a bad recipe, a missing model, a run directory that already holds a
run) print one clear message and exit with status 2. Anything else that stops a command prints
what failed, in which role, the last complete checkpoint and the command to resume, exits with
status 1, and writes the full traceback (the actor's own, for a failure inside a Ray actor) to
the run directory's ``error.log``: never a traceback on the console.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _escape(text: object) -> str:
    """``text`` shown as written by rich (an error's ``[...]``, a path in brackets, is not markup)."""
    from rich.markup import escape

    return escape(str(text))


def _quiet_libraries() -> None:
    # DeepSpeed, Ray and transformers are chatty at import; the run's own lines should stand out.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars (opd eval)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opd", description="On-policy distillation of multi-turn LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="train a student with a recipe")
    train_p.add_argument("recipe")
    train_p.add_argument("overrides", nargs="*", help="key=value, e.g. run.total_steps=10")
    train_p.add_argument("--resume", action="store_true", help="continue from the run directory's last complete checkpoint")
    check_p = sub.add_parser("check", help="validate a recipe and print the resolved config")
    check_p.add_argument("recipe")
    check_p.add_argument("overrides", nargs="*")
    envs_p = sub.add_parser("envs", help="list registered environments")
    envs_p.add_argument("--module", action="append", default=[],
                        help="import this module first (one that registers your environments, as env.module does)")
    eval_p = sub.add_parser("eval", help="evaluate a policy: pass@k over a turn-budget grid, without training")
    eval_p.add_argument("source", help="RUN_DIR[@N|@teacher], MODEL_DIR (with --recipe) or RECIPE.yaml[@student|@teacher]")
    eval_p.add_argument("overrides", nargs="*", help="key=value on the recipe, e.g. env.eval_split=train")
    eval_p.add_argument("--recipe", help="the recipe to evaluate under (default: the run's own config.yaml)")
    eval_p.add_argument("--step", type=int, help="a run directory's checkpoint step (0: the starting student); "
                        "same as RUN_DIR@N")
    eval_p.add_argument("--samples", type=int, default=8, help="episodes per task and budget: pass@k for k = 1..n")
    eval_p.add_argument("--budgets", default=None,
                        help="fractions of the environment's turn budget, e.g. 0.25,0.5,1 (default: the expert's shortest "
                        "and median solution and the whole budget, where the environment has an expert; else 0.25,0.5,1)")
    eval_p.add_argument("--temperature", type=float, help="sampling temperature (default: the recipe's rollout.temperature)")
    eval_p.add_argument("--tasks", type=int, help="number of tasks (default: run.eval_episodes)")
    eval_p.add_argument("--split", help="task split (default: env.eval_split)")
    eval_p.add_argument("--name", help="result name: eval/<name>.json (default: from the source)")
    eval_p.add_argument("--out", help="results directory (default: the run directory's eval/)")
    eval_p.add_argument("--batch", type=int, default=32, help="episodes per engine call")
    cmp_p = sub.add_parser("compare", help="matched-state comparison of two policies' next actions")
    cmp_p.add_argument("a", help="policy A (a SOURCE as for opd eval)")
    cmp_p.add_argument("b", help="policy B")
    cmp_p.add_argument("overrides", nargs="*", help="key=value on the recipe")
    cmp_p.add_argument("--recipe", help="the recipe both are evaluated under (default: A's)")
    cmp_p.add_argument("--reference", default="a", help="where the states come from: a, b (their greedy episodes), expert (the environment's), "
                       "or an episodes .parquet file")
    cmp_p.add_argument("--judge", choices=["expert", "rollouts"], default="expert",
                       help="expert: the environment's expert plays on after each action; rollouts: A continues")
    cmp_p.add_argument("--rollouts", type=int, default=4, help="continuations per action with --judge rollouts")
    cmp_p.add_argument("--tasks", type=int, help="reference episodes (default: run.eval_episodes)")
    cmp_p.add_argument("--split", help="task split (default: env.eval_split)")
    cmp_p.add_argument("--name", help="result name: eval/compare_<name>.json")
    cmp_p.add_argument("--out", help="results directory (default: B's run directory's eval/)")
    report_p = sub.add_parser("report", help="write RUN_DIR/report.html: curves, evaluation tables, trajectory viewer")
    report_p.add_argument("run_dir")
    report_p.add_argument("--out", help="the HTML file (default: RUN_DIR/report.html)")
    refs_p = sub.add_parser("references", help="ActFirst reference trajectories")
    refs_p.add_argument("action", choices=["build"])
    refs_p.add_argument("recipe")
    refs_p.add_argument("overrides", nargs="*")
    verify_p = sub.add_parser("verify", help="check a run directory's checkpoints against their recorded hashes")
    verify_p.add_argument("run_dir")
    export_p = sub.add_parser("export", help="a checkpoint as a Hugging Face model directory (safetensors, config, "
                                            "tokenizer, chat template)")
    export_p.add_argument("run_dir")
    export_p.add_argument("out", help="the model directory to write (new, or empty)")
    export_p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest that verifies)")
    args, extra = parser.parse_known_args(argv)
    # key=value after an option (`opd eval RECIPE --tasks 20 rollout.temperature=0`) is an override
    # too; argparse alone takes overrides only before the first option.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # The user's own losses and environments in the current directory import by dotted path (the
    # Ray workers inherit this order); after the installed packages, so a file in the current
    # directory never shadows opd or one of its dependencies.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    _quiet_libraries()
    console = _console()

    from opd.config import ConfigError
    from opd.runtime.errors import RunError
    from opd.runtime.preemption import Preempted

    try:
        return _command(args, console)
    except ConfigError as exc:
        console.print(f"[bold red]error:[/] {_escape(exc)}", soft_wrap=True)
        return 2
    except Preempted as exc:  # SIGTERM: what was saved, and the way back; not a failure to log
        console.print(f"[yellow]preempted:[/] {_escape(exc)}", soft_wrap=True)
        console.print(f"resume with: {_escape(shlex.join(['opd', 'train', args.recipe, *args.overrides, '--resume']))}",
                      soft_wrap=True)
        return exc.exit_status
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the last complete checkpoint is intact; rerun with --resume")
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place every other failure becomes a message
        import bdb

        if isinstance(exc, bdb.BdbQuit):  # 'q' in pdb (run.backend: local): the user's own exit
            raise
        _report_failure(console, args, exc)
        return 2 if type(exc) is RunError else 1


def _command(args: argparse.Namespace, console: Any) -> int:
    from opd.config import ConfigError, load_config, to_yaml

    if args.command == "envs":
        import importlib

        from opd.envs import list_envs

        for module in args.module:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"--module {module}: cannot import it ({exc}); run from the directory that holds it, "
                                  "or install its package") from None
        for env_id, description in list_envs():
            console.print(f"{env_id:32s} {description}")
        return 0
    if args.command == "export":
        return _export(Path(args.run_dir), Path(args.out), args.step, console)
    if args.command == "verify":
        return _verify(Path(args.run_dir), console)
    if args.command == "report":
        from opd.evaluation.html_report import write_html_report
        from opd.evaluation.run_dir import RunDir

        if not RunDir(args.run_dir).is_run():
            raise ConfigError(f"{args.run_dir} is not a run directory (no metrics.jsonl)")
        out = write_html_report(Path(args.run_dir), Path(args.out) if args.out else None)
        console.print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB); open it in a browser, no network needed",
                      soft_wrap=True)
        return 0
    if args.command in ("eval", "compare"):
        from opd.runtime.offline import compare_command, evaluate_command

        if args.command == "eval":
            source = f"{args.source}@{args.step}" if args.step is not None else args.source
            evaluate_command(source, args.recipe, args.overrides, console, name=args.name, samples=args.samples,
                             budgets=_fractions(args.budgets), temperature=args.temperature, tasks=args.tasks,
                             split=args.split, out=args.out, batch=args.batch)
        else:
            compare_command(args.a, args.b, args.recipe, args.overrides, console, reference=args.reference,
                            judge=args.judge, rollouts=args.rollouts, tasks=args.tasks, split=args.split,
                            name=args.name, out=args.out)
        return 0
    cfg = load_config(args.recipe, args.overrides)
    args.run_dir = cfg.run.output_dir
    if args.command == "check":
        console.print(to_yaml(cfg))
        _check_student(cfg)
        _check_teacher_tokenizers(cfg)
        return 0
    if args.command == "references":
        from opd.rollout.references import build_references
        from opd.runtime.workers import local_teacher_player

        teacher = cfg.actfirst.reference_source == "teacher"
        build_references(cfg, log=console.log, teacher_play=local_teacher_player(cfg, console.log) if teacher else None)
        return 0
    from opd.runtime.driver import train

    train(cfg, resume=args.resume, console=console)
    return 0


def _check_student(cfg: Any) -> None:
    """``opd check``, where the student's model is on this machine already (``opd train`` checks
    again once it is built): room in ``run.output_dir`` for one checkpoint, and a LoRA student's
    target modules."""
    from opd.bootstrap import existing_model_path
    from opd.config import ConfigError
    from opd.training.checkpoint import too_little_space
    from opd.training.lora import check_model_dir

    student = existing_model_path(cfg.student, cfg.env, cfg.run.seed + 1)
    if student is None:
        return
    problem = too_little_space(Path(cfg.run.output_dir), student)
    if problem:
        raise ConfigError(problem)
    if cfg.student.lora.rank > 0:
        try:
            check_model_dir(student, list(cfg.student.lora.target_modules), bool(cfg.student.trust_remote_code))
        except ValueError as exc:
            raise ConfigError(f"{exc} (the student at {student})") from None


def _check_teacher_tokenizers(cfg: Any) -> None:
    """``opd check``: each teacher's tokenizer against the student's, where both models are on
    this machine already (``opd train`` checks every one once they are built or served)."""
    from opd.bootstrap import existing_model_path
    from opd.config import ConfigError
    from opd.mixture import DEFAULT_TEACHER, routes_of, teacher_env
    from opd.models import TokenizerMismatchError, check_tokenizers_match, load_tokenizer

    student = existing_model_path(cfg.student, cfg.env, cfg.run.seed + 1)
    if student is None or cfg.supervision.cross_tokenizer:
        return
    student_tok = None
    for name in routes_of(cfg, share_models=False).groups:
        key, section = (name, cfg.teacher) if name == DEFAULT_TEACHER else (f"teachers.{name}", cfg.teachers[name])
        if section.engine == "server" and not section.path:
            continue  # the server's tokenizer is compared with the student's at the run's start
        teacher = existing_model_path(section, teacher_env(cfg, name), cfg.run.seed)
        if teacher is None:
            continue
        student_tok = student_tok or load_tokenizer(str(student), cfg.student.trust_remote_code)
        try:
            check_tokenizers_match(student_tok, load_tokenizer(str(teacher), section.trust_remote_code))
        except TokenizerMismatchError as exc:
            raise ConfigError(f"keys 'student' ({student}) and '{key}' ({teacher}): {exc} Give them one tokenizer, or "
                              "set supervision.cross_tokenizer: true to align the two over text spans.") from None


def _fractions(text: str | None) -> list[float] | None:
    from opd.config import ConfigError

    if text is None:
        return None
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--budgets takes comma-separated fractions such as 0.25,0.5,1 (got {text!r})") from None


def _export(run_dir: Path, out: Path, step: int | None, console: Any) -> int:
    from opd.training.checkpoint import CheckpointError, export_model

    try:
        done, files = export_model(run_dir, out, step)
    except CheckpointError as exc:
        console.print(f"[bold red]error:[/] {_escape(exc)}", soft_wrap=True)
        return 2
    adapter = (f"; {out / 'adapter'} holds the LoRA adapters alone (PeftModel.from_pretrained(base, "
               f"'{out / 'adapter'}'))") if "adapter" in files else ""
    console.print(f"exported step {done} of {run_dir} to {out} ({', '.join(files)}); load it with "
                  f"AutoModelForCausalLM.from_pretrained or vLLM, or publish it with: "
                  f"hf upload YOUR_NAME/MODEL_NAME {out}{adapter}", soft_wrap=True)
    return 0


def _verify(run_dir: Path, console: Any) -> int:
    from opd.training.checkpoint import CheckpointError, complete_checkpoints, verify_checkpoint

    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints:
        console.print(f"[bold red]error:[/] {run_dir} holds no complete checkpoint (looked in {run_dir / 'checkpoints'})",
                      soft_wrap=True)
        return 2
    bad = 0
    for path in checkpoints:
        try:
            state = verify_checkpoint(path)
            console.print(f"[green]ok[/]   {path.name} (step {state['step']})")
        except CheckpointError as exc:
            bad += 1
            console.print(f"[bold red]bad[/]  {path.name}: {_escape(exc)}", soft_wrap=True)
    return 1 if bad else 0


def _report_failure(console: Any, args: argparse.Namespace, exc: BaseException) -> None:
    """What failed, where, what is kept and how to go on, on the console; the traceback to a log."""
    from opd.runtime.errors import RunError

    run_dir = Path(args.run_dir) if getattr(args, "run_dir", None) else None
    log_path = _write_traceback(run_dir, exc)
    if isinstance(exc, RunError):  # WorkerError included: it names the role and the call
        headline = str(exc)
    else:
        headline = f"opd {args.command} failed in the driver: {type(exc).__name__}: {exc}"
    notes = "; ".join(getattr(exc, "__notes__", []))
    console.print(f"[bold red]error:[/] {_escape(headline)}{f' ({_escape(notes)})' if notes else ''}", soft_wrap=True)
    if args.command == "train" and run_dir is not None and getattr(exc, "resumable", True):
        from opd.training.checkpoint import latest_checkpoint

        last = latest_checkpoint(run_dir) if run_dir.is_dir() else None
        console.print(f"last complete checkpoint: {last[0] if last else 'none'}", soft_wrap=True)
        if last:
            resume = shlex.join(["opd", "train", args.recipe, *args.overrides, "--resume"])
            console.print(f"resume with: {_escape(resume)}", soft_wrap=True)
    if log_path is not None:
        console.print(f"full traceback: {log_path}", soft_wrap=True)


def _write_traceback(run_dir: Path | None, exc: BaseException) -> Path | None:
    """Append the traceback (and an actor's remote one) to ``run_dir/error.log``, or to a file
    in the temporary directory when the run directory cannot take it."""
    text = "".join(traceback.format_exception(exc))
    detail = getattr(exc, "detail", "")
    if detail:
        text += f"\n-- inside the {getattr(exc, 'role', 'actor')} --\n{detail}\n"
    entry = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(sys.argv)}\n{text}\n"
    for path in ([run_dir / "error.log"] if run_dir is not None else []) + [Path(tempfile.gettempdir()) / "opd-error.log"]:
        try:
            if path.parent.is_dir():
                with open(path, "a") as f:
                    f.write(entry)
                return path
        except OSError:
            continue
    return None


if __name__ == "__main__":
    sys.exit(main())
