"""Where a model instance's ranks go: its placement-group bundles, the GPUs each rank claims,
and a check, before anything is started, that the cluster can hold the layout at all.

Without the check, a layout that can never be placed waits forever (Ray Serve only logs that
the replica "has taken more than 30s to be scheduled"); with it, start-up fails at once with
one line naming what the layout needs and what the cluster has.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from actors.config import EngineConfig

T = TypeVar("T")


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


# How a rank's OpenMP threads wait at a barrier: spin ~10,000 rounds (about half a millisecond),
# then sleep. libgomp's default spins 300,000 rounds: when anything else runs on the cores (Ray's
# proxy and replicas, another job) a spinning thread waits for a descheduled partner, and a
# 2-thread decode step took 10-20x longer. Sleeping at once (PASSIVE alone) wakes a thread for
# every one of the ~70 parallel regions of a step: decode steps ~1.4-1.8x slower on an idle
# machine. (docs/benchmarks.md, "Threads on shared cores".)
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def openmp_env() -> dict[str, str]:
    """OPENMP_ENV, except what the caller's environment sets itself."""
    return {k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()}


def rank_runtime_env() -> dict:
    """The environment of a rank's process: OPENMP_ENV unless the caller's says otherwise."""
    return {"env_vars": openmp_env()}


def use_threads(n: int) -> None:
    """Gives the calling thread's matmuls `n` threads. OpenMP keeps its thread count per OS
    thread, and a new thread starts from OMP_NUM_THREADS (1 in a Ray actor) whatever
    torch.get_num_threads() says: without this, oneDNN and MKL ran the scheduler actor's
    engine-loop matmuls on one thread (a batch-32 decode step took 60 ms instead of 50 ms,
    docs/benchmarks.md)."""
    import torch
    torch.set_num_threads(n)


def build_on_own_thread(make: Callable[[], T], threads: int) -> T:
    """make() on a thread of its own, with `threads` torch threads, that ends when it returns.

    OpenMP keeps a pool of worker threads for every thread that ran a parallel region, until
    that thread ends. With more pooled threads than cores, libgomp hardly spins at barriers
    (GOMP_SPINCOUNT gives way to its throttled count of ~100 rounds): loading and compiling a
    model on one thread and stepping it on another made decode steps 40% slower
    (docs/benchmarks.md, "Threads on shared cores")."""
    result: Future = Future()

    def build() -> None:
        use_threads(threads)
        try:
            result.set_result(make())
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            result.set_exception(exc)

    thread = threading.Thread(target=build, name="shoal-build")
    thread.start()
    thread.join()
    return result.result()


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
