"""Curricula through the whole loop (the tiny recipe on the local backend): a forward turn-depth
curriculum logs its depth each step, plays no more turns than it, trains only those, and the
episode files mark the rest; a backward one plays every turn and trains the last ones; episodes
that start from the expert's replayed prefixes carry them as context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, name: str, *overrides: str, key: str = "curriculum/depth") -> list[dict]:
    cache = tmp_path / "cache"
    run_dir = tmp_path / name
    done = subprocess.run(
        [sys.executable, "-m", "opd.cli", "train", str(ROOT / "tests" / "data" / "tiny.yaml"), f"run.output_dir={run_dir}",
         f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}", "run.backend=local",
         "run.total_steps=3", "run.save_every_steps=0", "run.trajectory_every_steps=1", "curriculum.start_depth=1",
         "curriculum.full_depth_step=3", *overrides],
        cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if key in line]


def test_a_depth_curriculum_runs_through_the_loop(tmp_path):
    import pyarrow.parquet as pq

    steps = _train(tmp_path, "forward", "curriculum.depth=forward")
    # horizon 6 (the env's max_turns): 1 turn at step 1, 1 + round(5 / 2) at step 2, all 6 at step 3
    assert [s["curriculum/depth"] for s in steps] == [1.0, 3.0, 6.0]
    assert steps[0]["turns_per_episode"] == 1.0 and steps[1]["turns_per_episode"] <= 3.0
    assert [s["curriculum/trained_turn_share"] for s in steps] == [1.0, 1.0, 1.0]  # forward trains what it plays
    first = pq.read_table(next((tmp_path / "forward" / "trajectories").glob("*step_1*"))).to_pylist()
    assert first and all(len(e["turns"]) == 1 for e in first)
    assert all(e["end_reason"] in ("depth_limit", "success", "failure") for e in first)

    steps = _train(tmp_path, "backward", "curriculum.depth=backward")
    assert [s["curriculum/depth"] for s in steps] == [1.0, 3.0, 6.0]
    first = steps[0]
    assert first["turns_per_episode"] > 1.0, "a backward curriculum plays every turn"
    # one turn of each episode trains at step 1
    assert first["curriculum/trained_turn_share"] == pytest.approx(1.0 / first["turns_per_episode"])
    assert steps[2]["curriculum/trained_turn_share"] == 1.0
    episodes = pq.read_table(next((tmp_path / "backward" / "trajectories").glob("*step_1*"))).to_pylist()
    for e in episodes:
        marks = ["context" in turn["marks"] for turn in e["turns"]]
        assert marks == [True] * (len(marks) - 1) + [False]


def test_episodes_start_from_replayed_prefixes_through_the_loop(tmp_path):
    import pyarrow.parquet as pq

    steps = _train(tmp_path, "prefix", "curriculum.prefix_source=expert", "curriculum.prefix_fraction=0.9",
                   "curriculum.prefix_end_step=3", key="curriculum/prefix_turns")
    assert len(steps) == 3 and steps[0]["curriculum/prefix_turns"] > 0 and steps[2]["curriculum/prefix_turns"] == 0
    assert steps[0]["curriculum/trained_turn_share"] < 1.0 == steps[2]["curriculum/trained_turn_share"]
    episodes = pq.read_table(next((tmp_path / "prefix" / "trajectories").glob("*step_1*"))).to_pylist()
    replayed = [["replayed" in turn["marks"] for turn in e["turns"]] for e in episodes]
    assert any(any(r) for r in replayed)
    for marks in replayed:  # a prefix, then the student's own turns
        assert marks == sorted(marks, reverse=True) and not all(marks)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_the_teacher_plays_a_falling_share_of_turns_through_the_loop(tmp_path, backend):
    """On Ray the rollout actor asks a teacher actor for the guided turns."""
    import pyarrow.parquet as pq

    steps = _train(tmp_path, "guided", f"run.backend={backend}", "curriculum.guide_share=0.6",
                   "curriculum.guide_end_step=3", key="curriculum/guide_share")
    assert [s["curriculum/guide_share"] for s in steps] == pytest.approx([0.6, 0.3, 0.0])
    assert steps[0]["curriculum/teacher_turns"] > 0 and steps[2]["curriculum/teacher_turns"] == 0
    assert steps[0]["curriculum/trained_turn_share"] < 1.0 == steps[2]["curriculum/trained_turn_share"]
    episodes = pq.read_table(next((tmp_path / "guided" / "trajectories").glob("*step_1*"))).to_pylist()
    marked = [turn["marks"] for e in episodes for turn in e["turns"] if "teacher" in turn["marks"]]
    assert marked and all("context" in marks for marks in marked)
