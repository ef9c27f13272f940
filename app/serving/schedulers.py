"""Where each replica's scheduler actor is found: a named actor per replica, so /stats, the
drain and `shoal drain` reach every replica of an application from any process. Light on
purpose (Ray only): `shoal drain` imports it to act within a second or two."""
from __future__ import annotations

import ray

SCHEDULER_NAMESPACE = "shoal"


def scheduler_name_prefix(app_name: str) -> str:
    return f"scheduler:{app_name}:"


def scheduler_name(app_name: str, deployment: str, replica: str) -> str:
    """The named actor of a replica's scheduler (its deployment: one pool per model)."""
    return f"{scheduler_name_prefix(app_name)}{deployment}:{replica}"


def scheduler_actors(app_name: str, deployment: str | None = None) -> dict:
    """Replica id -> scheduler actor handle, for every live replica of the app (of one of its
    deployments, where given)."""
    prefix = scheduler_name_prefix(app_name) + (f"{deployment}:" if deployment else "")
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == SCHEDULER_NAMESPACE and a["name"].startswith(prefix)]
    actors = {}
    for name in sorted(names):
        try:
            actors[name.rsplit(":", 1)[1]] = ray.get_actor(name, namespace=SCHEDULER_NAMESPACE)
        except ValueError:  # gone since the listing (a replica scaled down or replaced): not live
            continue
    return actors
