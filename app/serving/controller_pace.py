"""Serve's controller loop: ten times a second while a local `shoal serve` starts, once a second
after.

`shoal serve` runs Serve's controller once a second (app/cli/serve.py ray_settings_for_serving):
at Ray's 0.1 s its wake-ups stall the engine's threads on shared cores (docs/benchmarks.md,
"shoal serve vs llama.cpp's llama-server"). But every step of a deployment waits for a tick (the new version, the
replica added, the replica seen ready), which was ~3 s of `make serve`'s start. Serve calls
`start_fast` in the controller's process when it starts (RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH);
it runs the loop at STARTING_INTERVAL_S for STARTING_S, then at what the environment set. The
loop reads its interval from a private name of Ray Serve's controller module: if that moves,
the loop keeps the environment's interval.
"""
from __future__ import annotations

import os
import threading

STARTING_INTERVAL_S = 0.1  # Ray's default
STARTING_S = 60.0  # longer than the replicas of a small model take to start


def start_fast(starting_s: float = STARTING_S) -> None:
    from ray.serve._private import controller

    if not hasattr(controller, "CONTROL_LOOP_INTERVAL_S"):
        return
    steady = float(os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", controller.CONTROL_LOOP_INTERVAL_S))
    controller.CONTROL_LOOP_INTERVAL_S = min(STARTING_INTERVAL_S, steady)
    timer = threading.Timer(starting_s, setattr, (controller, "CONTROL_LOOP_INTERVAL_S", steady))
    timer.daemon = True
    timer.start()
