"""Where a model instance's ranks go: its placement-group bundles, the GPUs each rank claims,
and a check, before anything is started, that the cluster can hold the layout at all.

Without the check, a layout that can never be placed waits forever (Ray Serve only logs that
the replica "has taken more than 30s to be scheduled"); with it, start-up fails at once with
one line naming what the layout needs and what the cluster has.
"""
from __future__ import annotations

import os

from actors.config import EngineConfig
from actors.worker.process_tuning import openmp_env


class PlacementError(RuntimeError):
    """The cluster cannot hold the layout; the message is one line for the user."""


def gpus_per_rank(config: EngineConfig) -> float:
    """--shard-gpus if given; else one GPU per rank when the engine runs on CUDA (device cuda,
    or auto on a cluster that has GPUs), none on CPU."""
    if config.shard_gpus is not None:
        return config.shard_gpus
    if config.device == "cpu":
        return 0.0
    if config.device == "cuda":
        return 1.0
    import ray
    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def rank_bundle(config: EngineConfig) -> dict:
    """One rank's resources: its CPUs (also its torch threads) and its GPU, if any."""
    gpus = gpus_per_rank(config)
    return {"CPU": config.shard_cpus, **({"GPU": gpus} if gpus else {})}


def rank_runtime_env() -> dict | None:
    """The environment of a rank's process: OPENMP_ENV unless the caller's says otherwise. None
    where the caller has both already (inherited, as `shoal serve`'s local Ray passes them to
    every worker): an actor with a runtime env of its own never takes one of Ray's idle
    workers, so it pays a new Python process (~0.5-1.3 s on 2 cores) at start."""
    env = openmp_env()
    if all(os.environ.get(k) == v for k, v in env.items()):
        return None
    return {"env_vars": env}


def default_strategy(bundles: list[dict]) -> str:
    """STRICT_PACK when one node can hold every bundle, else PACK."""
    need = _sum(bundles)
    return "STRICT_PACK" if any(_fits(need, n) for n in node_resources()) else "PACK"


def node_resources() -> list[dict]:
    import ray
    return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]


def check_fits(replica: list[dict], replicas: int, strategy: str, others: list[dict] = (),
               nodes: list[dict] | None = None) -> None:
    """Raise PlacementError unless the nodes (default: the cluster's, their total resources)
    can hold `replicas` copies of the bundle list `replica` under `strategy`, plus `others`."""
    nodes = node_resources() if nodes is None else nodes
    free = [dict(n) for n in nodes]
    for _ in range(replicas):
        if not _place(replica, strategy, free):
            raise PlacementError(_message(replica, replicas, strategy, nodes))
    for bundle in others:
        if not _place([bundle], "PACK", free):
            raise PlacementError(_message(replica, replicas, strategy, nodes, others))


def _place(bundles: list[dict], strategy: str, free: list[dict]) -> bool:
    """Take the bundles out of `free` (first fit), as Ray would place them; False if they don't fit."""
    trial = [dict(n) for n in free]
    if strategy == "STRICT_PACK":
        need = _sum(bundles)
        node = next((n for n in trial if _fits(need, n)), None)
        if node is None:
            return False
        _take(need, node)
    else:
        used: set[int] = set()
        for bundle in bundles:
            spread = strategy == "STRICT_SPREAD"
            choices = [i for i, n in enumerate(trial) if _fits(bundle, n) and not (spread and i in used)]
            if not choices:
                return False
            _take(bundle, trial[choices[0]])
            used.add(choices[0])
    free[:] = trial
    return True


def _fits(need: dict, node: dict) -> bool:
    return all(node.get(k, 0) + 1e-9 >= v for k, v in need.items())


def _take(need: dict, node: dict) -> None:
    for k, v in need.items():
        node[k] = node.get(k, 0) - v


def _sum(bundles) -> dict:
    total: dict = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0) + v
    return total


def _message(replica, replicas, strategy, nodes, others=()) -> str:
    need = ", ".join(_fmt(b) for b in replica)
    has = "; ".join(f"node {i}: {_fmt(n)}" for i, n in enumerate(nodes)) or "no live node"
    extra = f" plus {', '.join(_fmt(b) for b in others)} for the ingress" if others else ""
    return (f"cannot place {replicas} replica(s): each needs bundles [{need}] ({strategy}){extra}; "
            f"the cluster has {has}")


def _fmt(resources: dict) -> str:
    keys = ["CPU", "GPU"] + sorted(k for k in resources if k not in ("CPU", "GPU", "memory",
                                                                       "object_store_memory")
                                   and not k.startswith("node:") and "_group_" not in k)
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in keys if k in resources) + "}"
