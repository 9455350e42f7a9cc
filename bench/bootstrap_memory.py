"""What a bootstrap build leaves in the process that ran it (the driver): resident memory after a
build of SmolLM2 fine-tuned on SQL, with the freed heap handed back (``release_freed_memory``)
and without. Each build runs in a fresh process, into an empty cache, so nothing is shared.

    .venv/bin/python bench/bootstrap_memory.py                 # SmolLM2's first 8 blocks, 4 SFT steps
    .venv/bin/python bench/bootstrap_memory.py --layers 0      # the whole model (as the smollm2 study)

Prints, for each: the process's resident memory before the build, its peak during it, and what it
still holds after (VmRSS), in MiB. The driver's ``memory/driver_peak_rss_mb`` at each training step
is at least that last figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from omegaconf import OmegaConf
from opd import provisioning
from opd.schema import BootstrapConfig, EnvConfig

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
release, layers, steps, cache = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if not release:
    provisioning.release_freed_memory = lambda: None
boot = OmegaConf.structured(BootstrapConfig(init="smollm2", tokenizer="smollm2", init_layers=layers, sft_steps=steps,
                                            n_episodes=64, batch_size=8, learning_rate=1e-4, cache_dir=cache))
env = OmegaConf.structured(EnvConfig(id="opd/SQLText-v0", kwargs={"per_template": 48, "max_turns": 3}))
import environments  # registers the ids
before = status("VmRSS")
provisioning.build_bootstrap_model(boot, env, 0, log=lambda _: None)
print(json.dumps({"before_mb": before, "peak_mb": status("VmHWM"), "after_mb": status("VmRSS")}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="SmolLM2's first N blocks (0: all 30)")
    parser.add_argument("--steps", type=int, default=4, help="SFT steps")
    args = parser.parse_args()
    rows = {}
    for release in (False, True):
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, "-c", CHILD, str(int(release)), str(args.layers), str(args.steps), cache],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
        rows[release] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"SmolLM2 ({args.layers or 30} blocks), {args.steps} SFT steps of 8 SQL episodes; resident memory, MiB")
    print("| freed heap | before the build | peak during it | held after it |")
    print("|---|---|---|---|")
    for release, label in ((False, "kept (glibc's default)"), (True, "handed back (malloc_trim)")):
        r = rows[release]
        print(f"| {label} | {r['before_mb']:,.0f} | {r['peak_mb']:,.0f} | {r['after_mb']:,.0f} |")


if __name__ == "__main__":
    main()
