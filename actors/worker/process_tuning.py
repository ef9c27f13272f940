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
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

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


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS now (malloc_trim(3)): once the weights are
    built, what loading them freed (float weights turned 8-bit, their conversions) is not
    coming back, and the trim threshold above would keep it resident."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def freeze_startup_heap() -> None:
    """Every object alive now leaves the collector's view until the process exits (see the
    module docstring). At exit they go back to it, so the interpreter's last collection frees
    them (else extension modules report them as leaked)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines this process builds
    atexit.register(gc.unfreeze)


# How a rank's OpenMP threads wait at a barrier: spin ~10,000 rounds (about half a millisecond),
# then sleep. libgomp's default spins 300,000 rounds: when anything else runs on the cores (Ray's
# proxy and replicas, another job) a spinning thread waits for a descheduled partner, and a
# 2-thread decode step took 10-20x longer. Sleeping at once (PASSIVE alone) wakes a thread for
# every one of the ~70 parallel regions of a step: decode steps ~1.4-1.8x slower on an idle
# machine. (docs/benchmarks.md, "Threads on shared cores".)
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def openmp_env() -> dict[str, str]:
    """OPENMP_ENV, except what the caller's environment sets itself."""
    return {k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()}


def use_threads(n: int) -> None:
    """Gives the calling thread's matmuls `n` threads. OpenMP keeps its thread count per OS
    thread, and a new thread starts from OMP_NUM_THREADS (1 in a Ray actor) whatever
    torch.get_num_threads() says: without this, oneDNN and MKL ran the scheduler actor's
    engine-loop matmuls on one thread (a batch-32 decode step took 60 ms instead of 50 ms,
    docs/benchmarks.md)."""
    import torch
    torch.set_num_threads(n)


def build_on_own_thread(make: Callable[[], T], threads: int) -> T:
    """make() on a thread of its own, with `threads` torch threads, that ends when it returns.

    OpenMP keeps a pool of worker threads for every thread that ran a parallel region, until
    that thread ends. With more pooled threads than cores, libgomp hardly spins at barriers
    (GOMP_SPINCOUNT gives way to its throttled count of ~100 rounds): loading and compiling a
    model on one thread and stepping it on another made decode steps 40% slower
    (docs/benchmarks.md, "Threads on shared cores")."""
    result: Future = Future()

    def build() -> None:
        use_threads(threads)
        try:
            result.set_result(make())
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            result.set_exception(exc)

    thread = threading.Thread(target=build, name="shoal-build")
    thread.start()
    thread.join()
    return result.result()
