"""The ``opd`` command.

    opd train RECIPE [key=value ...] [--resume]   train; overrides use dotted keys
    opd check RECIPE [key=value ...]              validate a recipe without running it
    opd envs                                      list the registered environments
    opd references build RECIPE [key=value ...]   build ActFirst's reference trajectories once

Predictable mistakes (a bad recipe, a missing model, a run directory that already holds a
run) print one clear message and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _quiet_libraries() -> None:
    # DeepSpeed, Ray and transformers are chatty at import; the run's own lines should stand out.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
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
    sub.add_parser("envs", help="list registered environments")
    refs_p = sub.add_parser("references", help="ActFirst reference trajectories")
    refs_p.add_argument("action", choices=["build"])
    refs_p.add_argument("recipe")
    refs_p.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    # As `python -m` does: the user's own losses and environments in the current directory import
    # by dotted path (the Ray workers inherit this sys.path).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _quiet_libraries()
    console = _console()

    from opd.config import ConfigError, load_config, to_yaml
    from opd.runtime.driver import RunError

    try:
        if args.command == "envs":
            from opd.envs import list_envs

            for env_id, description in list_envs():
                console.print(f"{env_id:32s} {description}")
            return 0
        cfg = load_config(args.recipe, args.overrides)
        if args.command == "check":
            console.print(to_yaml(cfg))
            return 0
        if args.command == "references":
            from opd.rollout.references import build_references
            from opd.runtime.actors import local_teacher_player

            teacher = cfg.actfirst.reference_source == "teacher"
            build_references(cfg, log=console.log, teacher_play=local_teacher_player(cfg, console.log) if teacher else None)
            return 0
        from opd.runtime.driver import train

        train(cfg, resume=args.resume, console=console)
        return 0
    except (ConfigError, RunError) as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the last complete checkpoint is intact; rerun with --resume")
        return 130


if __name__ == "__main__":
    sys.exit(main())
