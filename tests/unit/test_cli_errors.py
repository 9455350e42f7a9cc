"""The console's account of a failure shows the error's text as written: brackets in it (gloo's
``[/path/pair.cc:537]``, a path) are not rich markup, and a failed run still gets its resume line."""

from __future__ import annotations

import io

from rich.console import Console

from opd.runtime.errors import WorkerError


def test_a_failure_whose_text_looks_like_markup_is_shown_as_written(tmp_path):
    from opd.cli import _report_failure

    exc = WorkerError("trainer", "the trainer failed in save_checkpoint: RuntimeError: "
                                 "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error")
    exc.add_note("after 2 restart(s), [run.max_restarts]=2")
    console = Console(file=io.StringIO(), width=400, color_system=None)
    args = type("Args", (), {"command": "train", "run_dir": str(tmp_path / "run"), "recipe": "r.yaml",
                             "overrides": []})()
    _report_failure(console, args, exc)
    shown = console.file.getvalue()
    assert ("error: the trainer failed in save_checkpoint: RuntimeError: "
            "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "(after 2 restart(s), [run.max_restarts]=2)") in shown
    assert "last complete checkpoint: none" in shown
