"""Why OPD does not fix a reasoning student's misread state: the probe behind the view study's
FrozenLake result (docs/results.md).

    .venv/bin/python bench/state_copy.py                                    # the view recipe's student
    .venv/bin/python bench/state_copy.py --train-steps 20                   # + 20 in-process OPD steps
    .venv/bin/python bench/state_copy.py --train-steps 20 --loss forward_kl student.bootstrap.policy=expert \\
        student.bootstrap.sft_steps=150

A ``think: plan`` student first copies the observation's last line (``State: Around you: left
wall, down F, right H, up wall.``), then plans from its copy. The student plays ``--episodes``
held-out tasks greedily; at each turn whose copy is wrong, the first wrong token is a probe: the
student's probability of the token it wrote and of the true one, and the teacher's (reading the
student's own sequence). With ``--train-steps``, the student then trains in this process on the
real pieces (its own samples at the recipe's temperature, the teacher's scores in the recipe's
view, the token batch and the recipe's loss; plain AdamW at the recipe's learning rate, no Ray,
no DeepSpeed) and the probes are read again every five steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "studies" / "frozenlake_view.yaml"))
    parser.add_argument("--episodes", type=int, default=40, help="held-out tasks played greedily for the probes")
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--loss", default="", help="reverse_kl | forward_kl (default: the recipe's first loss)")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe")
    args = parser.parse_args(argv)

    import torch

    from opd.algorithms.step import build_token_batch, sample_tasks
    from opd.chat import ChatFormat, student_sequence
    from opd.config import load_config
    from opd.envs import EnvFactory
    from opd.generation.hf import HFEngine
    from opd.losses import combined_loss
    from opd.models import load_model, load_tokenizer
    from opd.provisioning import plan_text, resolve_model_path
    from opd.rollout.vanilla import EpisodeSettings, run_episodes
    from opd.supervision.teacher_view import score_trajectories
    from opd.training.trainer import student_logprobs_at, trained_positions_BT

    cfg = load_config(args.recipe, list(args.overrides))
    torch.manual_seed(cfg.run.seed)
    student_path = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, print)
    teacher_path = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print)
    tokenizer = load_tokenizer(student_path)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    student, teacher = load_model(student_path), load_model(teacher_path).eval()
    student_engine, teacher_engine = HFEngine(student, tokenizer.pad_token_id), HFEngine(teacher, tokenizer.pad_token_id)
    factory = EnvFactory(cfg.env.id, dict(cfg.env.kwargs), cfg.env.module)
    env = factory()
    train_tasks = env.unwrapped.task_ids(cfg.env.train_split)
    eval_tasks = env.unwrapped.task_ids(cfg.env.eval_split)[: args.episodes]
    env.close()

    def settings(temperature: float) -> EpisodeSettings:
        return EpisodeSettings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=temperature,
                               max_context_tokens=cfg.rollout.max_context_tokens, env_isolation="inprocess")

    # The probes: (context ids, the token the student wrote, the true token).
    probes, turns, wrong = [], 0, 0
    student.eval()
    for traj in run_episodes(student_engine, factory, eval_tasks, tokenizer, fmt, settings(0.0), cfg.run.seed):
        row = student_sequence(traj, fmt)
        ids = row["input_ids"]
        observations = [traj.initial_observation] + [turn.observation for turn in traj.turns]
        for (start, end), obs in zip(row["response_positions"], observations):
            # The state part of the bootstrap's own target for this observation.
            true_ids = tokenizer.encode(" " + plan_text(obs, "").split(" Plan:")[0], add_special_tokens=False)
            turns += 1
            for j, (wrote, true) in enumerate(zip(ids[start + 1:end], true_ids)):  # after <think>
                if wrote != true:
                    probes.append((ids[: start + 1 + j], wrote, true))
                    wrong += 1
                    break
    print(f"{len(eval_tasks)} held-out episodes, {turns} turns: the state copy is wrong in {wrong} ({wrong / max(turns, 1):.0%})")
    if not probes:
        return []

    @torch.no_grad()
    def read(model) -> tuple[float, float]:
        wrote_p = true_p = 0.0
        for context, wrote, true in probes:
            logp = torch.log_softmax(model(torch.tensor([context])).logits[0, -1].float(), dim=-1)
            wrote_p += float(logp[wrote].exp())
            true_p += float(logp[true].exp())
        return wrote_p / len(probes), true_p / len(probes)

    teacher_wrote, teacher_true = read(teacher)
    print(f"teacher at the {len(probes)} probes: p(the student's token) {teacher_wrote:.3f}, p(the true token) {teacher_true:.3f}")
    rows = []

    def report(step: int, metrics: dict[str, float]) -> None:
        student.eval()
        wrote_p, true_p = read(student)
        student.train()
        rows.append({"step": step, "student_wrote": wrote_p, "student_true": true_p, **metrics})
        extra = "".join(f", {k} {v:.3f}" for k, v in metrics.items())
        print(f"step {step:3d}: student p(its token) {wrote_p:.3f}, p(the true token) {true_p:.3f}{extra}", flush=True)

    report(0, {})
    if not args.train_steps:
        return rows
    term = cfg.losses[0]
    name = args.loss or term.name
    loss_args = dict(term.args or {}) if name == term.name else {}
    mode = "sampled" if name == "reverse_kl" and cfg.supervision.scoring == "sampled" else "topk"
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.trainer.learning_rate, weight_decay=0.0)
    student.train()
    for step in range(1, args.train_steps + 1):
        tasks = sample_tasks(train_tasks, cfg.rollout.episodes_per_step, cfg.run.seed, step)
        student.eval()
        trajs = run_episodes(student_engine, factory, tasks, tokenizer, fmt, settings(cfg.rollout.temperature),
                             cfg.run.seed * 1000 + step)
        student.train()
        scores = score_trajectories(teacher_engine, trajs, cfg.supervision.teacher_view, fmt, mode=mode,
                                    top_k=cfg.supervision.top_k)
        batch = build_token_batch(trajs, scores, tokenizer.pad_token_id, fmt).with_totals()
        picked, rows_NV = student_logprobs_at(student, batch, trained_positions_BT(batch), cfg.rollout.temperature,
                                              full_vocab=mode != "sampled")
        loss, metrics = combined_loss(batch.with_student(picked, rows_NV), [(name, 1.0, loss_args)])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.trainer.grad_clip_norm)
        optimizer.step()
        if step % 5 == 0 or step == args.train_steps:
            report(step, {"loss": float(loss.detach())})
    return rows


if __name__ == "__main__":
    main()
