"""A role's process keeps the memory it freed (opd.process): the next call's allocations do not
fault their pages in again. Each case runs in a fresh interpreter (glibc reads its settings once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALL_TWICE = """
import sys, torch
from opd.process import keep_freed_memory
def faults():
    text = open("/proc/self/stat").read()
    return int(text[text.rindex(")") + 2:].split()[7])  # minflt
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)
def call():  # a role's call: activations allocated, used and freed
    blocks = [torch.ones(2_000_000) for _ in range(40)]  # 40 blocks of 8 MB
    del blocks
call()
before = faults()
call()
print(kept, faults() - before)
"""


def second_call_faults(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CALL_TWICE, mode], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or sys.platform != "linux", reason="Linux's page-fault count")
def test_a_kept_heap_serves_the_next_call_without_faulting_its_pages_in_again():
    _, default = second_call_faults("default")
    kept, keeping = second_call_faults("keep")
    assert kept == "True"
    assert default > 40_000  # glibc gave the 320 MB back: each page faulted in again
    assert keeping < default / 3, (keeping, default)  # 10-16k here, against 78k


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_the_users_own_malloc_settings_and_the_switch_leave_it_alone():
    assert second_call_faults("keep", MALLOC_TRIM_THRESHOLD_="131072")[0] == "False"
    assert second_call_faults("keep", OPD_KEEP_FREED_MEMORY="0")[0] == "False"
