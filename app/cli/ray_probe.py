"""`python -m app.cli.ray_probe ADDRESS`: print one JSON line about the Ray cluster at ADDRESS
("auto": the one on this machine, if any). Run by `shoal collect-env` in a child process.

It only connects (`ray.init(address=...)` never starts a cluster when given an address) and
first checks the GCS port answers: Ray itself retries a dead address for a long time.
"""
from __future__ import annotations

import json
import os
import socket
import sys

LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray uses 127.0.0.1 as this node's IP


def port_open(address: str) -> bool:
    host, _, port = address.rpartition("://")[2].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def resolve(address: str) -> tuple[str | None, str]:
    """(an address that answers or None, the address found). For "auto" Ray names the GCS by
    the node's IP; a cluster kept on loopback (as tests and dev setups here are) answers on
    127.0.0.1 at the same port, so that is tried too."""
    if address != "auto":
        return (address if address.startswith("ray://") or port_open(address) else None), address
    from ray._private import services  # Ray's own lookup: RAY_ADDRESS, the cluster file, gcs_server
    found = services.get_ray_address_from_environment("auto", None)
    candidates = [found, "127.0.0.1:" + found.rpartition(":")[2]]
    return next((a for a in candidates if port_open(a)), None), found


def probe(address: str) -> dict:
    try:
        usable, found = resolve(address)
    except ConnectionError:
        return {"status": "no cluster found"}
    if usable is None:
        return {"status": "unreachable", "address": found}
    if usable.split(":")[0] in ("127.0.0.1", "localhost") and LOOPBACK not in os.environ:
        # A loopback-only cluster: the driver must use 127.0.0.1 as its node IP too, or it
        # looks for the GCS on the machine's external address and waits (MACHINE-NOTES).
        # Ray reads that at import, and "auto" has imported it: start afresh with the address.
        os.environ[LOOPBACK] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "app.cli.ray_probe", usable])
    import ray
    ray.init(address=usable, logging_level="ERROR", log_to_driver=False)
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        return {"status": "connected", "address": usable, "alive_nodes": len(alive),
                "resources": plain(ray.cluster_resources()),
                "available": plain(ray.available_resources())}
    finally:
        ray.shutdown()


def plain(resources: dict) -> dict:
    """Without the per-placement-group bookkeeping entries (CPU_group_<id>, bundle_group_...)."""
    return {k: v for k, v in sorted(resources.items()) if "_group_" not in k}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
