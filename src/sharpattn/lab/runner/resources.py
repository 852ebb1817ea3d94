"""One thread policy (torch intra-op threads for a block, restored after), the cores free now, and
the process's allocator policy."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
from collections.abc import Iterator

import torch

# the cores this process may use and those free now (`attend`'s machine report says them too)
from ...attention.dispatch.machine import cores, free_cores  # noqa: F401

# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (glibc's maximum dynamic value)
TRIM_THRESHOLD = 256 << 20  # freed heap kept before it is returned to the system


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's allocator keep freed memory for the next allocation (once per process).

    A training step allocates and frees the same few-MiB activations and gradients every step.
    With glibc's defaults each of them is a fresh ``mmap`` (or heap growth after a trim) whose
    pages the kernel faults in and zeroes again: ~1,400 page faults per max-retrieval step, 7-9 %
    of its CPU time in the kernel. Serving blocks below `MMAP_THRESHOLD` from the heap and
    keeping up to `TRIM_THRESHOLD` of it freed removes them (``benchmarks/batched_seeds.py``
    reports the system time). Larger blocks (a long evaluation's score chunks) are still
    ``mmap``-ed and returned when freed. The setting is process-wide, so only the experiment
    runner applies it (through `threads`), never the library's functions. Returns whether
    it applied (False off glibc, where it does nothing)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


@contextlib.contextmanager
def threads(n: int | None = None) -> Iterator[int]:
    """Run the block with ``n`` torch intra-op threads (default: every core), then restore; the
    process keeps freed memory for reuse from then on (`keep_freed_memory`)."""
    keep_freed_memory()
    old = torch.get_num_threads()
    n = cores() if n is None else max(1, int(n))
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)
