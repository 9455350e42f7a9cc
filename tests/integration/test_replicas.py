"""Rollout and teacher replicas: ``resources.rollout_replicas`` and ``teacher_replicas`` share a
step's episodes and trajectories among actors, and the run is the same run.

Two real ``opd train`` runs of the tiny recipe (sampled rollouts at temperature 1), one actor per
role against two rollout and two teacher replicas: every episode plays the same tokens, actions
and rewards (each episode samples from its own seed, whichever replica plays it), the teacher's
scores are bit-identical, and step 2, played with the weights synced to both replicas after
step 1, is the same too. The behaviour logprobs and the losses agree to float32 rounding: a
replica batches 4 prompts where one actor batches 8, and a matrix product over a different batch
may round its last bit differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opd.runtime.actors import merge_collected, shares
from opd.training.trainer import rank_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


def test_shares_cut_in_order_and_rank_rows_balance_tokens():
    assert shares(list(range(5)), 2) == [(0, [0, 1, 2]), (3, [3, 4])]
    assert shares([1], 3) == [(0, [1])] and shares([], 2) == [(0, [])]
    assert [x for _, part in shares(list(range(11)), 4) for x in part] == list(range(11))
    assert rank_rows([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]
    assert rank_rows([3], 2) == [[0], []]
    split = rank_rows([9, 8, 7, 6, 5, 4, 3], 3)
    assert sorted(i for rows in split for i in rows) == list(range(7))
    assert max(sum([9, 8, 7, 6, 5, 4, 3][i] for i in rows) for rows in split) == 16  # longest first, to the lightest
    trajs, timing = merge_collected([(["a"], {"generation_s": 2.0, "generated_tokens": 3.0}),
                                     (["b", "c"], {"generation_s": 1.0, "generated_tokens": 4.0})])
    assert trajs == ["a", "b", "c"] and timing == {"generation_s": 2.0, "generated_tokens": 7.0}


def _run(run_dir: Path, cache: Path, replicas: int) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run_dir}", "run.total_steps=2",
         "run.trajectory_every_steps=1", "run.trajectory_episodes=8", f"student.bootstrap.cache_dir={cache}",
         f"teacher.bootstrap.cache_dir={cache}", f"resources.teacher_replicas={replicas}",
         f"resources.rollout_replicas={replicas}", "resources.teacher_cpus=0.25", "resources.rollout_cpus=0.25"],
        cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def _episodes(run_dir: Path, step: int) -> list[dict]:
    import pyarrow.parquet as pq

    return sorted(pq.read_table(run_dir / "trajectories" / f"train_step_{step}.parquet").to_pylist(),
                  key=lambda r: r["episode"])


@pytest.mark.integration
def test_two_rollout_and_two_teacher_replicas_play_and_score_the_same_steps(tmp_path):
    _run(tmp_path / "one", tmp_path / "cache", 1)
    _run(tmp_path / "two", tmp_path / "cache", 2)
    placement = json.loads((tmp_path / "two" / "summary.json").read_text())["placement"]
    assert len(placement["rollout"]) == 2 and len(placement["teacher"]) == 2 and len(placement["trainer"]) == 1

    for step in (1, 2):
        one, two = _episodes(tmp_path / "one", step), _episodes(tmp_path / "two", step)
        assert len(one) == len(two) == 8
        for a, b in zip(one, two):
            assert len(a["turns"]) == len(b["turns"])
            for x, y in zip(a["turns"], b["turns"]):
                for key in ("response_ids", "action", "observation", "reward", "teacher_logprobs"):
                    assert x[key] == y[key], (step, a["episode"], key)
                assert y["behaviour_logprobs"] == pytest.approx(x["behaviour_logprobs"], abs=2e-6)

    def steps(run_dir: Path) -> list[dict]:
        return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in r]

    for a, b in zip(steps(tmp_path / "one"), steps(tmp_path / "two")):
        for key in ("loss", "grad_norm", "success", "train_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
