"""Demo-model training yields the cores to test runs (app/demo/yielding.py)."""
import subprocess
import sys

from app.demo import yielding


def test_this_session_counts_and_a_dead_run_marker_is_dropped():
    assert yielding.tests_running()  # conftest marked this pytest session
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = yielding.MARKERS / str(dead.pid)
    stale.touch()
    assert yielding.tests_running()
    assert not stale.exists()
