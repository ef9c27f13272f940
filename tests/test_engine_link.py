"""The Unix socket between a replica and its scheduler actor on the same node
(actors/host/link.py), against a real scheduler actor in a real local Ray: outputs equal to
transformers, refusals come back as the engine's errors, an abort frees the request's KV
blocks, a newer connection takes over, and a dead actor fails what was in flight."""
import asyncio
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from test_engine import prompts_of  # noqa: E402

from actors.config import EngineConfig  # noqa: E402
from actors.errors import EngineDeadError  # noqa: E402
from actors.host.engine_actor import engine_actor_class  # noqa: E402
from actors.host.link import SocketLink  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def scheduler(llama_ckpt):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = engine_actor_class({"CPU": 1}).remote(
        EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=32, num_threads=1))
    yield actor
    ray.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def connect(actor) -> tuple[SocketLink, dict, asyncio.Task]:
    """A link, what its batches brought per request id, and the task reading them."""
    node, address = await actor.link_address.remote()
    assert node == ray.get_runtime_context().get_node_id() and address.startswith("\0")
    link = await SocketLink.open(address)
    news: dict[str, list] = {}

    async def read():
        async for batch in link.batches():
            for request_id, delta, error in batch:
                news.setdefault(request_id, []).append(error or delta)
    return link, news, asyncio.create_task(read())


async def finished(news: dict, request_id: str) -> list:
    while not (news.get(request_id) and (isinstance(news[request_id][-1], BaseException)
                                         or news[request_id][-1].finished)):
        await asyncio.sleep(0.01)
    return news[request_id]


async def long_request_running(link: SocketLink, news: dict, request_id: str) -> None:
    """Start a 500-token request and wait for its first output."""
    await link.add(EngineRequest(request_id, prompts_of([9])[0], SamplingParams(max_tokens=500, ignore_eos=True)))
    while not news.get(request_id):
        await asyncio.sleep(0.01)


def test_outputs_equal_transformers_and_refusals_come_back(scheduler, llama_ckpt):
    prompts = prompts_of([5, 17])

    async def go():
        link, news, reader = await connect(scheduler)
        for i, ids in enumerate(prompts):
            await link.add(EngineRequest(f"r{i}", ids, GREEDY, whole=i == 1))  # the second: whole
        outs = [await finished(news, f"r{i}") for i in range(2)]
        with pytest.raises(ValueError, match="max_model_len|too long|context"):
            await link.add(EngineRequest("long", list(range(5000)), GREEDY))
        reader.cancel()
        link.close(EngineDeadError("test over"))
        return outs

    streamed, whole = run(go())
    assert [t for d in streamed for t in d.outputs[0].token_ids] == hf_greedy(llama_ckpt, prompts[0], 8)
    assert len(whole) == 1  # a whole request comes once, finished
    assert whole[0].prompt_token_ids == prompts[1]  # carried, once, on the request's first output
    assert whole[0].outputs[0].token_ids == hf_greedy(llama_ckpt, prompts[1], 8)


def test_abort_frees_the_blocks_and_a_newer_link_takes_over(scheduler):
    async def go():
        first, news, reader = await connect(scheduler)
        await long_request_running(first, news, "long")
        first.abort("long")
        for _ in range(200):
            stats = await scheduler.stats.remote()
            if stats["in_flight"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the aborted request kept its blocks: {stats}")
        second, news2, reader2 = await connect(scheduler)  # e.g. the replica after an error
        with pytest.raises(EngineDeadError, match="socket closed"):
            await reader
        with pytest.raises(EngineDeadError):
            await first.add(EngineRequest("late", [1, 2, 3], GREEDY))
        await second.add(EngineRequest("next", [1, 2, 3], GREEDY))
        assert not isinstance((await finished(news2, "next"))[-1], BaseException)
        reader2.cancel()
        second.close(EngineDeadError("test over"))

    run(go())


def test_a_dead_actor_fails_the_link(scheduler):
    async def go():
        link, news, reader = await connect(scheduler)
        await long_request_running(link, news, "cut")
        ray.kill(scheduler)
        with pytest.raises(EngineDeadError, match="socket closed"):
            await reader
        with pytest.raises(EngineDeadError):
            await link.add(EngineRequest("after", [1, 2, 3], GREEDY))

    run(go())
