"""Whether a reasoning student still tells a decision turn from a question turn: the probe behind
the view study's clinical result (docs/results.md).

    .venv/bin/python bench/decision_probe.py                       # the view study's six runs
    .venv/bin/python bench/decision_probe.py --runs RUN_DIR [RUN_DIR ...]

The teacher's greedy work-ups of the held-out tasks (a run's ``eval_teacher_step_0`` trajectories)
are read by each student as its own history (the full view, clean plans). At every turn, right
after the plan's ``Plan:``, the probe reads the student's next-token distribution: the mass on the
teacher's action word (``ask``, ``test`` or ``commit``; its first token), the mass on ``commit``,
and which of the three words is its argmax, split by what the teacher did at that turn. The
starting student is the first run's step 0, each trained one its last checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIEW_RUNS = [ROOT / "runs" / "fidelity" / "view" / f"clinical_diagnostic_{view}-seed{seed}"
             for view in ("state_grounded", "full") for seed in (0, 1, 2)]
WORDS = ("ask", "test", "commit")


def episode_probes(turns, tokenizer, fmt) -> tuple[list[int], list[tuple[int, str]]]:
    """One episode as the student's own sequence (:func:`opd.chat.student_sequence`, the ids it
    saw in its rollouts), and (position predicting the action's first word, the teacher's first
    word) of each turn whose response has a ``Plan:``."""
    from opd.chat import standard_prompt_ids, student_sequence
    from opd.trajectory import Trajectory, Turn

    plan_ids = tokenizer.encode(" Plan:", add_special_tokens=False)
    traj, words = Trajectory(task=""), []
    for k, turn in enumerate(turns):
        observation = turn["prompt"].split("user\n", 1)[1].rsplit("<|im_end|>", 1)[0]  # the message's text
        response = [int(t) for t in turn["response_ids"]]
        traj.turns.append(Turn(prompt_ids=standard_prompt_ids(fmt, tokenizer, observation, first=k == 0),
                               response_ids=response, response_logprobs=[0.0] * len(response)))
        words.append(turn["action"].split()[0])
    row = student_sequence(traj, fmt)
    probes = []
    for (start, end), word in zip(row["response_positions"], words):
        response = row["input_ids"][start:end]
        for j in range(len(response) - len(plan_ids), -1, -1):
            if response[j:j + len(plan_ids)] == plan_ids:
                probes.append((start + j + len(plan_ids) - 1, word))
                break
    return row["input_ids"], probes


def probe(model_dir: str, episodes: list[tuple[list[int], list[tuple[int, str]]]], word_ids: dict[str, int]) -> dict:
    """Per teacher word: turns, the student's mean P(that word), mean P(commit) and argmax shares."""
    import torch

    from opd.models import load_model

    model = load_model(model_dir)
    columns = [word_ids[w] for w in WORDS]
    rows: dict[str, list] = {w: [] for w in WORDS}
    with torch.no_grad():
        for ids, probes in episodes:
            logp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
            for pos, word in probes:
                if word in rows:
                    rows[word].append(logp_TV[pos, columns].exp())
    out = {}
    for word, got in rows.items():
        if not got:
            continue
        p_NW = torch.stack(got)
        argmax_N = p_NW.argmax(dim=-1)
        out[word] = {"turns": len(got), "p_own": float(p_NW[:, WORDS.index(word)].mean()),
                     "p_commit": float(p_NW[:, WORDS.index("commit")].mean()),
                     "argmax": {w: float((argmax_N == i).float().mean()) for i, w in enumerate(WORDS)}}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=Path, default=VIEW_RUNS, help="view-study run directories")
    args = parser.parse_args(argv)
    import pandas as pd

    from opd.chat import ChatFormat
    from opd.models import load_tokenizer

    missing = [str(r) for r in args.runs if not (r / "config.yaml").is_file()]
    if missing:
        raise SystemExit(f"no run at {', '.join(missing)}; "
                         "run `bench/fidelity.py --study view --groups clinical` first")
    first = args.runs[0]
    models = {"start": model_of(f"{first}@0")}
    models.update({run.name.removeprefix("clinical_diagnostic_"): model_of(str(run)) for run in args.runs})
    tokenizer = load_tokenizer(models["start"])
    fmt = ChatFormat.from_tokenizer(tokenizer)
    word_ids = {w: tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in WORDS}
    teacher = pd.read_parquet(first / "trajectories" / "eval_teacher_step_0.parquet")
    episodes = [episode_probes(turns, tokenizer, fmt) for turns in teacher["turns"]]
    results = {}
    print(f"{len(episodes)} teacher work-ups, turns by the teacher's word: "
          + ", ".join(f"{w} {sum(p[1] == w for _, ps in episodes for p in ps)}" for w in WORDS))
    print("student | teacher's word | P(that word) | P(commit) | argmax ask / test / commit")
    for name, path in models.items():
        results[name] = probe(path, episodes, word_ids)
        for word, r in results[name].items():
            shares = " / ".join(f"{r['argmax'][w]:.0%}" for w in WORDS)
            print(f"{name} | {word} | {r['p_own']:.2f} | {r['p_commit']:.2f} | {shares}", flush=True)
    return results


def model_of(source: str) -> str:
    """The model directory ``opd eval SOURCE`` would load (``RUN@0``: the starting student; ``RUN``:
    its last complete checkpoint, verified)."""
    from opd.runtime.offline import resolve_source

    return resolve_source(source, None, [], lambda *_: None).path


if __name__ == "__main__":
    main()
