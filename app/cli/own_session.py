"""Run the server in a child process that leads its own session, this process passing the
stopping signals on to it.

A supervisor that stops a whole process group (systemd's default KillMode, `kill -- -PGID`,
process managers) would otherwise also signal Ray's own daemons, which the server starts in
its group: they die the moment the server begins to drain, and the drain then waits 30-60 s
for a GCS that is gone ("Controller failed to shut down within 30.0s"). In a session of their
own only the server hears the signal; it drains and stops Ray itself, as it does for a SIGTERM
sent to it alone. If this process dies first, the child gets SIGTERM (PR_SET_PDEATHSIG) and
drains all the same. Forking happens before Ray, torch or any thread starts.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def run_in_own_session(run: Callable[[], int]) -> int:
    """run() in a forked child of its own session, which then exits the normal way (its result
    returned up the stack, atexit handlers and all). This process waits for it, returns its exit
    code, or ends by the signal that ended it."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: the server
        os.setsid()
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)
        return run()
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: end the same way, for whoever waits on this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
