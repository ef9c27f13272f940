"""The placement check that fails an impossible layout at once (no Ray needed: nodes given)."""
import threading

import pytest
import torch

from actors.config import EngineConfig
from actors.executor.placement import PlacementError, check_fits, gpus_per_rank, rank_bundle, rank_runtime_env
from actors.worker.process_tuning import build_on_own_thread
from app.config import load_config, replica_count

NODE = {"CPU": 2, "GPU": 2}
RANK = {"CPU": 1, "GPU": 1}


def test_strict_pack_needs_one_node_for_the_whole_replica():
    check_fits([RANK, RANK], 1, "STRICT_PACK", nodes=[NODE])
    with pytest.raises(PlacementError, match=r"cannot place 1 replica\(s\).*STRICT_PACK.*node 1: \{CPU: 2, GPU: 2\}"):
        check_fits([RANK, RANK, RANK], 1, "STRICT_PACK", nodes=[NODE, NODE])
    check_fits([RANK, RANK, RANK], 1, "PACK", nodes=[NODE, NODE])


def test_every_replica_and_the_ingress_must_fit():
    check_fits([RANK, RANK], 2, "PACK", nodes=[NODE, NODE])
    with pytest.raises(PlacementError, match=r"cannot place 3 replica\(s\)"):
        check_fits([RANK, RANK], 3, "PACK", nodes=[NODE, NODE])
    with pytest.raises(PlacementError, match=r"plus \{CPU: 0.1\} for the ingress"):
        check_fits([RANK, RANK], 2, "PACK", [{"CPU": 0.1}], nodes=[NODE, NODE])


def test_strict_spread_needs_a_node_per_bundle():
    check_fits([RANK, RANK], 1, "STRICT_SPREAD", nodes=[NODE, NODE])
    with pytest.raises(PlacementError):
        check_fits([{"CPU": 0.1}, {"CPU": 0.1}], 1, "STRICT_SPREAD", nodes=[{"CPU": 8}])


def test_gpus_per_rank():
    assert gpus_per_rank(EngineConfig(device="cpu")) == 0
    assert gpus_per_rank(EngineConfig(device="cuda")) == 1
    assert rank_bundle(EngineConfig(device="cpu", shard_gpus=0.5, shard_cpus=2)) == {"CPU": 2, "GPU": 0.5}


def test_tp_size_alone_is_one_replica():
    assert replica_count(load_config({"tp_size": 2}, environ={})) == 1
    assert replica_count(load_config({"tp_size": 2, "world_size": 4}, environ={})) == 2


def test_ranks_spin_briefly_at_openmp_barriers_unless_told_otherwise(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    assert rank_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}}
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")  # e.g. cores shared with another busy job
    assert rank_runtime_env()["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    # Both set here (`shoal serve` sets them before it starts Ray, whose workers inherit them):
    # no runtime env, so the rank can take an idle worker instead of starting one of its own.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert rank_runtime_env() is None


def test_build_on_own_thread():
    """The engine is built on a thread that ends (its OpenMP pool with it), with the torch
    threads asked for; what the build raises is raised to the caller."""
    here, n = threading.get_ident(), torch.get_num_threads()  # (n: MKL's count is process-wide)
    ident, threads = build_on_own_thread(lambda: (threading.get_ident(), torch.get_num_threads()), n)
    assert ident != here and threads == n
    assert not [t for t in threading.enumerate() if t.name == "shoal-build"]

    def broken():
        raise ValueError("no such checkpoint")
    with pytest.raises(ValueError, match="no such checkpoint"):
        build_on_own_thread(broken, 1)
