"""Where each replica's scheduler actor is found: a named actor per replica, so /stats, the
drain and `shoal drain` reach every replica of an application from any process. Light on
purpose (Ray only): `shoal drain` imports it to act within a second or two."""
from __future__ import annotations

import ray

SCHEDULER_NAMESPACE = "shoal"


def scheduler_name_prefix(app_name: str) -> str:
    return f"scheduler:{app_name}:"


def scheduler_actors(app_name: str) -> dict:
    """Replica id -> scheduler actor handle, for every live replica of the app."""
    prefix = scheduler_name_prefix(app_name)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == SCHEDULER_NAMESPACE and a["name"].startswith(prefix)]
    return {n[len(prefix):]: ray.get_actor(n, namespace=SCHEDULER_NAMESPACE) for n in sorted(names)}
