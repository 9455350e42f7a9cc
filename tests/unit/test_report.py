"""The console's progress line and the report plot read the loss terms generically, so a
custom loss keeps its columns, and the plain line ends with the time left."""

from __future__ import annotations

import io
import json
from pathlib import Path

from opd.evaluation.report import second_panel, short_name, step_status, training_progress, write_report_plot
from opd.progress import format_duration

# A real metrics line of the tiny recipe (one reverse_kl term).
BUILT_IN = {"step": 1, "loss/reverse_kl": 0.1036, "reverse_kl/reverse_kl": 0.1036, "reverse_kl/clip_frac": 0.0,
            "reverse_kl/ratio_mean": 1.0, "loss": 0.1036, "nonfinite_loss": 0.0, "grad_norm": 0.288,
            "train_tokens": 190.0, "learning_rate": 0.0002, "success": 0.0, "turns_per_episode": 6.0,
            "valid_action_rate": 0.0, "tokens_per_s": 449.0, "reverse_kl_per_token": 0.1036,
            "time/generation_s": 0.43, "time/teacher_scoring_s": 0.15, "time/training_s": 1.69,
            "time/weight_sync_s": 0.019, "time/step_s": 2.29}
# A custom loss (reports no reverse KL) next to three built-ins: only three terms fit the line.
CUSTOM = {"step": 1, "loss/my_distillation_loss": 0.25, "my_distillation_loss/kl": 0.2, "loss/sft": 1.5,
          "loss/forward_kl": 0.3, "loss/pivot_preventive": 0.1, "loss": 2.15, "success": 0.5, "time/step_s": 1.0}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_plain_line_names_the_loss_terms_then_kl_and_ends_with_the_eta(capsys):
    clock = FakeClock()
    progress = training_progress(print, total=10, start=0, clock=clock)
    clock.now += 30.0  # three steps of 10 s each
    progress.advance(3, step_status(BUILT_IN))
    line = capsys.readouterr().out.strip()
    assert line == "step 3/10: loss +0.104 kl 0.104 succ 0.00 2.3s/it eta 1m10s"  # one term: it is the loss
    progress.advance(4, step_status({**BUILT_IN, "loss/sft": 0.5, "loss": 0.6036}))
    assert "loss +0.604 reverse_kl +0.104 sft +0.500 kl 0.104 succ" in capsys.readouterr().out


def test_a_custom_loss_keeps_its_columns_and_at_most_three_terms_are_shown(capsys):
    clock = FakeClock()
    progress = training_progress(print, total=4, start=2, clock=clock)  # resumed at step 2: the mean counts steps since
    clock.now += 5.0
    progress.advance(3, step_status(CUSTOM))
    line = capsys.readouterr().out.strip()
    assert line.startswith("step 3/4: loss +2.150 my_dist_loss +0.250 sft +1.500 forward_kl +0.300 succ 0.50")
    assert "pivo_prev" not in line and " kl " not in line  # the fourth term; no reverse KL headline
    assert line.endswith("eta 5s")


def test_the_terminal_bar_shows_the_terms_that_fit_and_keeps_its_time_columns():
    from rich.console import Console

    shown = {}
    for width in (200, 80):
        console = Console(file=io.StringIO(), force_terminal=True, color_system=None, width=width)
        progress = training_progress(console.log, total=2, start=0)
        progress.advance(1, step_status({**CUSTOM, "reverse_kl_per_token": 0.1}, progress.status_width))
        progress.close()
        shown[width] = console.file.getvalue().split("\r")[-1]
    assert "loss +2.150 my_dist_loss +0.250 sft +1.500 forward_kl +0.300 kl 0.100 succ 0.50 1.0s/it" in shown[200]
    assert "1/2 0:00:00 -:--:-- loss +2.150 kl 0.100 succ 0.50 1.0s/it" in shown[80]  # the terms did not fit


def test_short_names_and_durations():
    assert short_name("reverse_kl") == "reverse_kl" and short_name("pivot_preventive") == "pivo_prev"
    assert len(short_name("a_very_long_custom_loss_name_indeed")) <= 12
    assert [format_duration(s) for s in (0, 45.4, 80, 3600 + 5 * 60 + 3)] == ["0s", "45s", "1m20s", "1h05m"]


def test_the_second_panel_is_the_kl_headline_when_logged_else_each_loss_term(tmp_path):
    title, ylabel, series = second_panel([BUILT_IN, {**BUILT_IN, "step": 2, "reverse_kl_per_token": 0.09}])
    assert title == "sampled reverse KL to the teacher" and series == {"reverse KL": [(1, 0.1036), (2, 0.09)]}
    records = [{"step": 0, "eval/student_success": 0.25, "eval/teacher_success": 0.75}, CUSTOM,
               {**CUSTOM, "step": 2, "loss/sft": 1.0}]
    title, ylabel, series = second_panel(records)
    assert title == "loss terms" and ylabel == "loss"
    assert list(series) == ["my_distillation_loss", "sft", "forward_kl", "pivot_preventive"]
    assert series["sft"] == [(1, 1.5), (2, 1.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = write_report_plot(tmp_path)
    assert out == tmp_path / "report.png" and out.stat().st_size > 0


def test_training_returns_are_logged_with_their_spread_within_groups_and_shown_where_they_differ(capsys):
    """Issue 54, item 1: GRPO with partial credit (1 exact, 0.5 case-insensitive): the 0.5s show."""
    from opd.algorithms.step import episode_metrics, group_spread
    from opd.trajectory import Trajectory, Turn

    def episode(reward: float) -> Trajectory:
        traj = Trajectory(task="t", turns=[Turn([], [1], [0.0], 0, 1, "a", "obs", reward, info={"valid_action": True})])
        traj.success = reward == 1.0
        return traj

    rewards = [1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 1.0]  # two groups of four
    metrics = episode_metrics([episode(r) for r in rewards], {"generated_tokens": 8.0, "generation_s": 1.0}, 4)
    assert metrics["success"] == 3 / 8 and metrics["return"] == sum(rewards) / 8
    # The population std of each group: sqrt(0.046875) for (1, .5, .5, .5), 0.5 for (0, 0, 1, 1).
    assert abs(metrics["return/group_std"] - (0.046875 ** 0.5 + 0.5) / 2) < 1e-12
    assert group_spread(rewards, 4) == metrics["return/group_std"]
    assert "return/group_std" not in episode_metrics([episode(1.0)], {"generated_tokens": 1.0, "generation_s": 1.0})
    line = step_status({**BUILT_IN, **metrics})
    assert f"succ 0.38 ret 0.56±{metrics['return/group_std']:.2f} 2.3s/it" in line, line
    # Without groups, the return shows only where it says more than success (partial credit).
    assert "ret" not in step_status({**BUILT_IN, "success": 0.5, "return": 0.5})
    assert "succ 0.50 ret 0.62 " in step_status({**BUILT_IN, "success": 0.5, "return": 0.625})
    assert "ret 0.00 " in step_status({**BUILT_IN, "success": 0.5, "return": -0.001})  # never "-0.00"


def test_the_summary_table_says_step_in_the_singular_and_rates_as_percentages():
    """Issue 54, item 9: "student after 1 OPD steps"; a valid-action rate of 1 beside percentages; -0.00."""
    from rich.console import Console

    from opd.config import load_config
    from opd.evaluation.report import render_summary

    TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"

    console = Console(file=io.StringIO(), width=200, color_system=None)
    figures = {"valid_action_rate": 1.0, "return": -0.0004, "turns": 3.0}
    summary = {"eval_episodes": 4, "teacher_success": 1.0, "student_success_before": 0.25, "student_success_after": 0.5,
               "steps": 1, "train_time_s": 3.0, "run_dir": "runs/x",
               "heldout": {"teacher": figures, "student_before": figures, "student_after": figures},
               "time_split": {"generation_s_per_step": 1.0, "teacher_scoring_s_per_step": 0.5,
                              "training_s_per_step": 1.0, "weight_sync_s_per_step": 0.01}}
    render_summary(console, summary, load_config(TINY))
    shown = console.file.getvalue()
    assert "student after 1 OPD step " in shown and "steps" not in shown.split("student after")[1].split("│")[0]
    assert "100.0%" in shown.split("student after")[1] and "-0.000" not in shown and " 0.000 " in shown, shown
