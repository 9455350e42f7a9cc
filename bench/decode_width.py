"""What a wider decode step costs on this machine: the premise of ActFirst's speedup.

    OPD_VLLM=1 .venv/bin/python bench/decode_width.py                 # the ActFirst recipe's student
    OPD_VLLM=1 .venv/bin/python bench/decode_width.py --context 150 600 --dtype float32 bfloat16

ActFirst decodes the full responses of all T contexts in the steps of its fast turns, so its
ideal speedup S_ideal(T) assumes that a step over many rows costs what a step over few does.
On a GPU a decode step of a large model is bound by reading the weights, and extra rows ride
along nearly free until the batch is hundreds wide. Here the student is tiny, its weights fit
in cache, and a step's time grows with the KV cache it reads: rows x context.

The recipe's student (bootstrapped and cached like a training run's) is loaded in vLLM; for each
dtype, context length and width, ``width`` requests of random prompt ids decode together in one
:class:`~opd.generation.vllm_engine.VLLMStream` and the median time of a decode step is printed,
with its cost per row relative to the narrowest width (1.00: a row costs as much alone as in a
batch; 1/width: rows ride along free, the premise of S_ideal).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_ms(engine, width: int, context: int, steps: int, seed: int) -> float:
    """Median wall time (ms) of one decode step over ``width`` live requests of ``context`` prompt ids."""
    from opd.generation.base import SamplingParams
    from opd.generation.vllm_engine import VLLMStream

    rng = random.Random(seed)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    stream = VLLMStream(engine, seed=seed)
    for i in range(width):  # no stop token: every request decodes until the budget
        stream.add(i, [rng.randrange(3, vocab) for _ in range(context)],
                   SamplingParams(max_new_tokens=steps + 2, temperature=1.0, seed=i))
    stream.step()  # the prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        stream.step()
        times.append(time.perf_counter() - start)
    while len(stream):
        stream.step()
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "actfirst_frozenlake.yaml"))
    parser.add_argument("--model", default="", help="a model directory instead of the recipe's student")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 6, 16, 32, 60])
    parser.add_argument("--context", type=int, nargs="+", default=[600], help="prompt ids per request")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per point (median)")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe")
    args = parser.parse_args(argv)
    if os.environ.get("OPD_VLLM") != "1":
        parser.error("needs vLLM: set OPD_VLLM=1 (install it with OPD_VLLM=1 scripts/setup.sh)")

    from opd.generation.vllm_engine import VLLMEngine

    model = args.model
    if not model:
        from opd.config import load_config
        from opd.bootstrap import resolve_model_path

        cfg = load_config(args.recipe, list(args.overrides))
        model = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, print)
    rows = []
    for dtype in args.dtype:
        engine = VLLMEngine.from_pretrained(model, dtype=dtype)
        step_ms(engine, min(args.widths), min(args.context), 5, seed=0)  # warm-up
        for context in args.context:
            base = None
            for width in args.widths:
                ms = step_ms(engine, width, context, args.steps, seed=width)
                base = base if base is not None else ms / width
                rows.append({"dtype": dtype, "context": context, "width": width, "ms": ms,
                             "per_row_vs_narrowest": ms / width / base})
                print(f"{dtype:8s} context {context:5d} width {width:3d}: {ms:6.2f} ms a step, "
                      f"{ms / width:6.3f} ms a row ({rows[-1]['per_row_vs_narrowest']:.2f} of the narrowest's)", flush=True)
        del engine
    return rows


if __name__ == "__main__":
    main()
