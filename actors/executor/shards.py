"""Shard actors (ranks 1..n of one model instance) and the rendezvous that joins them.

Each shard holds its slice of the weights and of the KV cache and runs the worker loop:
every step it receives rank 0's broadcast and runs its part of the forward. The scheduler
(rank 0) places the shards in the replica's placement group, waits for them to load, picks
the master address (its node's IP) and a free port, and all ranks join the process group.
Whatever does not arrive within --dist-timeout fails start-up with the rank and node named.
"""
from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass

import torch

from actors.config import EngineConfig
from actors.distributed.parallel import init_distributed
from actors.distributed.pipeline import worker_loop
from actors.executor.placement import check_fits, default_strategy, rank_bundle, rank_runtime_env
from actors.worker.model_spec import ModelSpec
from actors.worker.process_tuning import build_on_own_thread, freeze_startup_heap, use_threads
from actors.worker.progress import draw_bars_with, progress_bar

log = logging.getLogger("shoal.shards")


class ShardActor:
    """One rank's model runner, in its own Ray actor process. Threaded (two calls at once), so
    `alive` answers the scheduler's watcher while `run` is in the step loop."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, rank: int, num_blocks: int):
        from actors.worker.model_runner import ModelRunner
        use_ray_progress_bars()
        start = time.perf_counter()
        self.threads = max(1, int(config.shard_cpus))
        # Built on a thread that then ends, so `run`'s thread is the one that keeps OpenMP workers.
        self.runner = build_on_own_thread(lambda: ModelRunner(config, spec, rank, num_blocks), self.threads)
        self.info = {**rank_info(rank, self.runner.device),
                     "load_seconds": round(time.perf_counter() - start, 2),
                     "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                     "parameters": sum(x.numel() for x in self.runner.model.parameters())}
        freeze_startup_heap()  # as rank 0 does (actors/worker/process_tuning.py)

    def describe(self) -> dict:
        return self.info

    def alive(self) -> bool:
        return True

    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float, backend: str) -> None:
        init_distributed(self.runner.p, master_addr, master_port, timeout_s, backend)

    def run(self) -> None:
        """Follow rank 0's steps until it stops."""
        use_threads(self.threads)  # a threaded actor: this call's thread is not __init__'s
        experts = self.runner.experts
        worker_loop(self.runner.p, self.runner.forward, experts.rebalance if experts else None)


def use_ray_progress_bars() -> None:
    """This process is a Ray actor: its progress bars are drawn by the driver."""
    from ray.experimental.tqdm_ray import tqdm as ray_tqdm
    draw_bars_with(ray_tqdm)


def rank_info(rank: int, device: torch.device) -> dict:
    """Where a rank runs, for /stats and the logs: an operator finds and acts on a shard by it."""
    info = {"rank": rank, "pid": os.getpid(), "device": str(device)}
    ray = sys.modules.get("ray")  # an offline engine that never started Ray need not import it
    if ray is not None and ray.is_initialized():
        info.update(node_ip=node_ip(), node_id=node_id(), gpu_ids=[str(g) for g in ray.get_gpu_ids()])
    return info


def node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()


def node_id() -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ShardGroup:
    actors: list
    loops: list  # ObjectRefs of the running worker loops
    placement_group: object
    owns_placement_group: bool
    infos: list[dict]

    def check(self, timeout: float) -> str | None:
        """None while every rank runs its loop and answers within `timeout` s; else what is wrong."""
        import ray
        ended, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        for ref in ended:
            info = self.infos[self.loops.index(ref)]
            try:
                ray.get(ref)
                return f"{_where(info)} left its step loop"
            except Exception as exc:  # noqa: BLE001 - any way a rank ends is a dead engine
                return f"{_where(info)} died: {str(exc).splitlines()[0]}"
        pings = [a.alive.remote() for a in self.actors]
        _, late = ray.wait(pings, num_returns=len(pings), timeout=timeout)
        if late:
            return f"{_where(self.infos[pings.index(late[0])])} did not answer within {timeout:.0f} s"
        return None

    def shutdown(self) -> None:
        import ray
        for actor in self.actors:
            ray.kill(actor)
        if self.owns_placement_group:
            ray.util.remove_placement_group(self.placement_group)


def _where(info: dict) -> str:
    return f"rank {info['rank']} (pid {info.get('pid')} on {info.get('node_ip', 'this node')})"


def start_shards(config: EngineConfig, spec: ModelSpec, rank0, placement: tuple | None = None) -> ShardGroup:
    """Start ranks 1..n, rendezvous with rank 0 (`rank0`, this process's ModelRunner)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    world, timeout = config.tp_size * config.pp_size, config.dist_timeout
    if not ray.is_initialized():
        ray.init()
    bundle = rank_bundle(config)
    owns = placement is None
    if owns:  # bundle 0 is rank 0's (this process already holds it); shards take bundles 1..n
        bundles = [bundle] * world
        strategy = config.placement_strategy or default_strategy(bundles)
        check_fits(bundles, 1, strategy)
        pg = placement_group(bundles, strategy=strategy)
        placement = (pg, 1)
    pg, first = placement
    _wait(pg.ready(), timeout, f"the placement group for {world} ranks could not be placed within "
                               f"{timeout:.0f} s; is every node up? cluster has {ray.cluster_resources()}")
    cls = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=2,
                     runtime_env=rank_runtime_env())(ShardActor)
    actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, first + r - 1))
              .remote(config, spec, r, rank0.num_blocks) for r in range(1, world)]
    infos = _gather([a.describe.remote() for a in actors], timeout, "start (load its weights)")
    addr = node_ip()
    port = free_port(addr)
    backend = "nccl" if rank0.device.type == "cuda" else "gloo"
    joins = [a.init_distributed.remote(addr, port, timeout, backend) for a in actors]
    try:
        init_distributed(rank0.p, addr, port, timeout, backend)
    except Exception as exc:
        missing = [i for i, ref in enumerate(joins) if not ray.wait([ref], timeout=0)[0]]
        names = ", ".join(f"rank {r + 1} on node {infos[r]['node_ip']}" for r in missing) or "a rank"
        raise RuntimeError(f"{names} did not join the process group at {addr}:{port} "
                           f"within {timeout:.0f} s: {exc}") from None
    _gather(joins, timeout, "join the process group")
    for info in infos:
        log.info("shard %s", info)
    loops = [a.run.remote() for a in actors]
    return ShardGroup(actors, loops, pg, owns, infos)


def _wait(ref, timeout: float, message: str):
    import ray
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(message) from None


def _gather(refs: list, timeout: float, what: str) -> list:
    """ray.get with a deadline and a progress bar over the ranks; the error names every rank
    that did not make it."""
    import ray
    deadline, pending = time.monotonic() + timeout, list(refs)
    bar = progress_bar(f"shard ranks: {what}", total=len(refs), unit="rank")
    try:
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            bar.update(len(ready))
    finally:
        bar.close()
    if pending:
        late = [refs.index(r) + 1 for r in pending]
        raise RuntimeError(f"shard rank(s) {late} did not {what} within {timeout:.0f} s")
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as exc:
        raise RuntimeError(f"a shard failed to {what}: {exc}") from None
