"""A real two-node Ray cluster on this machine: TP=2 with one shard per node, and a clear
error (not a hang) when the layout cannot be placed."""
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from actors.llm import LLM  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from test_engine import prompts_of  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@ray.remote(num_cpus=1)
class EngineHost:
    """Rank 0 (the scheduler's role) in bundle 0; the shard lands in bundle 1 on the other node."""

    def __init__(self, path, pg):
        self.llm = LLM(path, tp_size=2, placement=(pg, 1), num_kv_blocks=32, shard_cpus=1, dist_timeout=60)

    def run(self, prompts):
        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs], self.llm.engine.shards.infos, ray.get_runtime_context().get_node_id()

    def close(self):
        self.llm.shutdown()


def test_tp2_across_two_nodes(two_nodes, llama_ckpt):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    host = EngineHost.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote(str(llama_ckpt), pg)
    prompts = prompts_of([7, 19])
    tokens, infos, host_node = ray.get(host.run.remote(prompts), timeout=300)
    assert tokens == [hf_greedy(llama_ckpt, p, 10) for p in prompts]
    assert infos[0]["node_id"] != host_node  # one shard per node
    ray.get(host.close.remote())
    ray.kill(host)
    ray.util.remove_placement_group(pg)


def test_unplaceable_layout_fails_clearly(two_nodes, llama_ckpt):
    with pytest.raises(RuntimeError, match="could not be placed within 5 s"):
        LLM(str(llama_ckpt), tp_size=4, placement_strategy="STRICT_SPREAD", shard_cpus=1, dist_timeout=5)
