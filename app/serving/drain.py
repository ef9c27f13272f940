"""Graceful shutdown of an application's replicas (vLLM's --shutdown-timeout): stop admitting,
let the requests in flight finish up to the timeout, then end the rest with an error event."""
from __future__ import annotations

import logging
import time

import ray

from app.serving.schedulers import scheduler_actors

log = logging.getLogger("shoal.serve")


def drain(app_names: str | list[str], timeout: float) -> tuple[float, int]:
    """(seconds it took, requests ended unfinished) for the replicas of the app (or apps; one
    that is not shoal's has no schedulers and nothing to drain here)."""
    start = time.monotonic()
    names = [app_names] if isinstance(app_names, str) else list(app_names)
    actors = [a for name in names for a in scheduler_actors(name).values()]
    _each(actors, "drain")  # from here /readyz says 503 and new requests get 503
    while time.monotonic() - start < timeout:
        stats = _each(actors, "stats")
        if all(s.get("in_flight", 0) == 0 for s in stats):
            break
        time.sleep(0.2)
    aborted = sum(_each(actors, "abort_all", "the server shut down before this request finished"))
    return time.monotonic() - start, aborted


def _each(actors: list, method: str, *args) -> list:
    """Call `method` on every scheduler; a replica already gone counts as done."""
    results = []
    for ref in [getattr(a, method).remote(*args) for a in actors]:
        try:
            results.append(ray.get(ref, timeout=10))
        except Exception as exc:  # noqa: BLE001 - a dead replica has nothing left to drain
            log.warning("drain: a replica did not answer %s: %s", method, str(exc).splitlines()[0])
            results.append({} if method == "stats" else 0)
    return results
