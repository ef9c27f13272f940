"""What `shoal serve` waits on until it is told to stop."""
from __future__ import annotations

import signal
import time


class StopSignal:
    """Set by SIGINT or SIGTERM, so both end in the same clean shutdown. Lock-free: Python runs
    a handler between two bytecodes of the main thread, which may hold any lock at that moment
    (a threading.Event set from the handler deadlocked inside its own wait, and the server
    ignored every later signal). Waits sleep in short slices, so the flag is seen within 0.1 s
    whichever thread the kernel hands the signal to."""

    def __init__(self) -> None:
        self.received = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._receive)

    def _receive(self, *_) -> None:
        self.received = True

    def wait(self, timeout: float | None = None) -> bool:
        """True once a signal came; False when `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.received and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)
        return self.received
