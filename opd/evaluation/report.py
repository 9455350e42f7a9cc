"""What a person sees: live progress on the terminal, the closing summary table and a plot of
the run (``report.png``: held-out success and reverse KL against steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class Progress:
    """A live progress bar on a terminal; one plain line per step otherwise (CI logs)."""

    def __init__(self, console: Any, total: int, start: int):
        self.console = console
        self.live = None
        if console is not None and console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.live = RichProgress(
                TextColumn("[bold]train"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=console, transient=False,
            )
            self.task = self.live.add_task("train", total=total, completed=start, status="")
            self.live.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        status = f"loss {metrics.get('loss', float('nan')):+.3f} "
        if "reverse_kl_per_token" in metrics:
            status += f"kl {metrics['reverse_kl_per_token']:.3f} "
        if "pivot/found_rate" in metrics:
            status += f"pivots {metrics['pivot/found_rate'] * metrics.get('pivot/failures', 0):.0f} "
        status += f"succ {metrics.get('success', 0.0):.2f} {metrics.get('time/step_s', 0.0):.1f}s/it"
        if "eval/student_success" in metrics:
            status += f"  eval {metrics['eval/student_success']:.2f}"
        if self.live is not None:
            self.live.update(self.task, completed=step, status=status)
        else:
            print(f"step {step}: {status}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def render_summary(console: Any, summary: dict[str, Any], cfg: Any) -> None:
    """The closing table: teacher and student success before/after, and the time split."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    fmt = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    table = Table(title=f"opd summary: {cfg.name} ({summary['eval_episodes']} held-out tasks, greedy)")
    table.add_column("policy")
    table.add_column("held-out success", justify="right")
    teacher_src = _source(cfg.teacher)
    student_src = _source(cfg.student)
    table.add_row(f"teacher ({teacher_src})", fmt(summary["teacher_success"]))
    table.add_row(f"student before ({student_src})", fmt(summary["student_success_before"]))
    table.add_row(f"student after {summary['steps']} OPD steps", fmt(summary["student_success_after"]))
    console.print(table)
    split = summary["time_split"]
    console.print(
        f"training wall time {summary['train_time_s']:.0f}s; per step: generation {split['generation_s_per_step']:.2f}s, "
        f"teacher scoring {split['teacher_scoring_s_per_step']:.2f}s, training {split['training_s_per_step']:.2f}s, "
        f"weight sync {split['weight_sync_s_per_step']:.3f}s. Run directory: {summary['run_dir']}"
    )


def _source(model_cfg: Any) -> str:
    boot = model_cfg.bootstrap
    if boot is None:
        return model_cfg.path
    policy = "the expert" if boot.policy == "expert" else "random valid moves"
    return f"bootstrap: {boot.sft_steps} SFT steps on {policy}"


def write_report_plot(run_dir: Path) -> Path | None:
    """``report.png``: held-out success of student and teacher, and reverse KL per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/student_success"]) for r in records if "eval/student_success" in r]
    teacher = [r["eval/teacher_success"] for r in records if "eval/teacher_success" in r]
    kl = [(r["step"], r["reverse_kl_per_token"]) for r in records if "reverse_kl_per_token" in r]
    if not evals and not kl:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    if evals:
        ax1.plot(*zip(*evals), marker="o", label="student")
    if teacher:
        ax1.axhline(teacher[0], color="gray", linestyle="--", label="teacher")
    ax1.set(xlabel="step", ylabel="held-out success", ylim=(0, 1.05), title="success")
    ax1.legend()
    if kl:
        ax2.plot(*zip(*kl))
    ax2.set(xlabel="step", ylabel="nats / token", title="sampled reverse KL to the teacher")
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
