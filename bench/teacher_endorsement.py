"""Does the teacher endorse the student's mistakes? Read from an OPD run's training samples.

    .venv/bin/python bench/teacher_endorsement.py runs/fidelity/alfworld-varied/<run>

Every turn of the run's ``trajectories/train_step_N.parquet`` (the student's sampled episodes with
the teacher's logprob of each response token) falls in one kind: it repeats the turn before's
action, or it is the environment's expert action (where the env names one), another valid action,
or an invalid one. Per kind: turns, the mean probability of the whole response under the teacher and
under the student that sampled it (at the rollout's temperature, as the run logged it), and the share of turns where the teacher's is the higher, which
is where on-policy distillation pushes that response up. A teacher that gives the student's
repeats and invalid actions as much as the student does teaches them. Then, per held-out evaluation
(``eval_{student,teacher}_step_N``, greedy), the share of the turns that repeat the turn before's
action and the share that are valid: whether the student learned to loop, and how often the
teacher itself does.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

KINDS = ("repeats the last action", "the expert's action", "another valid action", "invalid action")


def turns_of(episodes: list[dict]):
    """Every turn of ``episodes``, each with whether its action repeats the turn before's."""
    for episode in episodes:
        previous = None
        for turn in episode["turns"]:
            action = str(turn["action"]).strip()
            yield turn, action == previous
            previous = action


def kind_of(turn: dict, repeated: bool) -> str:
    if repeated:
        return KINDS[0]
    if turn.get("expert_action") and str(turn["action"]).strip() == str(turn["expert_action"]).strip():
        return KINDS[1]
    return KINDS[2] if turn["valid_action"] else KINDS[3]


def endorsement(episodes: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind: ``turns``, ``teacher`` and ``student`` (mean probability of the response) and
    ``teacher_higher`` (share of turns where the teacher's logprob of the response is the higher)."""
    sums = {k: {"turns": 0, "teacher": 0.0, "student": 0.0, "teacher_higher": 0} for k in KINDS}
    for turn, repeated in turns_of(episodes):
        teacher, student = turn.get("teacher_logprobs"), turn.get("behaviour_logprobs")
        if teacher is None or not len(teacher):  # unscored; it still counts as the next turn's previous one
            continue
        row = sums[kind_of(turn, repeated)]
        t, s = float(sum(teacher)), float(sum(student))
        row["turns"] += 1
        row["teacher"] += math.exp(t)
        row["student"] += math.exp(s)
        row["teacher_higher"] += t > s
    return {k: {"turns": v["turns"], **{m: v[m] / v["turns"] for m in ("teacher", "student", "teacher_higher")}}
            for k, v in sums.items() if v["turns"]}


def repeat_share(episodes: list[dict]) -> tuple[float, float, int]:
    """Of all turns of ``episodes``: the share that repeat the turn before's action, the share of
    valid actions, and the number of turns."""
    turns = repeats = valid = 0
    for turn, repeated in turns_of(episodes):
        turns += 1
        repeats += repeated
        valid += bool(turn["valid_action"])
    return (repeats / turns, valid / turns, turns) if turns else (math.nan, math.nan, 0)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)

    from opd.evaluation.trajectories import read_episodes, run_episode_files

    files = [f for f in run_episode_files(args.run_dir) if f.name.startswith("train_step_")]
    if not files:
        raise SystemExit(f"{args.run_dir}/trajectories holds no train_step_N.parquet: run.trajectory_every_steps "
                         "writes them during training")
    table = endorsement([e for f in files for e in read_episodes(f)])
    print(f"{len(files)} training samples of {args.run_dir}: "
          + ", ".join(f.stem.removeprefix("train_step_") for f in files))
    print("| the student's response | turns | P teacher | P student | teacher's higher |")
    print("|---|---|---|---|---|")
    for kind, row in table.items():
        print(f"| {kind} | {row['turns']} | {row['teacher']:.2f} | {row['student']:.2f} | {100 * row['teacher_higher']:.0f}% |")
    evals = [f for f in run_episode_files(args.run_dir) if f.name.startswith("eval_")]
    if evals:
        print("\n| held-out evaluation | turns | repeats the last action | valid |\n|---|---|---|---|")
    for f in evals:
        repeats, valid, turns = repeat_share(read_episodes(f))
        who, step = f.stem.removeprefix("eval_").split("_step_")
        print(f"| {who}, step {step} | {turns} | {100 * repeats:.0f}% | {100 * valid:.0f}% |")
    return table


if __name__ == "__main__":
    main()
