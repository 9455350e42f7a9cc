"""What a person sees: live progress on the terminal, the closing summary table and a plot of
the run (``report.png``: held-out success, and the reverse KL to the teacher or else each loss
term, against steps).

The trainer's metrics hold each loss term of the recipe as ``loss/<name>`` (and the term's own
scalars as ``<name>/<scalar>``); ``reverse_kl_per_token`` is the KL headline when a term reports a
reverse KL (:func:`opd.algorithms.step.with_reverse_kl_headline`). Both views read those keys
generically, so a custom loss shows up as its built-in neighbours do.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from opd.evaluation.run_dir import RunDir
from opd.optional import optional_module
from opd.progress import Progress
from opd.schema import ModelConfig, OPDConfig

MAX_TERMS_SHOWN = 3  # loss terms on the progress line; the rest are in metrics.jsonl
KL_KEY = "reverse_kl_per_token"


def loss_terms(metrics: dict[str, Any]) -> dict[str, float]:
    """``{name: value}`` of each ``loss/<name>`` term, in the recipe's order."""
    return {key[len("loss/"):]: value for key, value in metrics.items() if key.startswith("loss/")}


def short_name(name: str, width: int = 12) -> str:
    """A loss name that fits a progress line: kept up to ``width`` characters, else each
    ``_``-separated word cut to 4 letters (``pivot_preventive`` -> ``pivo_prev``), then cut to ``width``."""
    if len(name) <= width:
        return name
    return "_".join(word[:4] for word in name.split("_"))[:width]


def training_progress(log: Callable[[str], Any], total: int, start: int,
                      clock: Callable[[], float] = time.monotonic) -> Progress:
    """The training loop's :class:`opd.progress.Progress`: a bar on a terminal; one plain line per
    step otherwise (CI logs), ending with the time left (``eta 1m20s``).

    Example:
        >>> progress = training_progress(print, total=10, start=0)  # doctest: +SKIP
        >>> progress.advance(1, step_status(metrics))  # doctest: +SKIP
        step 1/10: loss +0.500 reverse_kl +0.100 sft +0.400 kl 0.100 succ 0.00 0.0s/it eta 18s
    """
    return Progress(log, "step", total, start=start, every_update=True, label="[bold]train", clock=clock)


def step_status(metrics: dict[str, float], width: int | None = None) -> str:
    """A training step's status after its count: the loss, its terms, the KL headline, success, speed.

    The terms are shown when the recipe has two or more (a lone term is the loss, times its
    weight), at most :data:`MAX_TERMS_SHOWN`, and, given a ``width``, only as many as fit in it:
    the rest of the line comes first. ``kl`` is the reverse KL headline when a term reports one.
    """
    terms = loss_terms(metrics)
    shown = [f"{short_name(name)} {value:+.3f}" for name, value in terms.items()][:MAX_TERMS_SHOWN] if len(terms) > 1 else []
    rest = []
    if KL_KEY in metrics:
        rest.append(f"kl {metrics[KL_KEY]:.3f}")
    if "pivot/found_rate" in metrics:
        rest.append(f"pivots {metrics['pivot/found_rate'] * metrics.get('pivot/failures', 0):.0f}")
    rest.append(f"succ {metrics.get('success', 0.0):.2f}")
    if "return/group_std" in metrics:  # a reward-driven step: the return and its spread within groups
        rest.append(f"ret {signed(metrics.get('return', 0.0))}±{metrics['return/group_std']:.2f}")
    elif "return" in metrics and abs(metrics["return"] - metrics.get("success", 0.0)) > 1e-6:  # partial credit
        rest.append(f"ret {signed(metrics['return'])}")
    rest.append(f"{metrics.get('time/step_s', 0.0):.1f}s/it")
    if "eval/student_success" in metrics:
        rest[-1] += f"  eval {metrics['eval/student_success']:.2f}"
    line = lambda: " ".join([f"loss {metrics.get('loss', float('nan')):+.3f}", *shown, *rest])  # noqa: E731
    while shown and width is not None and len(line()) > width:
        shown.pop()
    return line()


def signed(value: float, digits: int = 2) -> str:
    """``value`` to ``digits`` places, without a minus sign on a value that rounds to zero."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def render_summary(console: Any, summary: dict[str, Any], cfg: OPDConfig) -> None:
    """The closing table: teacher and student success before/after, and the time split."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    fmt = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    table = Table(title=f"opd summary: {cfg.name} ({summary['eval_episodes']} held-out tasks, greedy)")
    table.add_column("policy")
    table.add_column("held-out success", justify="right")
    # What the environment reports besides success (mean return, score, value, questions asked...).
    figures = summary.get("heldout") or {}
    extra = sorted({k for row in figures.values() for k in row} - {"turns"})
    if summary.get("by_environment"):  # a mix: its environments' own figures mean little averaged together
        extra = [k for k in extra if k in ("return", "valid_action_rate")]
    for key in extra:
        table.add_column(key.replace("_", " "), justify="right")

    def figure(key: str, value: float | None) -> str:
        if value is None:
            return "n/a"
        return fmt(value) if key.endswith("_rate") else signed(value, 3) if abs(value) < 1 else f"{value:.3g}"

    def row(label: str, success: float | None, who: str) -> None:
        table.add_row(label, fmt(success), *(figure(key, figures.get(who, {}).get(key)) for key in extra))

    teachers = sorted({str(e.teacher) for e in cfg.env.mix})
    row(f"teacher ({_source(cfg.teacher)})" if len(teachers) < 2 else f"teachers ({', '.join(teachers)})",
        summary["teacher_success"], "teacher")
    row(f"student before ({_source(cfg.student)})", summary["student_success_before"], "student_before")
    kind = "GRPO" if cfg.algorithm == "grpo" else "OPD"  # the one algorithm here that is not distillation
    steps = summary["steps"]
    row(f"student after {steps} {kind} step{'' if steps == 1 else 's'}", summary["student_success_after"],
        "student_after")
    console.print(table)
    if summary.get("by_environment"):
        console.print(environment_table(summary["by_environment"]))
    check = summary.get("teacher_check")
    if check and not check["teacher_better"]:
        console.print(f"[bold yellow]the teacher was not clearly better than the student before training[/] "
                      f"(margin {100 * check['margin']:+.1f} points, noise {100 * check['noise']:.1f}): see the "
                      "warning at the start of the run")
    check = summary.get("sampling_check")
    if check and not check["sampling_ok"]:
        console.print(f"[bold yellow]the student's sampled actions were valid far less often than its greedy ones[/] "
                      f"({100 * check['sampled_valid']:.1f}% against {100 * check['greedy_valid']:.1f}% at step 1): "
                      "see the warning at the start of the run")
    split = summary["time_split"]
    console.print(
        f"training wall time {summary['train_time_s']:.0f}s; per step: generation {split['generation_s_per_step']:.2f}s, "
        f"teacher scoring {split['teacher_scoring_s_per_step']:.2f}s, training {split['training_s_per_step']:.2f}s, "
        f"weight sync {split['weight_sync_s_per_step']:.3f}s. Run directory: {summary['run_dir']}"
    )


def lift_kept(figures: dict[str, Any]) -> float | None:
    """The share of its teacher's lead over the student before training that the student closed
    by the end, ``(after - before) / (teacher - before)`` (None where the teacher led by nothing)."""
    teacher, before, after = (figures.get(k) for k in ("teacher", "student_before", "student_after"))
    if None in (teacher, before, after) or teacher - before <= 0:
        return None
    return (after - before) / (teacher - before)


def environment_table(by_env: dict[str, dict[str, Any]]) -> Any:
    """A mixed run's held-out success per environment (``summary.json``'s ``by_environment``):
    its teacher, the student before and after, and the share of the teacher's lead closed."""
    from rich.table import Table

    fmt = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    table = Table(title="held-out success per environment (env.mix)")
    for column in ("environment", "teacher", "teacher success", "student before", "student after", "lead closed"):
        table.add_column(column, justify="left" if column in ("environment", "teacher") else "right")
    for env, figures in by_env.items():
        table.add_row(env, figures.get("teacher_name", ""), fmt(figures.get("teacher")),
                      fmt(figures.get("student_before")), fmt(figures.get("student_after")), fmt(lift_kept(figures)))
    return table


def _source(model_cfg: ModelConfig) -> str:
    boot = model_cfg.bootstrap
    if model_cfg.engine == "server":
        return f"{model_cfg.server.model} served at {', '.join(model_cfg.server.urls)}"
    if boot is None:
        return model_cfg.path
    policy = "the expert" if boot.policy == "expert" else "random valid moves"
    return f"bootstrap: {boot.sft_steps} SFT steps on {policy}"


def second_panel(records: list[dict[str, Any]]) -> tuple[str, str, dict[str, list[tuple[int, float]]]]:
    """What the plot's second panel shows: ``(title, y label, {line label: [(step, value)]})``,
    the reverse KL headline when the run logged one, else each ``loss/<name>`` term."""
    kl = [(r["step"], r[KL_KEY]) for r in records if KL_KEY in r]
    if kl:
        return "sampled reverse KL to the teacher", "nats / token", {"reverse KL": kl}
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name, value in loss_terms(record).items():
            series.setdefault(name, []).append((record["step"], value))
    return "loss terms", "loss", series


def write_report_plot(run_dir: Path) -> Path | None:
    """``report.png``: held-out success of student and teacher, and the reverse KL per token (or,
    for losses that report none, each loss term) against steps; None without matplotlib
    (:mod:`opd.optional`) or with nothing to plot."""
    matplotlib = optional_module("matplotlib", "report.png (opd report draws the curves without it)")
    if matplotlib is None:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = RunDir(run_dir).metrics()
    evals = [(r["step"], r["eval/student_success"]) for r in records if "eval/student_success" in r]
    teacher = [r["eval/teacher_success"] for r in records if "eval/teacher_success" in r]
    title, ylabel, series = second_panel(records)
    if not evals and not series:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    if evals:
        ax1.plot(*zip(*evals), marker="o", label="student")
    if teacher:
        ax1.axhline(teacher[0], color="gray", linestyle="--", label="teacher")
    ax1.set(xlabel="step", ylabel="held-out success", ylim=(0, 1.05), title="success")
    ax1.legend()
    for label, points in series.items():
        ax2.plot(*zip(*points), label=label)
    if len(series) > 1:
        ax2.legend()
    ax2.set(xlabel="step", ylabel=ylabel, title=title)
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
