"""How far a long piece of work is: the one progress display of opd.

Every piece of work longer than a few seconds reports through :class:`Progress`: the training
loop's steps, the bootstrap's stages (the tokenizer's corpus, the scripted episodes, the SFT
steps), ``opd eval``'s episodes and ``opd compare``'s states.

On a terminal (``log`` is the ``log`` method of a rich ``Console`` that is a terminal) it is a
progress bar with the time elapsed and left and a status after the count. Elsewhere (CI logs, a
file) it writes plain lines, in one of two styles:

- ``every_update=False`` (a stage): a line at every tenth of the way (:data:`LINES`), none sooner
  than :data:`MIN_INTERVAL_S` after the one before, through ``log``; and, however far a tenth is,
  the first line at the first update past :data:`FIRST_LINE_S` and then one at least every
  :data:`QUIET_MAX_S`. So a fast stage stays quiet and a slow one says within seconds how long
  it will take, and is never silent for long. :meth:`Progress.finish` writes the closing line, with
  the time the stage took. The bar is removed when the stage ends.
- ``every_update=True`` (training steps): one line per update on standard output, ending with
  the time left at the mean time per item so far (``eta 1m20s``); the bar stays when it ends.

Example:
    >>> with Progress(print, "SFT step", total=100, prefix="bootstrap") as progress:  # doctest: +SKIP
    ...     for k in range(100):
    ...         progress.advance(k + 1, f"loss {loss:.4f}")
    ...     progress.finish(f"loss {loss:.4f}")
    bootstrap: SFT step 10/100, loss 3.1415 (12s, about 1m48s left)
    ...
    bootstrap: SFT step 100/100, loss 0.0123 in 120.3s
"""

from __future__ import annotations

import time
from typing import Any, Callable

LINES = 10  # a stage without a terminal logs a line at every tenth of the way...
MIN_INTERVAL_S = 5.0  # ...but not sooner than this after its previous line (its last line always)
FIRST_LINE_S = 3.0  # a stage still going after this says so at its next update, tenth or not...
QUIET_MAX_S = 30.0  # ...and says something at least this often
# The bar's columns before the status (the label, a bar rich may narrow to ~10, "3/10", elapsed,
# remaining): a status longer than the terminal's width less this squeezes the times to "0:…".
BAR_COLUMNS_WIDTH = 40


def format_duration(seconds: float) -> str:
    """``45s``, ``1m20s``, ``2h05m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """``done`` of ``total`` items of ``what`` (``"SFT step"``, ``"episode"``), told through ``log``.

    Args:
        log: where lines go (``print``, or a rich ``Console.log``: on a terminal, a bar instead).
        what: the items counted, for the lines and the bar's label.
        total: the number of items.
        start: items already done (a resumed run); the time left counts the items since.
        prefix: what the work is part of (``"bootstrap"``, ``"eval"``), before ``what`` on a line.
        every_update: a line per update on standard output (training steps), not one per tenth.
        label: the bar's label (default: ``prefix: what``).
        clock: seconds, for the times shown (a test gives its own).
        total_work: where items differ in cost (an evaluation's episodes under budgets of 2 and 8
            turns), their summed cost; :meth:`advance` then takes the ``work`` done so far and
            the time left is the work to go at the time per unit of work so far.
    """

    def __init__(self, log: Callable[[str], Any], what: str, total: int, *, start: int = 0, prefix: str = "",
                 every_update: bool = False, label: str | None = None,
                 clock: Callable[[], float] = time.monotonic, total_work: float | None = None) -> None:
        self.log, self.what, self.total, self.start, self.prefix = log, what, total, start, prefix
        self.every_update, self.clock = every_update, clock
        self.total_work = total_work
        self.work: float | None = None
        self.started = self.last_line = self.last_tenth = clock()
        self.tenths_logged = 0
        self.lines = 0  # lines written by _tenth_line
        self.bar = None
        self.console = getattr(log, "__self__", None)  # a bound Console.log
        on_terminal = type(self.console).__module__.startswith("rich.") and getattr(self.console, "is_terminal", False)
        if total > 0 and on_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            count = TextColumn("{task.fields[count]}") if total_work else MofNCompleteColumn()
            self.bar = RichProgress(TextColumn(label or self._head()), BarColumn(bar_width=24), count,
                                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                    console=self.console, transient=not every_update)
            # With costs, the bar and rich's time left run on the work; the count column still counts items.
            self.task = self.bar.add_task(what, total=total_work or total, completed=start, status="",
                                          count=f"{start}/{total}")
            self.bar.start()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def status_width(self) -> int | None:
        """How many characters of status fit after the bar's columns (``None`` without a bar)."""
        return self.console.width - BAR_COLUMNS_WIDTH if self.bar is not None else None

    def eta_s(self, done: int) -> float:
        """Seconds left: the items to go at the mean time of those done since the start (NaN before
        one), or with ``total_work`` the work to go at the time per unit of work done."""
        if self.total_work and self.work:
            return (self.clock() - self.started) / self.work * (self.total_work - self.work)
        since = done - self.start
        return (self.clock() - self.started) / since * (self.total - done) if since > 0 else float("nan")

    def advance(self, done: int, status: str = "", work: float | None = None) -> None:
        """``done`` of ``total`` are done (``work`` of ``total_work``, where items differ in cost);
        ``status`` (e.g. ``"loss 2.8465"``) goes after the count."""
        self.work = work if work is not None else self.work
        if self.bar is not None:
            self.bar.update(self.task, completed=work if self.total_work and work is not None else done,
                            status=status, count=f"{done}/{self.total}")
        elif self.every_update:
            eta = self.eta_s(done)
            tail = f" eta {format_duration(eta)}" if eta == eta else ""  # NaN (no item done yet): none
            print(f"{self.what} {done}/{self.total}: {status}{tail}", flush=True)
        else:
            self._tenth_line(done, status)

    def _tenth_line(self, done: int, status: str) -> None:
        tenths, now = done * LINES // max(1, self.total), self.clock()
        first = self.lines == 0 and now - self.started >= FIRST_LINE_S
        tenth = tenths > self.tenths_logged and now - self.last_tenth >= MIN_INTERVAL_S
        if done >= self.total or not (first or tenth or now - self.last_line >= QUIET_MAX_S):
            return  # the last one is finish()'s
        if tenth:
            self.tenths_logged, self.last_tenth = tenths, now
        self.last_line, self.lines = now, self.lines + 1
        elapsed = now - self.started
        left = self.eta_s(done)
        self.log(f"{self._head()} {done}/{self.total}{', ' + status if status else ''} "
                 f"({elapsed:.0f}s, about {left:.0f}s left)")

    def _head(self) -> str:
        return f"{self.prefix}: {self.what}" if self.prefix else self.what

    def finish(self, status: str = "") -> None:
        """A stage's closing line: the total, ``status`` and the time it took."""
        self.close()
        self.log(f"{self._head()} {self.total}/{self.total}{', ' + status if status else ''} "
                 f"in {self.clock() - self.started:.1f}s")

    def close(self) -> None:
        """Stop the bar (a stage's is removed, the training bar stays on the screen)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
