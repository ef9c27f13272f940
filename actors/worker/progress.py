"""Progress bars for long start-up steps (weight loading, shard start-up).

Plain tqdm on stderr, drawn only once the step has taken `delay` seconds, so quick loads
(tests' tiny checkpoints) print nothing. A process that Ray started (the engine actor, the
shard actors) draws with Ray's tqdm_ray instead (`draw_bars_with`, called by
actors/executor/shards.py): the worker writes the bar's state as log lines and the driver
(`serve run`, `shoal serve`) draws it, instead of a log full of carriage returns.
SHOAL_PROGRESS=0 turns bars off.
"""
from __future__ import annotations

from tqdm import tqdm

from kernels.env import flag

_bar_class = None  # set in Ray workers: a tqdm-like class whose bars the driver draws


def draw_bars_with(bar_class) -> None:
    global _bar_class
    _bar_class = bar_class


def progress_bar(desc: str, total: int, unit: str = "it", delay: float = 2.0):
    """A bar with update(n) and close()."""
    disable = not flag("SHOAL_PROGRESS", True)
    if not disable and _bar_class is not None:
        return _bar_class(desc=desc, total=total, unit=unit)
    return tqdm(desc=desc, total=total, unit=unit, delay=delay, disable=disable)
