"""Settings of a process that hosts a role (a teacher, a rollout worker, a trainer rank, or all
three with the local backend): torch's threads, and a heap that keeps what it freed.

Why the heap: a role's call allocates its activations afresh each time (tens to hundreds of
MB), and glibc's ``malloc`` gives freed memory back to the kernel (the heap's top trimmed, large
blocks unmapped), so the next call takes every page again as a page fault. Measured on the
quickstart under Ray (2 cores): the teacher's scoring call took 34,000 minor faults every step
and the rollout's 10,000, against 5 and 1 with the local backend, where one heap serves the
three roles in turn; the teacher's call was about 50 ms (a third) slower for it. A process that
keeps its freed memory (:func:`keep_freed_memory`) serves the next call from it. The cost: a
role's resident memory stays at its peak between calls, as a GPU's caching allocator does.

Example:
    >>> configure_role_process(2)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 2**31 - 1  # an int: the heap's top is given back only past 2 GiB free
TOP_PAD = 64 * 2**20  # the heap grows 64 MiB at a time
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
SWITCH = "OPD_KEEP_FREED_MEMORY"  # 0: leave glibc's malloc as it is (the memory goes back between calls)


def configure_role_process(threads: int) -> None:
    """torch's intra-op threads (``threads``, or every core for 0) and :func:`keep_freed_memory`."""
    import torch

    torch.set_num_threads(max(1, threads or os.cpu_count() or 1))
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """Have glibc keep this process's freed memory for its next allocations (module docstring);
    whether it was set. Left alone where malloc is not glibc's, where the user tuned it
    (``MALLOC_*_`` or ``GLIBC_TUNABLES`` in the environment) and with ``OPD_KEEP_FREED_MEMORY=0``."""
    if os.environ.get(SWITCH, "1") == "0" or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
