"""Progress bars for long start-up steps (weight loading, shard start-up).

Inside a Ray worker (the scheduler and shard actors) the bar is Ray's tqdm_ray: the worker
writes its state as log lines and the driver (`serve run`, `shoal serve`) draws the bar,
instead of a log full of carriage returns. Elsewhere it is plain tqdm on stderr, drawn
only once the step has taken `delay` seconds, so quick loads (tests' tiny checkpoints)
print nothing. SHOAL_PROGRESS=0 turns bars off.
"""
from __future__ import annotations

import os
import sys

from tqdm import tqdm


def progress_bar(desc: str, total: int, unit: str = "it", delay: float = 2.0):
    """A bar with update(n) and close()."""
    disable = os.environ.get("SHOAL_PROGRESS", "1") == "0"
    if not disable and _in_ray_worker():
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm
        return ray_tqdm(desc=desc, total=total, unit=unit)
    return tqdm(desc=desc, total=total, unit=unit, delay=delay, disable=disable)


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")  # not imported: certainly not a Ray worker
    if ray is None or not ray.is_initialized():
        return False
    return ray._private.worker.global_worker.mode == ray.WORKER_MODE
