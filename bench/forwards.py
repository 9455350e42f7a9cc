"""How a forward is cut, measured on real rows: length grouping and split attention.

    .venv/bin/python bench/forwards.py                 # FrozenLake 6x6, 16 episodes
    .venv/bin/python bench/forwards.py --episodes 32 --recipe recipes/quickstart.yaml

The recipe's student plays the episodes; its teacher scores them and the DeepSpeed trainer
trains on them, each timed both ways on the same rows:

1. **Length grouping.** One row per episode gives rows of very different lengths (an episode
   that ends in a hole at turn 2 next to one that plays 20 turns). Padded into one forward,
   every row pays the longest one's attention, which grows with the square of the length. With
   no cap (``supervision.score_batch_tokens: 0``, ``trainer.micro_batch_tokens: 0``, one padded
   forward of up to ``score_batch_size`` / ``micro_batch_size`` rows) against the cap (4096
   padded tokens, the default); the bootstrap SFT step the same way.
2. **Fast attention** (:mod:`opd.generation.packed`), each under the cap:

   - split attention on packed rows: the teacher's state-grounded rows and ActFirst's training
     rows (one packed row per episode, each full response a branch) with one ``[L, L]`` branch
     mask against causal trunk attention plus the branch rows;
   - plain right-padded rows (vanilla OPD's training rows) with their padding mask against none.

Both sides give the same numbers; the benchmark checks that, then reports each speed-up as a
ratio measured in this run (median of ``--repeats``; the fast-attention pairs interleaved), in
``<out>/forwards.json`` and ``.md``. The baseline of the second part, the one-mask forwards, lives
here (:func:`one_mask_forwards`): the library has only the fast path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where the library calls its forwards: the baseline swaps them in every one of these modules.
FORWARD_USERS = ("opd.generation.packed", "opd.generation.hf", "opd.training.trainer")


@contextlib.contextmanager
def one_mask_forwards(on: bool = True):
    """Inside, the library's packed and causal forwards are the one-mask ones (the baseline): a
    packed row with its ``[L, L]`` branch mask, a plain row with its padding mask."""
    import importlib

    from opd.generation.base import branch_attention_mask

    def packed_forward(model, input_ids_BL, position_ids_BL, branch_BL, valid_BL):
        device = input_ids_BL.device
        mask_B1LL = branch_attention_mask(branch_BL.to(device), valid_BL.to(device))
        return model(input_ids=input_ids_BL, attention_mask=mask_B1LL, position_ids=position_ids_BL.to(device)).logits

    def causal_forward(model, input_ids_BL, valid_BL):
        return model(input_ids=input_ids_BL, attention_mask=valid_BL.to(input_ids_BL.device).long()).logits

    modules = [importlib.import_module(name) for name in FORWARD_USERS]
    saved = [(m, m.packed_forward, m.causal_forward) for m in modules]
    try:
        if on:
            for m in modules:
                m.packed_forward, m.causal_forward = packed_forward, causal_forward
        yield
    finally:
        for m, packed, causal in saved:
            m.packed_forward, m.causal_forward = packed, causal


def _median_time(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up (allocator, first-call paths)
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "actfirst_frozenlake.yaml"))
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=4096, help="the cap measured against no cap")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench_forwards")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    from omegaconf import OmegaConf

    from opd.algorithms.actfirst_opd import build_episode_batch
    from opd.algorithms.step import build_token_batch
    from opd.chat import ChatFormat, student_sequence
    from opd.cli import _quiet_libraries
    from opd.config import load_config
    from opd.envs import EnvFactory
    from opd.bootstrap import resolve_model_path
    from opd.bootstrap import sft as bootstrap_sft
    from opd.generation import make_engine
    from opd.models import load_tokenizer, tiny_qwen3
    from opd.rollout.vanilla import EpisodeSettings, run_episodes
    from opd.supervision.teacher_view import score_trajectories
    from opd.training.trainer import StudentTrainer, TrainerSpec

    _quiet_libraries()
    cfg = load_config(args.recipe, ["algorithm=vanilla_opd"])
    student = resolve_model_path(cfg.student, cfg.env, cfg.run.seed, print)
    teacher = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print)
    tokenizer = load_tokenizer(student)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    factory = EnvFactory.of(cfg.env)
    probe = factory()
    tasks = probe.unwrapped.task_ids(cfg.env.train_split)[: args.episodes]
    probe.close()
    settings = EpisodeSettings(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                               max_context_tokens=cfg.rollout.max_context_tokens, system_prompt=cfg.rollout.system_prompt,
                               env_isolation="none", env_timeout_s=cfg.env.timeout_s)
    trajs = run_episodes(make_engine("hf", student, "float32", False, 0.0), factory, tasks, tokenizer, fmt, settings, seed=0)

    teacher_engine = make_engine("hf", teacher, "float32", False, 0.0)
    view, size = cfg.supervision.teacher_view, cfg.supervision.score_batch_size
    score = {cap: _median_time(lambda cap=cap: score_trajectories(teacher_engine, trajs, view, fmt, size, batch_tokens=cap),
                               args.repeats) for cap in (0, args.batch_tokens)}
    gap = max(abs(x - y) for a, b in zip(score[0][1], score[args.batch_tokens][1]) for x, y in zip(a.logprobs, b.logprobs))
    if gap > 1e-4:
        raise SystemExit(f"the two scorings differ by {gap}: length batching changed the teacher's scores")

    batch = build_token_batch(trajs, score[0][1], fmt.pad_id, fmt)
    terms = [(loss.name, loss.weight, dict(loss.args)) for loss in cfg.losses]
    train = {}
    for cap in (0, args.batch_tokens):
        trainer_cfg = OmegaConf.merge(cfg.trainer, {"micro_batch_size": len(trajs), "micro_batch_tokens": cap})
        trainer = StudentTrainer(TrainerSpec(trainer_cfg, tuple(terms), student, episodes_per_step=len(trajs),
                                             temperature=cfg.rollout.temperature))
        train[cap] = _median_time(lambda: trainer.train_step(batch), args.repeats)
    losses = [train[cap][1]["loss"] for cap in train]
    if abs(losses[0] - losses[1]) > 1e-4 * max(1.0, abs(losses[0])):
        raise SystemExit(f"the two trainer steps give losses {losses}: length batching changed the loss")

    sft_boot = OmegaConf.merge(cfg.student.bootstrap, {"sft_steps": args.repeats, "batch_size": len(trajs)})
    rows = [student_sequence(t, fmt) for t in trajs]
    sft = {}
    for cap in (0, args.batch_tokens):
        bootstrap_sft.SFT_BATCH_TOKENS = cap
        model = tiny_qwen3(tokenizer, cfg.student.bootstrap.arch, seed=0).train()
        start = time.perf_counter()
        bootstrap_sft.sft(model, rows, fmt.pad_id, sft_boot, seed=0, log=lambda _: None)
        sft[cap] = (time.perf_counter() - start) / args.repeats

    # Interleaved (one mask, split, one mask, ...) so that the machine's drift hits both sides alike.
    cap = args.batch_tokens
    packed_batch = build_episode_batch(trajs, score[cap][1], fmt.pad_id, fmt)
    trainer_cfg = OmegaConf.merge(cfg.trainer, {"micro_batch_size": len(trajs), "micro_batch_tokens": cap})
    spec = TrainerSpec(trainer_cfg, tuple(terms), student, episodes_per_step=len(trajs), temperature=cfg.rollout.temperature)
    trainers = {split: StudentTrainer(spec) for split in (False, True)}
    # The two trainers take the same updates in the same order, so their losses stay comparable.
    jobs = {"score": lambda split: score_trajectories(teacher_engine, trajs, view, fmt, size, batch_tokens=cap),
            "train": lambda split: trainers[split].train_step(packed_batch),
            "train_plain": lambda split: trainers[split].train_step(batch)}
    split_times = {(job, split): [] for job in jobs for split in (False, True)}
    split_out = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for job, fn in jobs.items():
            for split in (False, True):
                with one_mask_forwards(on=not split):
                    start = time.perf_counter()
                    split_out[job, split] = fn(split)
                    if repeat:
                        split_times[job, split].append(time.perf_counter() - start)
    split_median = {key: statistics.median(times) for key, times in split_times.items()}
    split_gap = max(abs(x - y) for a, b in zip(split_out["score", False], split_out["score", True])
                    for x, y in zip(a.logprobs, b.logprobs))
    split_losses = [split_out["train", False]["loss"], split_out["train", True]["loss"]]  # same updates, same step
    plain_losses = [split_out["train_plain", False]["loss"], split_out["train_plain", True]["loss"]]
    if split_gap > 1e-4 or any(abs(a - b) > 1e-4 * max(1.0, abs(a)) for a, b in (split_losses, plain_losses)):
        raise SystemExit(f"fast attention changed the numbers: scores by {split_gap}, losses {split_losses}, {plain_losses}")
    packed_lengths = packed_batch.attention_mask_BT.sum(1).tolist()
    branch_tokens = int((packed_batch.branch_ids_BT > 0).sum())

    lengths = batch.attention_mask_BT.sum(1).tolist()
    result = {
        "recipe": args.recipe, "episodes": len(trajs), "batch_tokens": args.batch_tokens, "torch_threads": torch.get_num_threads(),
        "row_tokens": {"total": sum(lengths), "min": min(lengths), "max": max(lengths)},
        "teacher_scoring_s": {"padded": score[0][0], "length_grouped": score[args.batch_tokens][0]},
        "trainer_step_s": {"padded": train[0][0], "length_grouped": train[args.batch_tokens][0]},
        "sft_step_s": {"padded": sft[0], "length_grouped": sft[args.batch_tokens]},
        "max_score_gap": gap, "losses": losses,
        "packed_rows": {"tokens": sum(packed_lengths), "branch_tokens": branch_tokens, "min": min(packed_lengths),
                        "max": max(packed_lengths)},
        "packed_teacher_scoring_s": {"one_mask": split_median["score", False], "split": split_median["score", True]},
        "packed_trainer_step_s": {"one_mask": split_median["train", False], "split": split_median["train", True]},
        "plain_trainer_step_s": {"padding_mask": split_median["train_plain", False], "no_mask": split_median["train_plain", True]},
        "packed_times_s": {f"{job}_{'split' if split else 'one_mask'}": times for (job, split), times in split_times.items()},
        "split_max_score_gap": split_gap, "split_losses": split_losses, "plain_losses": plain_losses,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forwards.json").write_text(json.dumps(result, indent=2))
    lines = [f"Length-grouped forwards (cap {args.batch_tokens} padded tokens) against one padded forward: "
             f"{len(trajs)} episodes of {args.recipe}, rows of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all)", "",
             "| | padded to the longest (s) | length-grouped (s) | speed-up |", "|---|---|---|---|"]
    for name, key in (("teacher scoring", "teacher_scoring_s"), ("trainer step (DeepSpeed)", "trainer_step_s"),
                      ("bootstrap SFT step", "sft_step_s")):
        padded, grouped = result[key]["padded"], result[key]["length_grouped"]
        lines.append(f"| {name} | {padded:.2f} | {grouped:.2f} | **{padded / grouped:.2f}x** |")
    lines += ["", f"Same results: teacher scores within {gap:.1e}, losses {losses[0]:.6f} / {losses[1]:.6f}.", "",
              f"Split attention on packed rows (trunk causal + branch rows) against one branch mask, cap {cap}: "
              f"{len(packed_lengths)} rows of {min(packed_lengths)}-{max(packed_lengths)} tokens "
              f"({sum(packed_lengths)} in all, {branch_tokens} on branches)", "",
              "| | one mask (s) | split (s) | speed-up |", "|---|---|---|---|"]
    for name, key in (("teacher scoring (state-grounded rows)", "packed_teacher_scoring_s"),
                      ("trainer step (ActFirst rows, DeepSpeed)", "packed_trainer_step_s")):
        one, split = result[key]["one_mask"], result[key]["split"]
        lines.append(f"| {name} | {one:.2f} | {split:.2f} | **{one / split:.2f}x** |")
    lines += ["", f"Same results: teacher scores within {split_gap:.1e}, losses {split_losses[0]:.6f} / {split_losses[1]:.6f}.", "",
              f"Plain right-padded rows (vanilla OPD's, {len(lengths)} rows, cap {cap}) with no padding mask against it:", "",
              "| | padding mask (s) | no mask (s) | speed-up |", "|---|---|---|---|"]
    one, fast = result["plain_trainer_step_s"]["padding_mask"], result["plain_trainer_step_s"]["no_mask"]
    lines += [f"| trainer step (vanilla rows, DeepSpeed) | {one:.2f} | {fast:.2f} | **{one / fast:.2f}x** |", "",
              f"Same results: losses {plain_losses[0]:.6f} / {plain_losses[1]:.6f}."]
    (out / "forwards.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
