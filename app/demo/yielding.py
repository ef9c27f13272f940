"""Demo training gives the 2 cores back while a test run is going (issue: training must
never hold the cores while tests run).

A pytest session (and `make demo-eval`) drops a file named after its pid into a shared temp
folder and removes it at the end; the trainer checkpoints and sleeps while any such file
names a live process.
The folder is machine-wide, so a test run in any checkout pauses a training run in another.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

MARKERS = Path(tempfile.gettempdir()) / "shoal-test-runs"


def mark_test_run() -> Path:
    MARKERS.mkdir(parents=True, exist_ok=True)
    marker = MARKERS / str(os.getpid())
    marker.touch()
    return marker


def tests_running() -> bool:
    """True while a live process has a marker (stale markers of dead runs are removed)."""
    if not MARKERS.is_dir():
        return False
    live = False
    for marker in MARKERS.iterdir():
        try:
            os.kill(int(marker.name), 0)
            live = True
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
        except PermissionError:  # someone else's live process
            live = True
    return live
