"""Where the teacher disagrees with the student: the sampled reverse KL (log mu - log pi_T of
each token the student sampled) split by the part of the response it falls in, for a recipe
whose models think in the bootstrap's ``plan`` format (``<think> State: ... Plan: ... </think>``).

    .venv/bin/python bench/kl_by_segment.py                                  # FrozenLake ActFirst recipe
    .venv/bin/python bench/kl_by_segment.py --history full --episodes 64

The student (HF engine, in this process) plays ``--episodes`` train tasks at the recipe's
temperature with past turns shown as ``--history``; the teacher scores them in the recipe's
view. Printed: tokens, mean KL per token and share of the total for the state summary (before
``Plan:``), the plan (up to ``</think>``) and the action with its end token, then the tokens
with the largest gaps and the text before each.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "actfirst_frozenlake.yaml"))
    parser.add_argument("--history", default="state_grounded", choices=("state_grounded", "full"))
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--top", type=int, default=15, help="largest per-token gaps to print")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from opd.config import load_config
    from opd.envs import EnvFactory
    from opd.rollout.vanilla import EpisodeSettings
    from opd.runtime.actors import RolloutWorker, TeacherWorker
    from opd.provisioning import resolve_model_path
    from opd.supervision.teacher_view import unpack_scores

    cfg = load_config(args.recipe, ["student.engine=hf", "teacher.engine=hf", *args.overrides])
    student_path = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, print)
    teacher_path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print)
    student = RolloutWorker(OmegaConf.to_container(cfg.student, resolve=True), student_path, 0)
    teacher = TeacherWorker(OmegaConf.to_container(cfg.teacher, resolve=True), teacher_path, 0)
    factory = EnvFactory(cfg.env.id, dict(cfg.env.kwargs), cfg.env.module)
    probe = factory()
    tasks = probe.unwrapped.task_ids(cfg.env.train_split)[: args.episodes]
    probe.close()
    settings = EpisodeSettings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                               max_context_tokens=cfg.rollout.max_context_tokens, env_isolation="inprocess",
                               history=args.history)
    trajs, _ = student.collect(factory, tasks, settings, cfg.run.seed)
    scores = teacher.score(trajs, cfg.supervision)

    tokenizer = student.tokenizer
    total, count, gaps = collections.Counter(), collections.Counter(), []
    for traj, score in zip(trajs, scores):
        for turn, teacher_lp in zip(traj.turns, unpack_scores(traj, list(score.logprobs))):
            text = ""
            for token, mu, pt in zip(turn.response_ids, turn.response_logprobs, teacher_lp):
                segment = "action + end" if "</think>" in text else ("plan" if "Plan:" in text else "state")
                total[segment] += mu - pt
                count[segment] += 1
                piece = tokenizer.decode([token], skip_special_tokens=False)
                gaps.append((mu - pt, segment, text[-40:], piece, mu, pt))
                text += piece
    grand = sum(total.values())
    print(f"{len(trajs)} episodes, history {args.history}, success {sum(t.success for t in trajs) / len(trajs):.0%}")
    result = {}
    for segment in ("state", "plan", "action + end"):
        n = count[segment]
        result[segment] = {"tokens": n, "mean": total[segment] / max(n, 1), "share": total[segment] / grand if grand else 0.0}
        print(f"{segment:13s} {n:6d} tokens, mean KL {result[segment]['mean']:.3f}, share {result[segment]['share']:.2f}")
    for gap, segment, before, piece, mu, pt in sorted(gaps, reverse=True)[: args.top]:
        print(f"{gap:6.2f} {segment:13s} ...{before!r} -> {piece!r} (student {mu:.2f}, teacher {pt:.2f})")
    return result


if __name__ == "__main__":
    main()
