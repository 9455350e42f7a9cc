"""``opd report RUN_DIR``: one self-contained ``report.html`` for a run directory.

The page, top to bottom:

- a header: the recipe's name, algorithm, environment and models, the steps run, and the
  summary's held-out success of the teacher and of the student before and after;
- curves: success (held-out and training), the KL terms, each loss, the step's time split and the
  weight sync; a panel with no data is left out;
- the tables of ``opd eval`` (``eval/<name>.json``: pass@k with its confidence interval, success
  by turn budget, its plot) and of ``opd compare`` (``eval/compare_<name>.json``);
- a trajectory viewer over the episode files of :mod:`opd.evaluation.trajectories`: pick a file
  and an episode, then read it turn by turn, every response token coloured by the teacher's
  log-ratio to the sampling policy (``teacher_logprob - behaviour_logprob``: red where the teacher
  finds the token less likely, blue where more) with both logprobs on hover.

The page's template, stylesheet and script are files of this package, ``report_assets/``:
``report.html.j2`` (Jinja2, autoescaped), ``report.css`` and ``report.js``. This module reads the
run through :class:`~opd.evaluation.run_dir.RunDir` and turns it into data only: the header's
facts and cards and the evaluation tables' cells, which the template renders; the curve panels'
series (at most :data:`MAX_POINTS` points each) and the viewer's episodes, which go into the page
as JSON in ``<script type="application/json">`` blocks. In the browser ``report.js`` draws each
panel from its JSON as an inline SVG (lines against steps, or the step time's stacked bars) and
builds the viewer.

Nothing is fetched when the page is viewed: the CSS and the script are inlined when the page is
written, and the embedded JSON has every ``<``, ``>`` and ``&`` written as a ``\\u`` escape so that
no text of a run (an observation holding ``</script>``, say) can end its block. The embedded
episodes are capped: ``max_episodes_per_file`` episodes of a file (:func:`sample_rows`) and at most
:data:`MAX_FILES_PER_KIND` files of each kind (evenly spaced over the steps, the first and the
last kept); the page says what it left out.

Example:
    >>> write_html_report(Path("runs/quickstart"))  # doctest: +SKIP
    PosixPath('runs/quickstart/report.html')
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from opd.evaluation.run_dir import STEP_TIME_KEY, RunDir
from opd.evaluation.trajectories import read_episodes

MAX_FILES_PER_KIND = 40
"""Episode files embedded per kind (training samples, each evaluation, each ``opd eval``)."""
RATIO_STEP = 0.25
"""Nats of teacher/student log-ratio per colour step of a token."""
RATIO_STEPS = 12
"""Colour steps each side of zero: a log-ratio of ``RATIO_STEP * RATIO_STEPS`` (3 nats) saturates."""
MAX_POINTS = 400
"""Points per curve; a longer series is averaged over equal bins of steps."""

ASSETS = files("opd.evaluation") / "report_assets"
"""The page's template (``report.html.j2``), stylesheet (``report.css``) and script (``report.js``)."""
_TIME_PHASES = ("generation", "teacher_scoring", "training", "weight_sync", "trajectory_write")


def write_html_report(run_dir: Path, out: Path | None = None, max_episodes_per_file: int = 64) -> Path:
    """RUN_DIR/report.html (or out): one file, no network at view time."""
    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise FileNotFoundError(f"no run directory at {run.path}: pass the run.output_dir of an `opd train` run")
    records, config = run.metrics(), run.config()
    viewer = viewer_data(run.path, max_episodes_per_file)
    panels = _curve_panels(records)
    evaluations = [_compare_block(path, data) if path.name.startswith("compare_") else _eval_block(path, data)
                   for path, data in run.eval_results()]
    environment = jinja2.Environment(loader=jinja2.FunctionLoader(_asset), autoescape=True,
                                     undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    # Markup: inlined unescaped. The CSS and the script are this package's files (the tests check
    # that neither can close its element); embed_json's escapes keep the JSON inside its block.
    page = environment.get_template("report.html.j2").render(
        header=_header(run.path, config, run.summary() or {}, records), panels=panels, evaluations=evaluations,
        viewer=_viewer_section(viewer), css=Markup(_asset("report.css")), js=Markup(_asset("report.js")),
        chart_json=Markup(embed_json(panels)), episode_json=Markup(embed_json(viewer)))
    out = Path(out) if out is not None else run.path / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(page, encoding="utf-8")
    partial.replace(out)
    return out


def embed_json(data: Any) -> str:
    """``data`` as JSON safe inside a ``<script>`` element: no ``<`` (hence no ``</script>`` and
    no ``<!--``), ``>`` or ``&`` survives literally; ``JSON.parse`` reads the escapes back."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- header


def _header(run_dir: Path, config: dict, summary: dict, records: list[dict]) -> dict[str, Any]:
    """The template's ``header``: the run's name, the summary's cards, a note and the facts."""
    env = (config.get("env") or {}).get("id", "?")
    steps = summary.get("steps", max((int(r["step"]) for r in records if STEP_TIME_KEY in r), default=0))
    losses = ", ".join(f"{loss.get('name')} ×{loss.get('weight', 1.0):g}" for loss in config.get("losses") or []
                       if isinstance(loss, dict))
    facts = [("algorithm", config.get("algorithm", "?")), ("environment", env), ("steps", steps),
             ("teacher", _model_source(config.get("teacher"))), ("student", _model_source(config.get("student"))),
             ("losses", losses or "?"), ("run directory", str(run_dir.resolve())),
             ("generated", time.strftime("%Y-%m-%d %H:%M:%S %Z"))]
    cards = [{"value": _pct(value, missing="n/a"), "label": label, "wide": False} for label, value in (
        ("teacher", summary.get("teacher_success")), ("student before", summary.get("student_success_before")),
        ("student after", summary.get("student_success_after")))]
    split = summary.get("time_split") or {}
    if split:
        parts = [f"{name.replace('_s_per_step', '').replace('_', ' ')} {v:.2f}s" for name, v in split.items()
                 if isinstance(v, (int, float)) and name != "step_s_per_step"]
        cards.append({"value": f"{summary.get('train_time_s', 0):.0f}s", "wide": True,
                      "label": f"training wall time; per step: {', '.join(parts)}"})
    episodes = summary.get("eval_episodes")
    note = f"held-out success on {episodes} tasks, greedy" if episodes else "no summary.json: the run did not finish"
    return {"name": str(config.get("name") or run_dir.name), "cards": cards, "note": note, "facts": facts}


def _model_source(model: Any) -> str:
    if not isinstance(model, dict):
        return "?"
    boot = model.get("bootstrap")
    if model.get("path") or not isinstance(boot, dict):
        return str(model.get("path") or "?")
    arch = boot.get("arch") or {}
    return (f"bootstrap: {boot.get('sft_steps')} SFT steps on {boot.get('policy')} episodes "
            f"({arch.get('num_layers')} layers × {arch.get('hidden_size')})")


# --------------------------------------------------------------------------- curves


def _curve_panels(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve panels that have data, each ``{"title", "subtitle"}`` and its chart: ``kind``
    ``line`` (:func:`_lines`) or ``bars`` (:func:`_time_bars`), as ``report.js`` draws them."""
    train = [r for r in records if STEP_TIME_KEY in r or "loss" in r]
    keys = sorted({k for r in train for k in r})
    steps = [x for x, _ in _series(records, "step")] or [0.0]
    teacher = _series(records, "eval/teacher_success")
    if len(teacher) == 1:  # evaluated once, at step 0: a level to reach
        teacher = [(min(steps), teacher[0][1]), (max(steps), teacher[0][1])]
    kl_keys = ["reverse_kl_per_token"] + [k for k in keys if k.endswith("kl") and not k.startswith(("loss", "eval/"))]
    loss_keys = ["loss"] + [k for k in keys if k.startswith("loss/")]
    panels = [
        _panel("Success", "held-out (greedy) and training episodes", _lines([
            _curve("student, held-out", _series(records, "eval/student_success")),
            _curve("teacher, held-out", teacher, dashed=True),
            _curve("student, training", _series(train, "success"))], y_range=(0.0, 1.0))),
        _panel("KL to the teacher", "nats", _lines([_curve(k, _series(train, k)) for k in kl_keys])),
        _panel("Losses", "the total and each term of the recipe",
               _lines([_curve(k, _series(train, k)) for k in loss_keys])),
        _panel("Step time", "seconds per training step, by phase", _time_bars(train)),
        _panel("Weight sync", "seconds per step, trainer → rollout engine",
               _lines([_curve("time/weight_sync_s", _series(train, "time/weight_sync_s"))], y_range=(0.0, None))),
        _panel("Held-out turns", "turns per episode", _lines([
            _curve(k, _series(records, k)) for k in ("eval/student_turns", "eval/teacher_turns")], y_range=(0.0, None))),
        _panel("Gradient norm", "before clipping", _lines([_curve("grad_norm", _series(train, "grad_norm"))])),
        _panel("Learning rate", "", _lines([_curve("learning_rate", _series(train, "learning_rate"))])),
    ]
    returns = _series(train, "return")
    if any(abs(r - s) > 1e-9 for (_, r), (_, s) in zip(returns, _series(train, "success"))) \
            or any("return/group_std" in r for r in train):  # else the same line as the training success
        panels.insert(1, _panel("Return", "training episodes: the mean summed reward, and its spread within a group",
                                _lines([_curve("return", returns),
                                        _curve("return/group_std", _series(train, "return/group_std"), dashed=True)])))
    panels.insert(2, _panel("KL by turn index", "nats per token of the turns at each index, early and late in training",
                            _kl_by_turn(train)))
    envs = [k.split("/")[1] for k in keys if k.startswith("success/")]  # a mixed run's (env.mix)
    if envs:
        def level(key: str) -> list[tuple[float, float]]:  # the teacher's step-0 figure, across the run
            points = _series(records, key)
            return [(min(steps), points[0][1]), (max(steps), points[0][1])] if len(points) == 1 else points

        panels.insert(1, _panel("Success per environment", "held-out (greedy; the teacher dashed) and training, each "
                                "environment of env.mix", _lines(
                                    [_curve(f"{env}, held-out", _series(records, f"eval/{env}/student_success"))
                                     for env in envs]
                                    + [_curve(f"{env}, its teacher", level(f"eval/{env}/teacher_success"), dashed=True)
                                       for env in envs]
                                    + [_curve(f"{env}, training", _series(train, f"success/{env}")) for env in envs],
                                    y_range=(0.0, 1.0))))
        panels.insert(3, _panel("KL per teacher", "nats per trained token, the episodes each teacher grades",
                                _lines([_curve(k, _series(train, k)) for k in keys if k.startswith("kl/")])))
    for prefix, title in (("pivot/", "PivotOPD"), ("actfirst/", "ActFirst")):
        panels.append(_panel(title, f"{prefix}* scalars",
                             _lines([_curve(k, _series(train, k)) for k in keys if k.startswith(prefix)])))
    return [p for p in panels if p]


def _kl_by_turn(train: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The sampled KL of each turn index (``kl_turn/<t>``, :func:`opd.algorithms.step.kl_by_turn`)
    averaged over the first and the last quarter of the steps that logged it, against the turn
    index: compounding errors show as a line that rises with the turn, a curriculum's effect as
    the late line below the early one. ``None`` without such keys or with one step."""
    logged = [r for r in train if any(k.startswith("kl_turn/") for k in r)]
    if len(logged) < 2:
        return None
    quarter = max(1, len(logged) // 4)

    def mean_by_turn(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
        turns = sorted({k for r in records for k in r if k.startswith("kl_turn/")}, key=lambda k: int(k.split("/")[1]))
        return [(float(int(k.split("/")[1])), sum(v) / len(v)) for k in turns
                if (v := [float(r[k]) for r in records if k in r])]

    def label(records: list[dict[str, Any]]) -> str:
        return f"steps {records[0]['step']}-{records[-1]['step']}"

    early, late = logged[:quarter], logged[-quarter:]
    chart = _lines([_curve(label(early), mean_by_turn(early), dashed=True), _curve(label(late), mean_by_turn(late))])
    return {**chart, "x_label": "turn"} if chart else None


def _panel(title: str, subtitle: str, chart: dict[str, Any] | None) -> dict[str, Any] | None:
    return {"title": title, "subtitle": subtitle, **chart} if chart else None


def _curve(label: str, points: list[tuple[float, float]], dashed: bool = False) -> dict[str, Any]:
    return {"label": label, "points": points, "dashed": dashed}


def _lines(curves: list[dict[str, Any]],
           y_range: tuple[float | None, float | None] = (None, None)) -> dict[str, Any] | None:
    """A line chart of the ``curves`` that have points, against steps; ``y_range`` is widened to
    the data where it falls outside (``None``: the data's own bound). ``None`` without points.
    A curve with the same points as an earlier one (``loss`` and its only term, the KL headline
    and the term it comes from) is drawn once, its label naming both."""
    kept: list[dict[str, Any]] = []
    for curve in (c for c in curves if c["points"]):
        same = next((k for k in kept if k["points"] == curve["points"]), None)
        if same is None:
            kept.append(dict(curve))
        else:
            same["label"] += f" = {curve['label']}"
    curves = kept
    return {"kind": "line", "series": curves, "y_range": list(y_range)} if curves else None


def _time_bars(train: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Stacked bars of the ``time/*_s`` phases per step (bins of steps past :data:`MAX_POINTS`,
    each at its last step), with what the phases leave of ``time/step_s`` as ``other``: ``labels``
    and ``stacks``, a ``[step, [seconds per label]]`` each. ``None`` where no phase took time."""
    keys = sorted({k for r in train for k in r if k.startswith("time/") and k.endswith("_s") and k != STEP_TIME_KEY},
                  key=lambda k: (_TIME_PHASES.index(k[5:-2]) if k[5:-2] in _TIME_PHASES else 99, k))
    rows = [r for r in train if any(isinstance(r.get(k), (int, float)) for k in keys)]
    if not keys or not rows:
        return None
    labels = [k[5:-2].replace("_", " ") for k in keys] + ["other"]
    stacks = []
    for r in rows:
        values = [_seconds(r.get(k)) for k in keys]
        values.append(max(_seconds(r.get(STEP_TIME_KEY)) - sum(values), 0.0))
        stacks.append((float(r["step"]), values))
    size = math.ceil(len(stacks) / MAX_POINTS)
    stacks = [(b[-1][0], [sum(v[j] for _, v in b) / len(b) for j in range(len(labels))])
              for b in (stacks[i:i + size] for i in range(0, len(stacks), size))]
    if not any(v for _, values in stacks for v in values):
        return None
    return {"kind": "bars", "labels": labels, "stacks": stacks}


def _seconds(value: Any) -> float:
    """A phase's seconds; anything but a finite positive number (missing, NaN) counts as none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return max(float(value), 0.0)


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    points = [(float(r["step"]), float(r[key])) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return _thin(points)


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most :data:`MAX_POINTS` points: the means of equal bins of a longer series."""
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / MAX_POINTS)
    bins = [points[i:i + size] for i in range(0, len(points), size)]
    return [(sum(x for x, _ in b) / len(b), sum(y for _, y in b) / len(b)) for b in bins]


# --------------------------------------------------------------------------- evaluation tables


def _eval_block(path: Path, data: dict) -> dict[str, Any]:
    """An ``opd eval`` result as the template's tables: the pass@k grid (a turn budget a row, a k
    a column, each cell the value and its interval), the by-budget table and the plot."""
    meta = [str(data.get("policy", "?")), f"{data.get('env', '?')}, split {data.get('split', '?')}",
            f"{data.get('tasks', '?')} tasks × {data.get('samples', '?')} samples at temperature "
            f"{data.get('temperature', '?')}",
            f"{_pct(data.get('confidence'), missing='n/a').replace('.0%', '%')} intervals: {data.get('ci_method', '?')}"]
    cells = {(p.get("turns"), p.get("k")): p for p in data.get("pass_at_k") or [] if isinstance(p, dict)}
    ks = sorted({k for _, k in cells}, key=_sort_key)
    grid = [{"turns": t, "cells": [_interval(cells.get((t, k))) for k in ks]}
            for t in sorted({t for t, _ in cells}, key=_sort_key)]
    budgets = [b for b in data.get("by_budget") or [] if isinstance(b, dict)]
    columns = [c for c in ("turns", "episodes", "success", "score", "return", "mean_turns", "invalid_actions",
                           "end_reasons") if any(c in b for b in budgets)]
    rows = [[_budget_cell(c, b.get(c)) for c in columns] for b in budgets]
    plot, image = path.parent / Path(str(data.get("plot") or "")).name, None
    if data.get("plot") and plot.is_file() and plot.suffix.lower() == ".png":
        image = {"name": plot.name, "src": f"data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}"}
    return {"kind": "eval", "file": path.name, "name": str(data.get("name", path.stem)), "meta": meta,
            "pass_at_k": {"ks": ks, "rows": grid},
            "by_budget": {"columns": [c.replace("_", " ") for c in columns], "rows": rows}, "plot": image}


def _compare_block(path: Path, data: dict) -> dict[str, Any]:
    """An ``opd compare`` result: B better, equal or worse than A, overall, by stage and by recovery."""
    groups = [("all states", data.get("overall"))]
    for group in ("by_stage", "by_recovery"):
        groups += [(f"{group[3:]}: {name.replace('_', ' ')}", v) for name, v in (data.get(group) or {}).items()]
    rows = [{"name": name, "n": v.get("n", ""),
             "cells": [_pct(v.get(c)) if v.get("n") else "–" for c in ("better", "equal", "worse")]}
            for name, v in groups if isinstance(v, dict)]
    return {"kind": "compare", "file": path.name, "name": str(data.get("name", path.stem)), "a": data.get("a", "A"),
            "b": data.get("b", "B"), "states": data.get("states", "?"), "reference": data.get("reference", "?"),
            "judge": data.get("judge", "?"), "rows": rows}


def _interval(cell: dict | None) -> dict[str, str] | None:
    if not cell:
        return None
    return {"value": _pct(cell.get("value")), "low": _pct(cell.get("low")), "high": _pct(cell.get("high"))}


def _budget_cell(column: str, value: Any) -> str:
    if column == "end_reasons":
        return ", ".join(f"{k} {v}" for k, v in (value or {}).items())
    if column == "success":
        return _pct(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–" if value is None else str(value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _pct(value: Any, missing: str = "–") -> str:
    """A share as a percentage with one decimal; ``missing`` for anything but a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return missing
    return f"{100 * value:.1f}%"


def _sort_key(value: Any) -> tuple[int, float, str]:
    return (0, float(value), "") if isinstance(value, (int, float)) else (1, 0.0, str(value))


# --------------------------------------------------------------------------- trajectory viewer


def ratio_palette() -> list[str]:
    """The token colours, index ``bucket + RATIO_STEPS`` for a log-ratio bucket in
    ``[-RATIO_STEPS, RATIO_STEPS]``: white to red below zero, white to blue above."""
    colours = []
    for bucket in range(-RATIO_STEPS, RATIO_STEPS + 1):
        base = (220, 38, 38) if bucket < 0 else (37, 99, 235)
        strength = 0.0 if bucket == 0 else 0.12 + 0.58 * abs(bucket) / RATIO_STEPS
        colours.append("#" + "".join(f"{round(255 + (c - 255) * strength):02x}" for c in base))
    return colours


def ratio_bucket(behaviour_logprob: float, teacher_logprob: float) -> int:
    """The colour step of ``teacher - behaviour``, clamped to ``±RATIO_STEPS``."""
    ratio = teacher_logprob - behaviour_logprob
    return max(-RATIO_STEPS, min(RATIO_STEPS, round(ratio / RATIO_STEP)))


def viewer_data(run_dir: Path, max_episodes_per_file: int = 64) -> dict[str, Any]:
    """The viewer's JSON: the run's episode files (``trajectories/`` and ``eval/*.episodes.parquet``),
    capped as the module docstring says, with what was left out."""
    run_dir = Path(run_dir)
    paths = RunDir(run_dir).episode_files() + sorted((run_dir / "eval").glob("*.episodes.parquet"),
                                                     key=lambda p: (p.stat().st_mtime_ns, p.name))
    kinds: dict[str, list[Path]] = {}
    for path in paths:
        kinds.setdefault(_file_kind(path), []).append(path)
    files, omitted = [], []
    for kind, group in kinds.items():
        keep = _spread(len(group), MAX_FILES_PER_KIND)
        omitted += [p.name for i, p in enumerate(group) if i not in keep]
        for i in sorted(keep):
            rows = read_episodes(group[i])
            files.append({"name": group[i].name, "label": _file_label(group[i]), "group": kind,
                          "total": len(rows), "episodes": [_episode(r) for r in sample_rows(rows, max_episodes_per_file)]})
    return {"files": files, "omitted_files": omitted, "max_episodes_per_file": max_episodes_per_file,
            "palette": ratio_palette(), "ratio_step": RATIO_STEP, "ratio_steps": RATIO_STEPS}


def sample_rows(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` of ``rows`` (episodes), spread over what tells them apart: each turn
    budget, sample and outcome (success or not) gets its turn in rotation, so an ``opd eval`` file
    of 2,400 episodes shows every budget and both outcomes, not its first 64 (one budget, one
    sample). Kept in the file's order."""
    if len(rows) <= limit:
        return rows
    strata: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        strata.setdefault((row.get("turn_budget", 0), bool(row.get("success")), row.get("sample", 0)), []).append(i)
    # Outcomes alternate within each budget, then budgets alternate, then samples.
    order = sorted(strata, key=lambda key: (key[2], key[0], key[1]))
    queues = [iter(strata[key]) for key in order]
    picked: list[int] = []
    while len(picked) < limit and queues:
        alive = []
        for queue in queues:
            index = next(queue, None)
            if index is not None:
                alive.append(queue)
                if len(picked) < limit:
                    picked.append(index)
        queues = alive
    return [rows[i] for i in sorted(picked)]


def _file_kind(path: Path) -> str:
    if path.name.endswith(".episodes.parquet"):
        return "opd eval"
    found = re.match(r"(train|eval_student|eval_teacher)_step_\d+\.parquet$", path.name)
    return {"train": "training samples", "eval_student": "held-out, student", "eval_teacher": "held-out, teacher"}.get(
        found.group(1) if found else "", "other")


def _file_label(path: Path) -> str:
    if path.name.endswith(".episodes.parquet"):
        return f"opd eval: {path.name[:-len('.episodes.parquet')]}"
    found = re.match(r"(.+)_step_(\d+)\.parquet$", path.name)
    if not found:
        return path.stem
    return f"{found.group(1).replace('_', ' ')} · step {found.group(2)}"


def _spread(n: int, limit: int) -> set[int]:
    """``limit`` indices of ``range(n)``, evenly spaced, the first and the last included."""
    if n <= limit:
        return set(range(n))
    if limit <= 1:
        return {n - 1} if limit == 1 else set()
    return {round(i * (n - 1) / (limit - 1)) for i in range(limit)}


def _episode(row: dict[str, Any]) -> dict[str, Any]:
    return {"i": row.get("episode"), "task": row.get("task"), "sample": row.get("sample", 0),
            "budget": row.get("turn_budget", 0), "step": row.get("step"), "success": bool(row.get("success")),
            "end": row.get("end_reason", ""), "error": row.get("error", ""), "reward": _round(row.get("total_reward")),
            "turns": _turns(row.get("turns") or [])}


def _turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [_turn(t) for t in turns]
    for turn, following in zip(out, out[1:]):
        if turn["o"] and turn["o"] in following["p"]:
            turn["o"] = ""  # the next prompt shows it: not embedded twice
    return out


def _turn(turn: dict[str, Any]) -> dict[str, Any]:
    behaviour = [_round(x) for x in turn.get("behaviour_logprobs") or []]
    teacher = [_round(x) for x in turn.get("teacher_logprobs") or []]
    tokens = list(turn.get("response_tokens") or [])
    if len(teacher) != len(tokens) or len(behaviour) != len(tokens):
        teacher = []  # not scored, or scored in a way that does not line up: shown neutral, never shifted
    return {"p": turn.get("prompt", ""), "tok": tokens, "ids": list(turn.get("response_ids") or []),
            "b": behaviour if len(behaviour) == len(tokens) else [], "t": teacher,
            "c": [ratio_bucket(b, t) for b, t in zip(behaviour, teacher)],
            "as": turn.get("action_start", 0), "ae": turn.get("action_end", 0), "a": turn.get("action", ""),
            "o": turn.get("observation", ""), "r": _round(turn.get("reward")), "v": bool(turn.get("valid_action")),
            "x": turn.get("expert_action", ""), "m": list(turn.get("marks") or [])}


def _round(x: Any) -> float | None:
    """Three decimals (what the page shows), ``-0.0`` as ``0.0``, non-finite as None."""
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return round(float(x), 3) + 0.0


def _viewer_section(data: dict[str, Any]) -> dict[str, Any]:
    """The template's ``viewer``: what is embedded and what was left out, and the colour key."""
    files = data["files"]
    notes = [f"{len(files)} episode files, {sum(len(f['episodes']) for f in files)} episodes embedded."]
    capped = [f for f in files if f["total"] > len(f["episodes"])]
    if capped:
        notes.append(f"At most {data['max_episodes_per_file']} episodes of a file are embedded, spread over its turn "
                     "budgets, samples and outcomes; left out: "
                     + ", ".join(f"{f['total'] - len(f['episodes'])} of {f['total']} in {f['name']}" for f in capped) + ".")
    if data["omitted_files"]:
        notes.append(f"{len(data['omitted_files'])} files left out (at most {MAX_FILES_PER_KIND} of each kind, evenly "
                     f"spaced): {', '.join(data['omitted_files'])}.")
    return {"files": len(files), "note": " ".join(notes), "palette": data["palette"],
            "span": f"{data['ratio_step'] * data['ratio_steps']:g}"}
