"""Short OPD runs on ALFWorld and ScienceWorld with tiny models, through their recipes: the
environments plug into training (Ray actors, environments in child processes, DeepSpeed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", ["alfworld_tiny", "scienceworld_tiny"])
def test_opd_trains_on_the_environment(tmp_path, recipe):
    pytest.importorskip(recipe.removesuffix("_tiny"), reason=f"{recipe} needs the envs extra (`pip install -e .[envs]`, "
                        "scripts/setup.sh does it)")
    import ray

    from opd.cli import main

    cache = tmp_path.parent / "cache"
    run = tmp_path / "run"
    try:
        # Smaller than the recipe where it only costs time: fewer scripted episodes, steps, evaluations.
        code = main(["train", str(ROOT / "recipes" / f"{recipe}.yaml"), f"run.output_dir={run}", "run.total_steps=2",
                     "run.eval_episodes=2", f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}",
                     "teacher.bootstrap.n_episodes=8", "teacher.bootstrap.sft_steps=10", "teacher.bootstrap.corpus_episodes=6",
                     "student.bootstrap.n_episodes=4", "student.bootstrap.corpus_episodes=6"])
    finally:
        ray.shutdown()
    assert code == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "time/step_s" in line]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert math.isfinite(s["loss"]) and s["nonfinite_loss"] == 0.0 and s["grad_norm"] > 0
        assert s["env_errors"] == 0.0 and s["turns_per_episode"] >= 1
    # The evaluation episodes were played in the real engine: their observations are its text.
    from opd.evaluation.trajectories import read_episodes

    episodes = read_episodes(run / "trajectories" / "eval_student_step_2.parquet")
    assert len(episodes) == 2 and all(e["turns"] and e["turns"][0]["observation"] for e in episodes)
