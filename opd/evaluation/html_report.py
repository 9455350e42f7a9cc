"""``opd report RUN_DIR``: one self-contained ``report.html`` for a run directory.

The page, top to bottom:

- a header: the recipe's name, algorithm, environment and models, the steps run, and the
  summary's held-out success of the teacher and of the student before and after;
- curves, drawn here as inline SVG: success (held-out and training), the KL terms, each loss,
  the step's time split and the weight sync; a panel with no data is left out;
- the tables of ``opd eval`` (``eval/<name>.json``: pass@k with its confidence interval, success
  by turn budget, its plot) and of ``opd compare`` (``eval/compare_<name>.json``);
- a trajectory viewer over the episode files of :mod:`opd.evaluation.trajectories`: pick a file
  and an episode, then read it turn by turn, every response token coloured by the teacher's
  log-ratio to the sampling policy (``teacher_logprob - behaviour_logprob``: red where the teacher
  finds the token less likely, blue where more) with both logprobs on hover.

Nothing is fetched when the page is viewed: the CSS and the viewer's script are inline, and the
episodes are one JSON document in a ``<script type="application/json">`` block, with every ``<``
written as ``\\u003c`` so that no text of an episode (an observation holding ``</script>``, say)
can end the block. The embedded data is capped: the first ``max_episodes_per_file`` episodes of a
file and at most :data:`MAX_FILES_PER_KIND` files of each kind (evenly spaced over the steps,
the first and the last kept); the page says what it left out.

Example:
    >>> write_html_report(Path("runs/quickstart"))  # doctest: +SKIP
    PosixPath('runs/quickstart/report.html')
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

from opd.evaluation.trajectories import read_episodes, run_episode_files

MAX_FILES_PER_KIND = 40
"""Episode files embedded per kind (training samples, each evaluation, each ``opd eval``)."""
RATIO_STEP = 0.25
"""Nats of teacher/student log-ratio per colour step of a token."""
RATIO_STEPS = 12
"""Colour steps each side of zero: a log-ratio of ``RATIO_STEP * RATIO_STEPS`` (3 nats) saturates."""
MAX_POINTS = 400
"""Points per curve; a longer series is averaged over equal bins of steps."""

_TIME_PHASES = ("generation", "teacher_scoring", "training", "weight_sync", "trajectory_write")
_COLOURS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563")


def write_html_report(run_dir: Path, out: Path | None = None, max_episodes_per_file: int = 64) -> Path:
    """RUN_DIR/report.html (or out): one file, no network at view time."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}: pass the run.output_dir of an `opd train` run")
    records = _read_metrics(run_dir / "metrics.jsonl")
    summary = _read_json(run_dir / "summary.json") or {}
    config = _read_config(run_dir / "config.yaml")
    viewer = viewer_data(run_dir, max_episodes_per_file)
    body = "\n".join([
        _header(run_dir, config, summary, records),
        _curves_section(records),
        _evaluations_section(run_dir / "eval"),
        _viewer_section(viewer),
    ])
    title = html.escape(f"opd report: {config.get('name') or run_dir.name}")
    page = (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<link rel="icon" href="data:,">\n'
            f"<style>{_CSS}</style>\n</head>\n<body>\n{body}\n"
            f'<script type="application/json" id="episode-data">{embed_json(viewer)}</script>\n'
            f"<script>{_JS}</script>\n</body>\n</html>\n")
    out = Path(out) if out is not None else run_dir / "report.html"
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


# --------------------------------------------------------------------------- reading the run


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed run
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                records.append(record)
    return records


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


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


# --------------------------------------------------------------------------- header


def _header(run_dir: Path, config: dict, summary: dict, records: list[dict]) -> str:
    env = (config.get("env") or {}).get("id", "?")
    steps = summary.get("steps", max((int(r["step"]) for r in records if "time/step_s" in r), default=0))
    losses = ", ".join(f"{loss.get('name')} ×{loss.get('weight', 1.0):g}" for loss in config.get("losses") or []
                       if isinstance(loss, dict))
    facts = [("algorithm", config.get("algorithm", "?")), ("environment", env), ("steps", steps),
             ("teacher", _model_source(config.get("teacher"))), ("student", _model_source(config.get("student"))),
             ("losses", losses or "?"), ("run directory", str(run_dir.resolve())),
             ("generated", time.strftime("%Y-%m-%d %H:%M:%S %Z"))]
    cards = [("teacher", summary.get("teacher_success")), ("student before", summary.get("student_success_before")),
             ("student after", summary.get("student_success_after"))]
    card_html = "".join(f'<div class="card"><div class="card-value">{_percent(v)}</div>'
                        f'<div class="card-label">{html.escape(label)}</div></div>' for label, v in cards)
    split = summary.get("time_split") or {}
    if split:
        parts = [f"{name.replace('_s_per_step', '').replace('_', ' ')} {v:.2f}s" for name, v in split.items()
                 if isinstance(v, (int, float)) and name != "step_s_per_step"]
        card_html += (f'<div class="card wide"><div class="card-value">{summary.get("train_time_s", 0):.0f}s</div>'
                      f'<div class="card-label">training wall time; per step: {html.escape(", ".join(parts))}</div></div>')
    episodes = summary.get("eval_episodes")
    note = f"held-out success on {episodes} tasks, greedy" if episodes else "no summary.json: the run did not finish"
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
    return (f'<header><h1>{html.escape(str(config.get("name") or run_dir.name))}</h1>'
            f'<div class="cards">{card_html}</div><p class="note">{html.escape(note)}</p>'
            f'<table class="facts">{rows}</table></header>')


def _model_source(model: Any) -> str:
    if not isinstance(model, dict):
        return "?"
    boot = model.get("bootstrap")
    if model.get("path") or not isinstance(boot, dict):
        return str(model.get("path") or "?")
    arch = boot.get("arch") or {}
    return (f"bootstrap: {boot.get('sft_steps')} SFT steps on {boot.get('policy')} episodes "
            f"({arch.get('num_layers')} layers × {arch.get('hidden_size')})")


def _percent(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{100 * value:.1f}%"


# --------------------------------------------------------------------------- curves


class Series(NamedTuple):
    label: str
    points: list[tuple[float, float]]
    dashed: bool = False


def _curves_section(records: list[dict[str, Any]]) -> str:
    train = [r for r in records if "time/step_s" in r or "loss" in r]
    keys = sorted({k for r in train for k in r})
    steps = [x for x, _ in _series(records, "step")] or [0.0]
    teacher = _series(records, "eval/teacher_success")
    if len(teacher) == 1:  # evaluated once, at step 0: a level to reach
        teacher = [(min(steps), teacher[0][1]), (max(steps), teacher[0][1])]
    kl_keys = ["reverse_kl_per_token"] + [k for k in keys if k.endswith("kl") and not k.startswith(("loss", "eval/"))]
    loss_keys = ["loss"] + [k for k in keys if k.startswith("loss/")]
    panels = [
        _panel("Success", "held-out (greedy) and training episodes", _line_chart([
            Series("student, held-out", _series(records, "eval/student_success")),
            Series("teacher, held-out", teacher, dashed=True),
            Series("student, training", _series(train, "success"))], y_range=(0.0, 1.0))),
        _panel("KL to the teacher", "nats", _line_chart([Series(k, _series(train, k)) for k in kl_keys])),
        _panel("Losses", "the total and each term of the recipe",
               _line_chart([Series(k, _series(train, k)) for k in loss_keys])),
        _panel("Step time", "seconds per training step, by phase", _time_bars(train)),
        _panel("Weight sync", "seconds per step, trainer → rollout engine",
               _line_chart([Series("time/weight_sync_s", _series(train, "time/weight_sync_s"))], y_range=(0.0, None))),
        _panel("Held-out turns", "turns per episode", _line_chart([
            Series(k, _series(records, k)) for k in ("eval/student_turns", "eval/teacher_turns")], y_range=(0.0, None))),
        _panel("Gradient norm", "before clipping", _line_chart([Series("grad_norm", _series(train, "grad_norm"))])),
        _panel("Learning rate", "", _line_chart([Series("learning_rate", _series(train, "learning_rate"))])),
    ]
    for prefix, title in (("pivot/", "PivotOPD"), ("actfirst/", "ActFirst")):
        panels.append(_panel(title, f"{prefix}* scalars",
                             _line_chart([Series(k, _series(train, k)) for k in keys if k.startswith(prefix)])))
    panels = [p for p in panels if p]
    if not panels:
        return '<section id="curves"><h2>Curves</h2><p class="note">metrics.jsonl has no steps yet.</p></section>'
    return f'<section id="curves"><h2>Curves</h2><div class="panels">{"".join(panels)}</div></section>'


def _panel(title: str, subtitle: str, chart: str) -> str:
    if not chart:
        return ""
    return (f'<figure class="panel" data-panel="{html.escape(title)}"><figcaption><b>{html.escape(title)}</b> '
            f'<span>{html.escape(subtitle)}</span></figcaption>{chart}</figure>')


_W, _H, _L, _R, _T, _B = 460, 230, 56, 14, 10, 28


def _line_chart(series: list[Series], y_range: tuple[float | None, float | None] = (None, None)) -> str:
    """An SVG of ``series`` against steps, with its legend; ``""`` if no series has a point."""
    series = [s for s in series if s.points]
    if not series:
        return ""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    lo = y_range[0] if y_range[0] is not None else min(ys)
    hi = y_range[1] if y_range[1] is not None else max(ys)
    x_ticks, y_ticks = _ticks(min(xs), max(xs), integer=True), _ticks(min(lo, min(ys)), max(hi, max(ys)))
    sx, sy = _scale(x_ticks[0], x_ticks[-1], _L, _W - _R), _scale(y_ticks[0], y_ticks[-1], _H - _B, _T)
    parts = [_axes(x_ticks, y_ticks, sx, sy)]
    for i, s in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        if len(s.points) <= 60 and not s.dashed:
            parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                      f'<title>{html.escape(s.label)}, step {x:g}: {y:.4g}</title></circle>' for x, y in s.points]
    legend = [(s.label, _COLOURS[i % len(_COLOURS)], s.dashed) for i, s in enumerate(series)]
    return _svg(parts) + _legend(legend)


def _time_bars(train: list[dict[str, Any]]) -> str:
    """Stacked bars of the ``time/*_s`` phases per step (bins of steps past :data:`MAX_POINTS`),
    with what the phases leave of ``time/step_s`` as ``other``."""
    keys = sorted({k for r in train for k in r if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"},
                  key=lambda k: (_TIME_PHASES.index(k[5:-2]) if k[5:-2] in _TIME_PHASES else 99, k))
    rows = [r for r in train if any(isinstance(r.get(k), (int, float)) for k in keys)]
    if not keys or not rows:
        return ""
    labels = [k[5:-2].replace("_", " ") for k in keys] + ["other"]
    stacks = []
    for r in rows:
        values = [max(float(r.get(k) or 0.0), 0.0) for k in keys]
        values.append(max(float(r.get("time/step_s") or 0.0) - sum(values), 0.0))
        stacks.append((float(r["step"]), values))
    size = math.ceil(len(stacks) / MAX_POINTS)
    stacks = [(b[-1][0], [sum(v[j] for _, v in b) / len(b) for j in range(len(labels))])
              for b in (stacks[i:i + size] for i in range(0, len(stacks), size))]
    if not any(v for _, values in stacks for v in values):
        return ""
    y_ticks = _ticks(0.0, max(sum(v) for _, v in stacks))
    sy = _scale(0.0, y_ticks[-1], _H - _B, _T)
    band = (_W - _R - _L) / len(stacks)
    width = band * (0.75 if band > 4 else 1.0)
    x_ticks = _ticks(stacks[0][0], stacks[-1][0], integer=True)
    step_x = {s: _L + band * (i + 0.5) for i, (s, _) in enumerate(stacks)}
    sx = _scale(stacks[0][0], stacks[-1][0], step_x[stacks[0][0]], step_x[stacks[-1][0]]) if len(stacks) > 1 \
        else (lambda _x: step_x[stacks[0][0]])
    parts = [_axes([t for t in x_ticks if stacks[0][0] <= t <= stacks[-1][0]] or [stacks[0][0]], y_ticks, sx, sy)]
    for step, values in stacks:
        base = 0.0
        for j, v in enumerate(values):
            if v <= 0:
                continue
            top, bottom = sy(base + v), sy(base)
            parts.append(f'<rect x="{step_x[step] - width / 2:.1f}" y="{top:.1f}" width="{width:.1f}" '
                         f'height="{max(bottom - top, 0.3):.1f}" fill="{_COLOURS[j % len(_COLOURS)]}">'
                         f'<title>step {step:g}, {labels[j]}: {v:.3g}s</title></rect>')
            base += v
    return _svg(parts) + _legend([(label, _COLOURS[j % len(_COLOURS)], False) for j, label in enumerate(labels)])


def _svg(parts: list[str]) -> str:
    return (f'<svg viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" role="img" '
            f'font-size="11" font-family="system-ui, sans-serif">{"".join(parts)}</svg>')


def _legend(entries: list[tuple[str, str, bool]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="border-top:3px {"dashed" if dashed else "solid"} {colour}"></i>{html.escape(label)}</span>'
        for label, colour, dashed in entries) + "</div>"


def _axes(x_ticks: list[float], y_ticks: list[float], sx, sy) -> str:
    out = [f'<line x1="{_L}" y1="{_H - _B}" x2="{_W - _R}" y2="{_H - _B}" stroke="#94a3b8"/>']
    for y in y_ticks:
        out.append(f'<line x1="{_L}" y1="{sy(y):.1f}" x2="{_W - _R}" y2="{sy(y):.1f}" stroke="#e2e8f0"/>'
                   f'<text x="{_L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" fill="#475569">{y:.3g}</text>')
    for x in x_ticks:
        out.append(f'<text x="{sx(x):.1f}" y="{_H - _B + 16}" text-anchor="middle" fill="#475569">{x:g}</text>')
    out.append(f'<text x="{_W - _R}" y="{_H - 2}" text-anchor="end" fill="#64748b">step</text>')
    return "".join(out)


def _scale(lo: float, hi: float, out_lo: float, out_hi: float):
    span = (hi - lo) or 1.0
    return lambda v: out_lo + (v - lo) / span * (out_hi - out_lo)


def _ticks(lo: float, hi: float, integer: bool = False, count: int = 5) -> list[float]:
    """Round tick values covering ``[lo, hi]``."""
    if hi <= lo:
        lo, hi = (lo - 1, hi + 1) if integer or lo == 0 else (lo - abs(lo) * 0.1, hi + abs(hi) * 0.1)
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, round(step))
    first = math.floor(lo / step + 1e-9) * step
    ticks = [first]
    while ticks[-1] < hi - 1e-9 * step:
        ticks.append(round(first + len(ticks) * step, 12))
    return ticks


# --------------------------------------------------------------------------- evaluation tables


def _evaluations_section(eval_dir: Path) -> str:
    if not eval_dir.is_dir():
        return ""
    blocks = []
    for path in sorted(eval_dir.glob("*.json")):
        data = _read_json(path)
        if not isinstance(data, dict):
            continue
        blocks.append(_compare_block(data, path) if path.name.startswith("compare_") else _eval_block(data, path))
    if not blocks:
        return ""
    return f'<section id="evaluations"><h2>Evaluations</h2>{"".join(blocks)}</section>'


def _eval_block(data: dict, path: Path) -> str:
    e = html.escape
    meta = [f"{e(str(data.get('policy', '?')))}", f"{e(str(data.get('env', '?')))}, split {e(str(data.get('split', '?')))}",
            f"{data.get('tasks', '?')} tasks × {data.get('samples', '?')} samples at temperature {data.get('temperature', '?')}",
            f"{_percent(data.get('confidence')).replace('.0%', '%')} intervals: {e(str(data.get('ci_method', '?')))}"]
    out = [f'<div class="eval" data-eval="{e(path.name)}"><h3>{e(str(data.get("name", path.stem)))}</h3>'
           f'<p class="note">{" · ".join(meta)}</p><div class="eval-tables">']
    cells = {(p.get("turns"), p.get("k")): p for p in data.get("pass_at_k") or [] if isinstance(p, dict)}
    if cells:
        turns = sorted({t for t, _ in cells}, key=_sort_key)
        ks = sorted({k for _, k in cells}, key=_sort_key)
        head = "".join(f"<th>pass@{e(str(k))}</th>" for k in ks)
        body = "".join(f"<tr><th>{e(str(t))} turns</th>" + "".join(
            f"<td>{_interval(cells.get((t, k)))}</td>" for k in ks) + "</tr>" for t in turns)
        out.append(f'<table class="grid pass-at-k"><caption>pass@k by turn budget</caption>'
                   f"<tr><th></th>{head}</tr>{body}</table>")
    budgets = [b for b in data.get("by_budget") or [] if isinstance(b, dict)]
    columns = [c for c in ("turns", "episodes", "success", "score", "return", "mean_turns", "invalid_actions",
                           "end_reasons") if any(c in b for b in budgets)]
    if budgets:
        head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in columns)
        body = "".join("<tr>" + "".join(
            f"<td>{e(', '.join(f'{k} {v}' for k, v in (b.get(c) or {}).items()))}</td>" if c == "end_reasons"
            else f"<td>{_pct(b.get(c)) if c == 'success' else _number(b.get(c))}</td>" for c in columns) + "</tr>"
            for b in budgets)
        out.append(f'<table class="grid by-budget"><caption>by turn budget</caption><tr>{head}</tr>{body}</table>')
    out.append("</div>")
    plot = path.parent / Path(str(data.get("plot") or "")).name
    if data.get("plot") and plot.is_file() and plot.suffix.lower() == ".png":
        out.append(f'<img class="plot" alt="{e(plot.name)}" src="data:image/png;base64,'
                   f'{base64.b64encode(plot.read_bytes()).decode()}">')
    return "".join(out) + "</div>"


def _compare_block(data: dict, path: Path) -> str:
    e = html.escape
    rows = [("all states", data.get("overall"))]
    for group in ("by_stage", "by_recovery"):
        rows += [(f"{group[3:]}: {name.replace('_', ' ')}", v) for name, v in (data.get(group) or {}).items()]
    body = "".join(f"<tr><th>{e(str(name))}</th><td>{e(str(v.get('n', '')))}</td>" + "".join(
        f"<td>{_pct(v.get(c)) if v.get('n') else '–'}</td>" for c in ("better", "equal", "worse")) + "</tr>"
        for name, v in rows if isinstance(v, dict))
    return (f'<div class="eval compare" data-eval="{e(path.name)}"><h3>{e(str(data.get("name", path.stem)))}: '
            f'B = {e(str(data.get("b", "B")))} vs A = {e(str(data.get("a", "A")))}</h3>'
            f'<p class="note">the next action of each policy in the same {e(str(data.get("states", "?")))} states of '
            f'{e(str(data.get("reference", "?")))}, judged by {e(str(data.get("judge", "?")))}: the share of states '
            f'where B is better, equal or worse than A</p>'
            f'<table class="grid"><tr><th></th><th>n</th><th>B better</th><th>equal</th><th>B worse</th></tr>{body}'
            '</table></div>')


def _interval(cell: dict | None) -> str:
    if not cell:
        return ""
    return f"{_pct(cell.get('value'))} <small>[{_pct(cell.get('low'))}, {_pct(cell.get('high'))}]</small>"


def _pct(value: Any) -> str:
    """A share as a percentage with one decimal."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return "–"
    return f"{100 * value:.1f}%"


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–" if value is None else html.escape(str(value))
    return f"{value:.3g}" if isinstance(value, float) else str(value)


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
    paths = list(run_episode_files(run_dir)) + sorted((run_dir / "eval").glob("*.episodes.parquet"))
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
                          "total": len(rows), "episodes": [_episode(r) for r in rows[:max_episodes_per_file]]})
    return {"files": files, "omitted_files": omitted, "max_episodes_per_file": max_episodes_per_file,
            "palette": ratio_palette(), "ratio_step": RATIO_STEP, "ratio_steps": RATIO_STEPS}


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


def _viewer_section(data: dict[str, Any]) -> str:
    files = data["files"]
    if not files:
        return ('<section id="viewer"><h2>Trajectories</h2><p class="note">No episode files: set '
                "run.trajectory_every_steps to write training samples (evaluations are always written).</p></section>")
    shown = sum(len(f["episodes"]) for f in files)
    notes = [f"{len(files)} episode files, {shown} episodes embedded."]
    capped = [f for f in files if f["total"] > len(f["episodes"])]
    if capped:
        notes.append(f"Only the first {data['max_episodes_per_file']} episodes of a file are embedded; left out: "
                     + ", ".join(f"{f['total'] - len(f['episodes'])} of {f['total']} in {f['name']}" for f in capped) + ".")
    if data["omitted_files"]:
        notes.append(f"{len(data['omitted_files'])} files left out (at most {MAX_FILES_PER_KIND} of each kind, evenly "
                     f"spaced): {', '.join(data['omitted_files'])}.")
    swatches = "".join(f'<i style="background:{c}"></i>' for c in data["palette"])
    span = data["ratio_step"] * data["ratio_steps"]
    return f"""<section id="viewer"><h2>Trajectories</h2>
<p class="note" id="viewer-note">{html.escape(" ".join(notes))}</p>
<div class="controls">
<label>file <select id="file-select"></select></label>
<label>episode <select id="episode-select"></select></label>
<button type="button" id="prev-episode" title="previous episode">◀</button>
<button type="button" id="next-episode" title="next episode">▶</button>
<span class="scale"><span>teacher finds it less likely (−{span:g} nats)</span><span class="swatches">{swatches}</span>
<span>more likely (+{span:g})</span><span class="tok nt">not scored</span><span class="act-key">action</span></span>
</div>
<div id="episode-view"><p class="note">Loading the viewer… (it needs JavaScript)</p></div>
</section>"""


_CSS = """
:root{--ink:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc;--card:#fff}
*{box-sizing:border-box}
body{margin:0;padding:24px 32px 64px;font:14px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--ink);background:var(--bg)}
h1{margin:0 0 12px;font-size:26px}h2{margin:32px 0 12px;font-size:20px;border-bottom:1px solid var(--line);padding-bottom:4px}
h3{margin:16px 0 4px;font-size:16px}
.note{color:var(--muted);margin:4px 0}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 16px;min-width:130px}
.card.wide{flex:1;min-width:300px}.card-value{font-size:22px;font-weight:600}.card-label{color:var(--muted);font-size:12px}
table.facts{border-collapse:collapse;margin-top:8px;font-size:13px}
table.facts th{text-align:left;color:var(--muted);font-weight:500;padding:1px 16px 1px 0}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:16px}
.panel{margin:0;background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 12px}
.panel figcaption span{color:var(--muted);font-size:12px;margin-left:6px}.panel svg{width:100%;height:auto;display:block}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:#334155}
.legend i{display:inline-block;width:18px;height:0;margin-right:5px;vertical-align:middle}
.eval{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:8px 16px 16px;margin-bottom:16px}
.eval-tables{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
table.grid{border-collapse:collapse;font-size:13px;margin-top:8px}
table.grid caption{text-align:left;color:var(--muted);font-size:12px}
table.grid th,table.grid td{border:1px solid var(--line);padding:3px 10px;text-align:right}
table.grid th{background:#f1f5f9;font-weight:600}table.grid small{color:var(--muted)}
img.plot{max-width:100%;margin-top:12px;border:1px solid var(--line)}
.controls{display:flex;flex-wrap:wrap;gap:10px;align-items:center;background:var(--card);border:1px solid var(--line);
  border-radius:8px;padding:8px 12px;position:sticky;top:0;z-index:2}
.controls select{font:inherit;padding:3px 6px;max-width:460px}
.controls button{font:inherit;padding:2px 10px;cursor:pointer}
.scale{display:flex;gap:6px;align-items:center;font-size:12px;color:var(--muted);margin-left:auto;flex-wrap:wrap}
.swatches{display:inline-flex}.swatches i{width:7px;height:14px;display:inline-block}
.act-key{outline:2px solid #0f172a;outline-offset:1px;border-radius:3px;padding:0 4px;color:var(--ink)}
.episode-head{margin:14px 0 8px;display:flex;gap:12px;flex-wrap:wrap;align-items:baseline}
.episode-head h3{margin:0}
.pill{border-radius:10px;padding:1px 9px;font-size:12px;font-weight:600;background:#e2e8f0}
.pill.ok{background:#dcfce7;color:#166534}.pill.bad{background:#fee2e2;color:#991b1b}
.turn{background:var(--card);border:1px solid var(--line);border-left:4px solid #cbd5e1;border-radius:8px;padding:8px 14px;margin:10px 0}
.turn.marked{border-left-color:#7c3aed}
.turn-head{display:flex;gap:8px;align-items:center;flex-wrap:wrap;font-size:13px}
.turn-head b{font-size:14px;margin-right:4px}
.badge{border-radius:4px;padding:0 7px;font-size:11px;font-weight:700;text-transform:uppercase;letter-spacing:.04em;color:#fff}
.badge.pivot{background:#7c3aed}.badge.recovery{background:#0891b2}.badge.aligned{background:#059669}.badge.other{background:#475569}
.label{font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:var(--muted);margin-top:8px}
pre.text{white-space:pre-wrap;word-break:break-word;margin:2px 0;padding:6px 10px;background:#f1f5f9;border-radius:6px;
  font:12.5px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;max-height:18em;overflow:auto}
.special{color:#94a3b8}
.response{white-space:pre-wrap;word-break:break-word;font:13px/1.9 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
  padding:4px 2px}
.tok{border-radius:3px;padding:1px 0;margin-right:1px;box-shadow:inset 0 0 0 1px rgba(15,23,42,.12)}
.tok.nt{background:transparent;border-bottom:1px dashed #94a3b8;border-radius:0}
.tok .ws{color:rgba(15,23,42,.5)}
.action{outline:2px solid #0f172a;outline-offset:1px;border-radius:3px}
.facts-line{font-size:13px;margin-top:4px;display:flex;gap:14px;flex-wrap:wrap}
.facts-line code{background:#f1f5f9;padding:0 5px;border-radius:4px}
.ok{color:#166534}.bad{color:#991b1b}
"""

_JS = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("episode-data").textContent);
  var fileSel = document.getElementById("file-select"), epSel = document.getElementById("episode-select");
  var view = document.getElementById("episode-view");
  if (!fileSel) { return; }
  var N = data.ratio_steps;

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }
  function num(v) { return v === null || v === undefined ? "n/a" : (v <= -1e8 ? "-inf" : v.toFixed(3)); }

  // Whitespace made visible: a newline shows as a dim ↵ then breaks, a tab as ⇥, and a token
  // made only of spaces as dim dots; spaces inside words stay spaces.
  function visibleText(node, text) {
    var onlySpace = /^[ \t\r\n]+$/.test(text);
    for (var i = 0; i < text.length; i++) {
      var ch = text[i];
      if (ch === "\n") { node.appendChild(el("span", "ws", "↵")); node.appendChild(document.createTextNode("\n")); }
      else if (ch === "\t") { node.appendChild(el("span", "ws", "⇥")); }
      else if (ch === "\r") { node.appendChild(el("span", "ws", "␍")); }
      else if (ch === " " && onlySpace) { node.appendChild(el("span", "ws", "·")); }
      else { node.appendChild(document.createTextNode(ch)); }
    }
    if (!text.length) { node.appendChild(el("span", "ws", "∅")); }
  }

  function promptText(text) {
    var pre = el("pre", "text");
    String(text).split(/(<\|[^|>\n]*\|>)/).forEach(function (part, i) {
      if (part) { pre.appendChild(i % 2 ? el("span", "special", part) : document.createTextNode(part)); }
    });
    return pre;
  }

  function tokenSpan(turn, i) {
    var span = el("span", "tok"), b = turn.b[i], scored = turn.t.length === turn.tok.length;
    visibleText(span, turn.tok[i]);
    var lines = ["token " + JSON.stringify(turn.tok[i]) + (turn.ids.length ? " (id " + turn.ids[i] + ")" : ""),
                 "student (behaviour) logprob " + num(b)];
    if (scored) {
      var t = turn.t[i];
      span.style.backgroundColor = data.palette[turn.c[i] + N];
      lines.push("teacher logprob " + num(t), "log-ratio teacher - student " + num(t - b));
    } else {
      span.className += " nt";
      lines.push("teacher logprob n/a (not scored)");
    }
    span.title = lines.join("\n");
    return span;
  }

  function responseBlock(turn) {
    var box = el("div", "response"), action = null;
    for (var i = 0; i < turn.tok.length; i++) {
      var span = tokenSpan(turn, i);
      if (i >= turn.as && i < turn.ae) {
        if (!action) { action = el("span", "action"); action.title = "the action: tokens " + turn.as + "-" + (turn.ae - 1); box.appendChild(action); }
        action.appendChild(span);
      } else { box.appendChild(span); }
    }
    if (!turn.tok.length) { box.appendChild(el("span", "note", "(empty response)")); }
    return box;
  }

  function turnCard(ep, turn, index) {
    var card = el("div", "turn" + (turn.m.length ? " marked" : ""));
    card.setAttribute("data-turn", index);
    var head = el("div", "turn-head");
    head.appendChild(el("b", null, "turn " + (index + 1)));
    turn.m.forEach(function (m) {
      card.classList.add("mark-" + m);
      head.appendChild(el("span", "badge " + (["pivot", "recovery", "aligned"].indexOf(m) >= 0 ? m : "other"), m));
    });
    head.appendChild(el("span", "pill", "reward " + num(turn.r)));
    head.appendChild(el("span", "pill " + (turn.v ? "ok" : "bad"), turn.v ? "valid action" : "invalid action"));
    if (turn.t.length && turn.tok.length) {
      var sum = 0; for (var i = 0; i < turn.t.length; i++) { sum += turn.t[i] - turn.b[i]; }
      head.appendChild(el("span", "note", "mean log-ratio " + num(sum / turn.t.length) + " over " + turn.t.length + " tokens"));
    }
    card.appendChild(head);
    card.appendChild(el("div", "label", index === 0 ? "prompt (system and task)" : "prompt (the observation)"));
    card.appendChild(promptText(turn.p));
    card.appendChild(el("div", "label", "response (" + turn.tok.length + " tokens, the action outlined)"));
    card.appendChild(responseBlock(turn));
    var facts = el("div", "facts-line"), a = el("span", null, "action ");
    a.appendChild(el("code", "action-text", turn.a));
    facts.appendChild(a);
    if (turn.x) {
      var x = el("span", null, "expert ");
      x.appendChild(el("code", null, turn.x));
      x.appendChild(el("span", turn.x === turn.a ? "ok" : "bad", turn.x === turn.a ? " ✓ same" : " ✗ differs"));
      facts.appendChild(x);
    }
    card.appendChild(facts);
    if (turn.o) {  // left out where the next turn's prompt shows it
      card.appendChild(el("div", "label", index === ep.turns.length - 1 ? "final observation" : "observation"));
      card.appendChild(promptText(turn.o));
    }
    return card;
  }

  function episodeLabel(ep) {
    var parts = ["#" + ep.i, ep.task, ep.success ? "✓ success" : "✗ " + ep.end, ep.turns.length + " turns",
                 "reward " + num(ep.reward)];
    if (ep.budget || ep.sample) { parts.splice(2, 0, "sample " + ep.sample, "budget " + ep.budget); }
    return parts.join(" · ");
  }

  function showEpisode() {
    var file = data.files[+fileSel.value], ep = file && file.episodes[+epSel.value];
    view.textContent = "";
    if (!ep) { view.appendChild(el("p", "note", "This file has no episodes.")); return; }
    var head = el("div", "episode-head");
    head.appendChild(el("h3", null, file.label + ": episode " + ep.i + ", task " + ep.task));
    head.appendChild(el("span", "pill " + (ep.success ? "ok" : "bad"), ep.success ? "success" : ep.end));
    head.appendChild(el("span", "pill", "total reward " + num(ep.reward)));
    if (ep.error) { head.appendChild(el("span", "pill bad", "error: " + ep.error)); }
    view.appendChild(head);
    ep.turns.forEach(function (turn, i) { view.appendChild(turnCard(ep, turn, i)); });
  }

  function showFile() {
    var file = data.files[+fileSel.value];
    epSel.textContent = "";
    file.episodes.forEach(function (ep, i) { var o = el("option", null, episodeLabel(ep)); o.value = String(i); epSel.appendChild(o); });
    if (file.total > file.episodes.length) {
      var o = el("option", null, "(" + (file.total - file.episodes.length) + " more episodes of " + file.total + " not embedded)");
      o.disabled = true; epSel.appendChild(o);
    }
    showEpisode();
  }

  var groups = {}, lastTrain = 0;
  data.files.forEach(function (file, i) {
    if (!groups[file.group]) { groups[file.group] = el("optgroup"); groups[file.group].label = file.group; fileSel.appendChild(groups[file.group]); }
    var o = el("option", null, file.label + " (" + file.total + " episodes)");
    o.value = String(i); o.setAttribute("data-name", file.name);
    groups[file.group].appendChild(o);
    if (file.group === "training samples") { lastTrain = i; }
  });
  fileSel.value = String(lastTrain);
  fileSel.addEventListener("change", showFile);
  epSel.addEventListener("change", showEpisode);
  function move(delta) {
    var n = data.files[+fileSel.value].episodes.length, next = +epSel.value + delta;
    if (next >= 0 && next < n) { epSel.value = String(next); showEpisode(); }
  }
  document.getElementById("prev-episode").addEventListener("click", function () { move(-1); });
  document.getElementById("next-episode").addEventListener("click", function () { move(1); });
  showFile();
})();
"""
