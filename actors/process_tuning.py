"""An engine process tuned for steady steps: its start-up heap kept out of Python's garbage
collector, and the memory its steps free kept by glibc's malloc.

**The collector.** A loaded engine holds ~500,000 tracked Python objects (torch, transformers,
the compiled decode graph). Python's full (generation 2) collection walks all of them: every
few hundred requests one decode step took ~350 ms instead of ~11, a round of requests 15-20%
slower (docs/benchmarks.md, "Garbage collection"). `gc.freeze()` once the engine is built
moves them to a permanent generation no collection walks (as vLLM does after start-up); objects
made later are collected as before.

**malloc.** A CPU prefill step allocates and frees tens of MB of activations (one 2,048-token
chunk's gate/up product is 16 MB). glibc serves blocks above its mmap threshold with mmap and
unmaps them on free, and trims the heap's free top back to the OS, so the next step faults
every page in again: on the benchmark model, 1.5 M page faults and ~0.4 s of system time per
1.5 s of prefill (docs/benchmarks.md, "Page faults"). The same buffers come back every step, so
keeping them costs no memory beyond the step's peak. This is what MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ would set at a process's start, done with mallopt(3) at the engine's
start instead, so it also holds in a Ray worker and under the offline `LLM`. Where malloc is
not glibc's (musl, or jemalloc / tcmalloc preloaded, which keep memory themselves) it changes
nothing.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): blocks up to 32 MB from the heap
TRIM_THRESHOLD = 1 << 30  # give the heap's top back only once 1 GiB of it is free


def keep_freed_memory() -> bool:
    """Sets both thresholds in this process; True where glibc took them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.debug("mallopt refused the thresholds: freed memory goes back to the OS as before")
    return done


def freeze_startup_heap() -> None:
    """Every object alive now leaves the collector's view until the process exits (see the
    module docstring). At exit they go back to it, so the interpreter's last collection frees
    them (else extension modules report them as leaked)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines this process builds
    atexit.register(gc.unfreeze)
