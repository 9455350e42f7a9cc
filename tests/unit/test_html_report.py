"""``opd report``'s page (opd/evaluation/html_report.py) on a run directory built by hand: the
header, the curve panels it embeds for report.js to draw and those it leaves out, the evaluation
tables, the viewer's embedded episodes (escaped, coloured, capped) and the inlined assets. The page
in a real browser (the charts drawn, the viewer driven): tests/e2e/test_report_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from opd.evaluation import html_report
from opd.evaluation.html_report import ratio_bucket, ratio_palette, viewer_data, write_html_report
from opd.evaluation.trajectories import write_episodes

HOSTILE = "you see </script><script>window.pwned = 1</script><!-- <script> & done"


def episode_row(step: int, episode: int, observation: str = "You step right.", teacher=(-4.0, -1.0, -0.5),
                behaviour=(-1.0, -1.0, -1.0), marks=(), success=False) -> dict:
    """One episode in the format of opd.evaluation.trajectories: two turns of three tokens
    (a space-led reasoning token, then the two tokens of the action ``right``)."""
    def turn(prompt, obs, turn_marks):
        return {"prompt": prompt, "response": "ok right", "action": "right", "action_start": 1, "action_end": 3,
                "observation": obs, "reward": 0.5, "valid_action": True, "expert_action": "right",
                "response_ids": [11, 12, 13], "response_tokens": ["ok\n", " ri", "ght"],
                "behaviour_logprobs": list(behaviour), "teacher_logprobs": list(teacher), "marks": list(turn_marks)}

    return {"step": step, "kind": "train", "episode": episode, "task": f"task-{episode}", "sample": 0, "turn_budget": 0,
            "success": success, "end_reason": "success" if success else "truncated", "error": "", "total_reward": 1.0,
            "task_prompt": "<|im_start|>user\nReach G<|im_end|>\n",
            "turns": [turn("<|im_start|>user\nReach G<|im_end|>\n", observation, marks),
                      turn(f"<|im_start|>user\n{observation}<|im_end|>\n", "final: G reached", ())]}


def make_run_dir(root: Path, episodes: int = 2, train_steps=(1, 2), observation: str = "You step right.",
                 training: bool = True, evaluation: bool = True) -> Path:
    """A small run directory: config, summary, metrics, episode files and ``opd eval`` output."""
    run = root / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "config.yaml").write_text("name: handmade\nalgorithm: vanilla_opd\nenv: {id: opd/FrozenLakeText-v0}\n"
                                     "teacher: {path: /models/teacher}\nstudent: {path: /models/student}\n"
                                     "losses: [{name: reverse_kl, weight: 1.0}]\n")
    (run / "summary.json").write_text(json.dumps({
        "teacher_success": 0.75, "student_success_before": 0.25, "student_success_after": 0.5, "steps": 2,
        "train_time_s": 12.0, "eval_episodes": 4, "time_split": {"generation_s_per_step": 1.0}}))
    lines = [{"step": 0, "eval/student_success": 0.25, "eval/teacher_success": 0.75, "eval/student_turns": 5.0}]
    if training:
        lines += [{"step": s, "loss": 0.5 / s, "loss/reverse_kl": 0.5 / s, "reverse_kl/reverse_kl": 0.5 / s,
                   "reverse_kl/clip_frac": 0.0, "reverse_kl_per_token": 0.1 * s, "success": 0.5, "grad_norm": 1.0,
                   "learning_rate": 1e-3, "time/generation_s": 1.0, "time/teacher_scoring_s": 0.5,
                   "time/training_s": 2.0, "time/weight_sync_s": 0.1, "time/step_s": 4.0} for s in train_steps]
    lines.append({"step": max(train_steps), "eval/student_success": 0.5, "eval/student_turns": 4.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for s in train_steps:
        rows = [episode_row(s, i, observation, marks=("pivot",) if i == 1 else ()) for i in range(episodes)]
        write_episodes(run / "trajectories" / f"train_step_{s}.parquet", rows)
    write_episodes(run / "trajectories" / "eval_student_step_0.parquet",
                   [{**episode_row(0, 0, teacher=()), "kind": "eval/student"}])
    if evaluation:
        (run / "eval").mkdir()
        (run / "eval" / "before.json").write_text(json.dumps({
            "name": "before", "policy": "student of handmade", "env": "opd/FrozenLakeText-v0", "split": "eval",
            "tasks": 32, "samples": 8, "temperature": 1.0, "confidence": 0.95, "ci_method": "bootstrap over tasks",
            "budgets": [{"fraction": 0.5, "turns": 3}, {"fraction": 1.0, "turns": 6}],
            "pass_at_k": [{"turns": t, "k": k, "value": 0.1 * k + t / 100, "low": 0.05, "high": 0.9}
                          for t in (3, 6) for k in (1, 8)],
            "by_budget": [{"turns": 3, "success": 0.31, "score": None, "mean_turns": 2.9, "invalid_actions": 0.4,
                           "end_reasons": {"truncated": 200, "success": 56}}],
            "plot": "before.png", "episodes": "before.episodes.parquet"}))
        (run / "eval" / "before.png").write_bytes(tiny_png())
        (run / "eval" / "compare_ab.json").write_text(json.dumps({
            "name": "ab", "a": "before", "b": "after", "reference": "a", "judge": "expert", "states": 120,
            "overall": {"better": 0.2, "equal": 0.7, "worse": 0.1, "n": 120},
            "by_stage": {"early": {"better": 0.3, "equal": 0.6, "worse": 0.1, "n": 40}},
            "by_recovery": {"error_recovery": {"better": 0.4, "equal": 0.5, "worse": 0.1, "n": 30}}}))
    return run


def tiny_png(width: int = 40, height: int = 20) -> bytes:
    """A real PNG (a blue rectangle), so a browser decodes the embedded plot."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = b"".join(b"\x00" + b"\x25\x63\xeb" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))


def embedded(page: str, block: str = "episode-data") -> Any:
    """A JSON block of the page (the viewer's episodes, or ``chart-data``: the curve panels), cut
    out as the browser's parser would: up to the first ``</script>``."""
    found = re.search(rf'<script type="application/json" id="{block}">(.*?)</script>', page, re.S)
    assert found, f"no {block} block"
    return json.loads(found.group(1))


def charts(page: str) -> dict[str, dict]:
    """The curve panels report.js draws, by title; each title also a figure of the page, in order."""
    panels = embedded(page, "chart-data")
    assert re.findall(r'<figure class="panel" data-panel="([^"]+)" data-chart="(\d+)">', page) == \
        [(p["title"], str(i)) for i, p in enumerate(panels)]
    return {p["title"]: p for p in panels}


def labels(panel: dict) -> list[str]:
    return [s["label"] for s in panel["series"]]


def points(panel: dict, label: str) -> list[list[float]]:
    return next(s["points"] for s in panel["series"] if s["label"] == label)


def note(page: str) -> str:
    """The viewer's note on what it embeds and what it left out."""
    return re.search(r'<p class="note" id="viewer-note">(.*?)</p>', page, re.S).group(1)


def asset(name: str) -> str:
    return (html_report.ASSETS / name).read_text(encoding="utf-8")


def test_the_signature_is_pinned():
    import inspect

    assert str(inspect.signature(write_html_report)) == \
        "(run_dir: 'Path', out: 'Path | None' = None, max_episodes_per_file: 'int' = 64) -> 'Path'"


def test_a_full_run_has_every_panel_the_tables_and_the_header(tmp_path):
    run = make_run_dir(tmp_path)
    out = write_html_report(run)
    assert out == run / "report.html"
    page = out.read_text()
    panels = charts(page)
    assert list(panels) == ["Success", "KL to the teacher", "Losses", "Step time", "Weight sync", "Held-out turns",
                            "Gradient norm", "Learning rate"]  # no PivotOPD / ActFirst scalars in this run
    assert [p["kind"] for p in panels.values()] == ["line"] * 3 + ["bars"] + ["line"] * 4
    # Success: the student's held-out evaluations, the teacher's single one as a level over every
    # step, the training episodes; on a 0-1 axis.
    success = panels["Success"]
    assert points(success, "student, held-out") == [[0.0, 0.25], [2.0, 0.5]]
    assert points(success, "teacher, held-out") == [[0.0, 0.75], [2.0, 0.75]]
    assert points(success, "student, training") == [[1.0, 0.5], [2.0, 0.5]]
    assert [s["dashed"] for s in success["series"]] == [False, True, False] and success["y_range"] == [0.0, 1.0]
    assert labels(panels["KL to the teacher"]) == ["reverse_kl_per_token", "reverse_kl/reverse_kl"]  # not clip_frac
    assert points(panels["KL to the teacher"], "reverse_kl_per_token") == [[1.0, 0.1], [2.0, 0.2]]
    # One term: the total and the term are the same numbers, drawn once (issue 54, item 7).
    assert labels(panels["Losses"]) == ["loss = loss/reverse_kl"]
    assert points(panels["Losses"], "loss = loss/reverse_kl") == [[1.0, 0.5], [2.0, 0.25]]
    assert panels["Weight sync"]["y_range"] == [0.0, None]
    assert labels(panels["Held-out turns"]) == ["eval/student_turns"]  # the teacher's turns were not logged
    # Step time: the phases stacked in the run's order, and what they leave of time/step_s as "other".
    bars = panels["Step time"]
    assert bars["labels"] == ["generation", "teacher scoring", "training", "weight sync", "other"]
    assert [step for step, _ in bars["stacks"]] == [1.0, 2.0]
    assert bars["stacks"][0][1] == pytest.approx([1.0, 0.5, 2.0, 0.1, 0.4])
    assert panels["Step time"]["subtitle"] == "seconds per training step, by phase"
    # Header: name, algorithm, environment, models, summary numbers.
    for text in ("<title>opd report: handmade</title>", "<h1>handmade</h1>", "vanilla_opd", "opd/FrozenLakeText-v0",
                 "/models/teacher", '<div class="card-value">75.0%</div><div class="card-label">teacher</div>',
                 "25.0%", "50.0%", "reverse_kl ×1", "held-out success on 4 tasks", "per step: generation 1.00s"):
        assert text in page, text
    # Evaluation tables: the pass@k grid (turns × k, "value [low, high]"), budgets, plot, comparison.
    assert "<th>pass@1</th><th>pass@8</th>" in page
    assert "<tr><th>3 turns</th><td>13.0% <small>[5.0%, 90.0%]</small></td><td>83.0% <small>[5.0%, 90.0%]</small>" \
        "</td></tr>" in page
    assert "<td>3</td><td>31.0%</td><td>–</td><td>2.9</td><td>0.4</td><td>truncated 200, success 56</td>" in page
    assert "<th>mean turns</th>" in page and "data:image/png;base64," in page
    assert "student of handmade · opd/FrozenLakeText-v0, split eval · 32 tasks × 8 samples" in page
    assert "95% intervals: bootstrap over tasks" in page
    assert "<th>all states</th><td>120</td><td>20.0%</td><td>70.0%</td><td>10.0%</td>" in page
    assert "stage: early" in page and "recovery: error recovery" in page and "B = after vs A = before" in page
    # Self-contained: nothing fetched at view time.
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', page)


def test_the_assets_are_inlined_and_cannot_close_their_elements(tmp_path):
    page = write_html_report(make_run_dir(tmp_path)).read_text()
    css, js = asset("report.css"), asset("report.js")
    assert f"<style>{css}</style>" in page and f"<script>{js}</script>" in page
    assert "</style" not in css.lower() and "</script" not in js.lower() and "<!--" not in js
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet", page)
    # The visual design the CSS carries: the palette of the page and the layout of the panels.
    assert "--ink:#0f172a" in css and ".panels{display:grid" in css and ".badge.pivot{background:#7c3aed}" in css


def test_panels_without_data_are_left_out(tmp_path):
    run = make_run_dir(tmp_path, training=False, evaluation=False)
    page = write_html_report(run, out=tmp_path / "elsewhere" / "r.html").read_text()
    panels = charts(page)
    assert list(panels) == ["Success", "Held-out turns"]
    assert labels(panels["Success"]) == ["student, held-out", "teacher, held-out"]  # no training episodes
    assert 'id="evaluations"' not in page and not (run / "report.html").exists()


def test_a_long_run_is_thinned_to_bin_means(tmp_path, monkeypatch):
    monkeypatch.setattr(html_report, "MAX_POINTS", 2)
    page = write_html_report(make_run_dir(tmp_path, train_steps=(1, 2, 3, 4))).read_text()
    panels = charts(page)
    assert points(panels["Losses"], "loss = loss/reverse_kl") == [[1.5, (0.5 + 0.25) / 2], [3.5, (0.5 / 3 + 0.125) / 2]]
    assert [x for point in points(panels["KL to the teacher"], "reverse_kl_per_token") for x in point] == \
        pytest.approx([1.5, 0.15, 3.5, 0.35])
    assert [step for step, _ in panels["Step time"]["stacks"]] == [2.0, 4.0]  # a bin at its last step


def test_an_observation_cannot_break_out_of_the_data_block(tmp_path):
    run = make_run_dir(tmp_path, observation=HOSTILE)
    page = write_html_report(run).read_text()
    assert "window.pwned" in page  # the text is there, escaped
    assert "</script><script>window.pwned" not in page and "<!-- <script>" not in page
    assert page.count("</script>") == 3  # the chart data's, the episode data's and the script's
    data = embedded(page)
    turns = next(f for f in data["files"] if f["group"] == "training samples")["episodes"][0]["turns"]
    assert HOSTILE in turns[1]["p"]  # decoded back exactly
    assert turns[0]["o"] == ""  # turn 0's observation is turn 1's prompt: embedded once


def test_run_text_in_the_header_and_the_curves_stays_text(tmp_path):
    run = make_run_dir(tmp_path, evaluation=False)
    (run / "config.yaml").write_text(f"name: {json.dumps(HOSTILE)}\nalgorithm: vanilla_opd\n")
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 3, "loss": 0.1, f"{HOSTILE}kl": 0.2, "time/step_s": 1.0}) + "\n")
    page = write_html_report(run).read_text()
    assert page.count("</script>") == 3 and "<script>window.pwned" not in page
    assert "<h1>you see &lt;/script&gt;&lt;script&gt;window.pwned = 1&lt;/script&gt;&lt;!-- &lt;script&gt; &amp; " \
           "done</h1>" in page
    assert f"{HOSTILE}kl" in labels(charts(page)["KL to the teacher"])  # decoded back exactly, for textContent


def test_token_colours_and_titles_follow_the_log_ratio(tmp_path):
    palette = ratio_palette()
    n = html_report.RATIO_STEPS
    assert len(palette) == 2 * n + 1 and palette[n] == "#ffffff"
    red, blue = (int(palette[0][i:i + 2], 16) for i in (1, 5)), (int(palette[-1][i:i + 2], 16) for i in (1, 5))
    assert list(red) == [220 + round(35 * 0.3), 38 + round(217 * 0.3)]  # the teacher finds it less likely: red
    r, b = blue
    assert b > r  # more likely: blue
    assert ratio_bucket(-1.0, -4.0) == -n and ratio_bucket(-1.0, -1.0) == 0 and ratio_bucket(-1.0, -0.5) == 2
    assert ratio_bucket(-1e9, 0.0) == n  # a -inf behaviour logprob saturates, never overflows

    page = write_html_report(make_run_dir(tmp_path)).read_text()
    data = embedded(page)
    train = next(f for f in data["files"] if f["name"] == "train_step_2.parquet")
    turn = train["episodes"][0]["turns"][0]
    assert turn["tok"] == ["ok\n", " ri", "ght"] and (turn["as"], turn["ae"]) == (1, 3)
    assert turn["b"] == [-1.0, -1.0, -1.0] and turn["t"] == [-4.0, -1.0, -0.5]
    assert [data["palette"][c + n] for c in turn["c"]] == [palette[0], "#ffffff", palette[n + 2]]
    assert train["episodes"][1]["turns"][0]["m"] == ["pivot"]
    unscored = next(f for f in data["files"] if f["name"] == "eval_student_step_0.parquet")["episodes"][0]["turns"][0]
    assert unscored["t"] == [] and unscored["c"] == []  # shown neutral
    # The colour key above the viewer: every palette colour, and where it saturates.
    assert "".join(f'<i style="background:{c}"></i>' for c in palette) in page
    assert "less likely (−3 nats)" in page and "more likely (+3)" in page
    # The title the viewer gives each token span carries both logprobs and their ratio.
    js = asset("report.js")
    for text in ('"student (behaviour) logprob " + num(b)', '"teacher logprob " + num(t)',
                 '"log-ratio teacher - student " + num(t - b)', 'span.style.backgroundColor = data.palette[bucket(turn, i) + N]',
                 'if (step === data.ratio_step) { return turn.c[i]; }'):
        assert text in js, text
    assert "badge" in js and 'el("span", "tok")' in js


def test_the_embedded_episodes_are_capped_and_the_page_says_so(tmp_path, monkeypatch):
    run = make_run_dir(tmp_path, episodes=10, train_steps=(1, 2, 3, 4))
    full = write_html_report(run, out=tmp_path / "full.html", max_episodes_per_file=64).read_text()
    assert "left out" not in note(full)
    monkeypatch.setattr(html_report, "MAX_FILES_PER_KIND", 3)
    page = write_html_report(run, max_episodes_per_file=3).read_text()
    data = embedded(page)
    train = [f for f in data["files"] if f["group"] == "training samples"]
    assert [f["name"] for f in train] == ["train_step_1.parquet", "train_step_3.parquet", "train_step_4.parquet"]
    assert all(len(f["episodes"]) == 3 and f["total"] == 10 for f in train)
    assert data["omitted_files"] == ["train_step_2.parquet"]
    assert "7 of 10 in train_step_1.parquet" in note(page) and "1 files left out" in note(page)
    assert "train_step_2.parquet" in note(page)
    assert len(json.dumps(data)) < len(json.dumps(embedded(full))) / 3


def test_a_run_without_episodes_or_metrics_still_gets_a_page(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    page = write_html_report(run).read_text()
    assert "No episode files" in page and "metrics.jsonl has no steps yet" in page and "<h1>empty</h1>" in page
    assert embedded(page, "chart-data") == [] and 'id="file-select"' not in page
    assert "no summary.json: the run did not finish" in page and '<div class="card-value">n/a</div>' in page
    assert viewer_data(run)["files"] == []
    with pytest.raises(FileNotFoundError, match="no run directory"):
        write_html_report(tmp_path / "missing")


def test_a_series_with_the_same_numbers_as_another_is_drawn_once_and_returns_get_a_panel(tmp_path):
    """Issue 54, items 1 and 7: the KL headline and its term (one line under the other before)
    are one line named for both; the training return, where it says more than success, has its
    panel with the spread within GRPO's groups."""
    run = make_run_dir(tmp_path)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        if "loss" in line:
            line.update({"reverse_kl/reverse_kl": line["reverse_kl_per_token"], "return": 0.75, "return/group_std": 0.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    panels = charts(write_html_report(run).read_text())
    assert labels(panels["KL to the teacher"]) == ["reverse_kl_per_token = reverse_kl/reverse_kl"]
    assert list(panels)[:2] == ["Success", "Return"]
    assert labels(panels["Return"]) == ["return", "return/group_std"]
    assert points(panels["Return"], "return") == [[1.0, 0.75], [2.0, 0.75]]
    # Where every return equals success (no reward but the goal), no panel repeats the success line.
    for line in lines:
        line.pop("return/group_std", None)
        if "return" in line:
            line["return"] = line["success"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert "Return" not in charts(write_html_report(run).read_text())


def test_evaluations_are_listed_in_the_order_they_were_run(tmp_path):
    """Issue 54, item 7: ``opd eval --name before`` then ``--name after`` read before, after (not by name)."""
    import os

    run = make_run_dir(tmp_path)
    before = json.loads((run / "eval" / "before.json").read_text())
    (run / "eval" / "after.json").write_text(json.dumps({**before, "name": "after", "plot": None}))
    for i, name in enumerate(("before.json", "compare_ab.json", "after.json")):
        os.utime(run / "eval" / name, ns=(10**18 + i * 10**9,) * 2)
    page = write_html_report(run).read_text()
    assert page.index("<h3>before") < page.index("<h3>after"), re.findall(r"<h3>[^<]*", page)


def test_an_evaluation_file_is_sampled_across_budgets_samples_and_outcomes(tmp_path):
    """Issue 54, item 2: 2,400 episodes of ``opd eval`` embedded as 64 over every budget, sample
    and outcome, not the first 64 (all sample 0 at the smallest budget)."""
    from opd.evaluation.html_report import sample_rows

    rows = [{"turn_budget": budget, "sample": sample, "success": budget == 8 and task % 3 == 0, "task": task}
            for budget in (2, 4, 8) for sample in range(8) for task in range(100)]
    picked = sample_rows(rows, 64)
    assert len(picked) == 64 and picked == [r for r in rows if r in picked]  # the file's order
    assert {r["turn_budget"] for r in picked} == {2, 4, 8} and {r["sample"] for r in picked} == set(range(8))
    assert {r["success"] for r in picked if r["turn_budget"] == 8} == {True, False}
    assert sample_rows(rows[:10], 64) == rows[:10]


def test_the_kl_by_turn_index_panel_sets_the_first_quarter_of_steps_against_the_last(tmp_path):
    """``kl_turn/<t>`` of 8 steps: the early line is the mean of steps 1-2, the late one of 7-8,
    each against the turn index (a turn only some steps reached averages those)."""
    run = make_run_dir(tmp_path, train_steps=tuple(range(1, 9)))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if "loss" in r:
            s = r["step"]
            r.update({"kl_turn/01": 0.1 * s, "kl_turn/02": 0.2 * s, **({"kl_turn/10": 1.0} if s in (2, 8) else {})})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    panel = charts(write_html_report(run).read_text())["KL by turn index"]
    assert panel["x_label"] == "turn" and labels(panel) == ["steps 1-2", "steps 7-8"]
    flat = lambda label: [x for point in points(panel, label) for x in point]  # noqa: E731
    assert flat("steps 1-2") == pytest.approx([1.0, 0.15, 2.0, 0.3, 10.0, 1.0])
    assert flat("steps 7-8") == pytest.approx([1.0, 0.75, 2.0, 1.5, 10.0, 1.0])
    assert [s["dashed"] for s in panel["series"]] == [True, False]
    assert "KL by turn index" not in charts(write_html_report(make_run_dir(tmp_path / "plain")).read_text())


def test_a_mixed_run_shows_success_per_environment_and_kl_per_teacher(tmp_path):
    """A run with ``env.mix`` (``success/<env>``, ``eval/<env>/*_success``, ``kl/<teacher>``): each
    environment's held-out and training success with its teacher's step-0 level across the run,
    and each teacher's KL; a run of one environment shows neither panel."""
    run = make_run_dir(tmp_path, train_steps=(1, 2, 3))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if r["step"] == 0 and "eval/student_success" in r:
            r.update({"eval/lake/student_success": 0.25, "eval/lake/teacher_success": 0.9,
                      "eval/simon/student_success": 0.0, "eval/simon/teacher_success": 1.0})
        if "loss" in r:
            r.update({"success/lake": 0.1 * r["step"], "success/simon": 0.0, "kl/one": 0.5 / r["step"], "kl/two": 0.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    found = charts(write_html_report(run).read_text())
    panel = found["Success per environment"]
    assert labels(panel) == ["lake, held-out", "simon, held-out", "lake, its teacher", "simon, its teacher",
                             "lake, training", "simon, training"]
    assert [p[1] for p in points(panel, "lake, its teacher")] == [0.9, 0.9]  # the level, first to last step
    assert points(panel, "lake, training") == [[1.0, 0.1], [2.0, 0.2], [3.0, pytest.approx(0.3)]]
    assert labels(found["KL per teacher"]) == ["kl/one", "kl/two"]
    assert points(found["KL per teacher"], "kl/one")[-1] == [3.0, pytest.approx(0.5 / 3)]
    plain = charts(write_html_report(make_run_dir(tmp_path / "plain")).read_text())
    assert "Success per environment" not in plain and "KL per teacher" not in plain
