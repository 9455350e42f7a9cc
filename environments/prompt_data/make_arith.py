"""Writes ``arith_tiny.jsonl``: single-step arithmetic prompts with their answers, for the CPU recipes.

Every sum ``a + b`` and every difference ``a - b`` (``a >= b``) of two numbers from 0 to
:data:`MAX_OPERAND`, shuffled with a fixed seed, one JSON object a line:

    {"prompt": "What is 17 + 5? Answer with the number.", "answer": "22"}

Small numbers on purpose: the CPU bootstrap's 0.3M-parameter models learn these from a few
hundred rows, so a short run shows the teacher ahead of the student and the student catching up
on held-out prompts. Deterministic: rerunning writes the same bytes.

    .venv/bin/python environments/prompt_data/make_arith.py   # rewrites arith_tiny.jsonl beside it
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MAX_OPERAND = 15
SEED = 0
TEMPLATE = "What is {a} {op} {b}? Answer with the number."


def arith_rows(max_operand: int = MAX_OPERAND, seed: int = SEED) -> list[dict[str, str]]:
    """The rows, shuffled by ``seed``: all sums, then all non-negative differences, of 0..max_operand."""
    numbers = range(max_operand + 1)
    rows = [{"prompt": TEMPLATE.format(a=a, op="+", b=b), "answer": str(a + b)} for a in numbers for b in numbers]
    rows += [{"prompt": TEMPLATE.format(a=a, op="-", b=b), "answer": str(a - b)}
             for a in numbers for b in numbers if a >= b]
    random.Random(seed).shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    target = Path(__file__).with_name("arith_tiny.jsonl")
    write_jsonl(target, arith_rows())
    print(f"wrote {target}")
