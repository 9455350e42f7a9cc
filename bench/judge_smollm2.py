"""The teacher-as-judge path with a real instruct model: SmolLM2-135M-Instruct (offline) judges
failed FrozenLake episodes.

Failed episodes come from a uniformly random valid policy on train maps. Each is rendered as
PivotOPD's judge prompt (:func:`opd.supervision.pivot.judge_prompt_ids`), answered greedily, and
parsed (:func:`opd.supervision.pivot.parse_judgement`). Reports the parse-failure rate, how often
a parsed pivot is the first turn where the BFS expert disagrees, and whether the gold action is
a legal move. Writes ``results.json`` under ``--out``.

    .venv/bin/python bench/judge_smollm2.py --episodes 48
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def failed_episodes(n: int, seed: int = 0) -> list[dict]:
    from opd.envs import make_env

    env = make_env("opd/FrozenLakeText-v0", max_turns=8)
    rng = random.Random(seed)
    episodes = []
    for task in env.unwrapped.task_ids("train"):
        obs, info = env.reset(options={"task": task})
        first, steps, experts = obs, [], []
        while True:
            experts.append(info.get("expert_action"))
            action = rng.choice(info["admissible_actions"])
            obs, _, terminated, truncated, info = env.step(action)
            steps.append((action, obs))
            if terminated or truncated:
                break
        if not info["success"]:
            episodes.append({"task": first, "steps": steps, "experts": experts})
        if len(episodes) == n:
            return episodes
    return episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--recovery-turns", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "judge_smollm2")
    args = parser.parse_args()

    from opd.chat import ChatFormat
    from opd.generation.base import SamplingParams
    from opd.generation.hf import HFEngine
    from opd.models import load_tokenizer, smollm2_model_dir
    from opd.supervision.pivot import judge_prompt_ids, parse_judgement, pivot_by_expert

    path = smollm2_model_dir()
    tokenizer, engine = load_tokenizer(path), HFEngine.from_pretrained(path)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    episodes = failed_episodes(args.episodes)
    prompts = [judge_prompt_ids(fmt, tokenizer, e["task"], e["steps"], args.recovery_turns) for e in episodes]
    start = time.perf_counter()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_token_ids=(fmt.im_end_id,))
    answers = []
    for i in range(0, len(prompts), 8):
        answers += [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in engine.generate(prompts[i : i + 8], params)]
        print(f"{len(answers)}/{len(prompts)} judged ({time.perf_counter() - start:.0f}s)", flush=True)
    parsed, agree, comparable, legal = 0, 0, 0, 0
    records = []
    for e, answer in zip(episodes, answers):
        judgement = parse_judgement(answer, len(e["steps"]), args.recovery_turns)
        expert_turn = pivot_by_expert([a for a, _ in e["steps"]], e["experts"])
        if judgement is not None:
            parsed += 1
            legal += int(judgement.gold_action.strip().lower().rstrip(".") in ("left", "down", "right", "up"))
            if expert_turn is not None:
                comparable += 1
                agree += int(judgement.pivot_turn == expert_turn)
        records.append({"answer": answer, "parsed": judgement is not None,
                        "pivot": judgement.pivot_turn if judgement else None, "expert_turn": expert_turn})
    result = {
        "model": "SmolLM2-135M-Instruct", "episodes": len(episodes), "max_new_tokens": args.max_new_tokens,
        "parse_failure_rate": 1 - parsed / len(episodes),
        "expert_agreement": agree / comparable if comparable else None,
        "legal_gold_action_rate": legal / parsed if parsed else None,
        "seconds": time.perf_counter() - start, "answers": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "answers"}, indent=2))
    for r in records[:3]:
        print("---", r["parsed"], repr(r["answer"][:300]))


if __name__ == "__main__":
    main()
