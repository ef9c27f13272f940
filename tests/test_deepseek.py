"""DeepSeek-V2 / V3 beyond the family parity of tests/test_model_families.py: the routers
against transformers' own, the latent KV cache's size, preemption, the other rotary layout,
the Triton backend (interpreted) with graphs; expert parallelism and EPLB: tests/test_moe.py."""
import pytest
import torch
from oracle import hf_greedy
from test_engine import assert_pool_free, prompts_of

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.models.args import ModelArgs
from actors.sampling_params import SamplingParams
from kernels.moe import route_grouped


def transformers_router(arch: str, **fields):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = (DeepseekV3Config if arch == "v3" else DeepseekV2Config)(hidden_size=16, num_attention_heads=2,
                                                                    n_routed_experts=16, **fields)
    router = (DeepseekV3TopkRouter if arch == "v3" else DeepseekV2TopkRouter)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if arch == "v3":
            router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
    return router, config


ROUTERS = {
    "v2-greedy": ("v2", dict(num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=1.5)),
    "v2-grouped": ("v2", dict(num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5)),
    "v3": ("v3", dict(num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5)),
    "v3-unnormalised": ("v3", dict(num_experts_per_tok=4, n_group=8, topk_group=3, norm_topk_prob=False,
                                   routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("case", list(ROUTERS))
def test_routing_equals_transformers_router(case):
    """Same experts and weights for 500 tokens as transformers' DeepSeek routers (ids compared as
    sets: both pick by topk, in no promised order)."""
    arch, fields = ROUTERS[case]
    router, config = transformers_router(arch, **fields)
    x = torch.randn(500, 16, generator=torch.Generator().manual_seed(1))
    _, want_weights, want_ids = router(x)
    moe = ModelArgs.from_hf({**config.to_dict(), "architectures": [f"Deepseek{arch.upper()}ForCausalLM"],
                             "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 1,
                             "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 8,
                             "num_attention_heads": 2, "vocab_size": 32}).moe
    r = moe.routing
    weights, ids = route_grouped(x @ router.weight.T, moe.top_k, moe.renormalize, r.scoring, r.group_score,
                                 r.n_group, r.topk_group, getattr(router, "e_score_correction_bias", None), r.scale)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(weights.gather(1, order), want_weights.gather(1, want_order), atol=1e-6)


def test_the_cache_holds_only_the_latent_and_the_rope_key(checkpoint_factory):
    """A KV block holds, per token and layer, kv_lora_rank + rope_dim values (one plane), not two
    planes of per-head keys and values: 48 floats here, against 2 x 4 heads x 40 (the query/key
    head) for the same model cached as multi-head attention."""
    llm = LLM(str(checkpoint_factory("deepseek_v3")), num_kv_blocks=16, block_size=4)
    runner = llm.engine.executor.runner
    a = runner.args
    assert (a.kv_planes, a.num_kv_heads, a.head_dim) == (1, 1, 32 + 16)
    assert runner.block_bytes() == 3 * (32 + 16) * 4 * 4  # layers x entry x float32 x block size
    assert tuple(runner.kv_cache.shape) == (3, 1, 16 * 4, 1, 48)


# V3's YaRN as its release sets it (mscale = mscale_all_dim: the rotary tables keep their scale,
# the softmax scale takes mscale squared), on a small factor
YARN = {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}


@pytest.mark.parametrize("arch,fields", [("deepseek_v2", {}), ("deepseek_v3", dict(rope_interleave=False)),
                                         ("deepseek_v3", dict(rope_parameters=YARN))],
                         ids=["v2", "v3-rotate-half", "v3-yarn"])
def test_preempted_requests_equal_transformers(checkpoint_factory, arch, fields):
    """Four requests outgrow a pool of 24 blocks of 4: some are preempted and recomputed, and
    every answer still equals transformers'. V3 here with rope_interleave off (the rotate-half
    layout; the family test covers the interleaved one) and with YaRN."""
    path = checkpoint_factory(arch, **fields)
    llm = LLM(str(path), num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    prompts = prompts_of([20, 14, 17, 9], seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 16)
    assert_pool_free(llm)


def test_lora_is_refused_at_start_in_one_line(checkpoint_factory):
    from actors.worker.model_spec import resolve_model
    path = checkpoint_factory("deepseek_v2")
    with pytest.raises(ValueError, match="LoRA adapters are not supported for DeepseekV2ForCausalLM"):
        resolve_model(EngineConfig(model_path=str(path), enable_lora=True), None)


def test_triton_backend_with_graphs_equals_transformers(checkpoint_factory):
    """DeepSeek on the GPU path, emulated on CPU (Triton's interpreter): the latent cache through
    the Triton attention kernel (a 48-wide entry: not a power of two), its experts through the
    fused MoE kernels, decode steps through the CUDA-graph path."""
    from kernels import triton_programs
    from test_triton_attention import graphed_triton_matches_hf
    if not triton_programs.interpreted():
        pytest.skip("Triton's interpreter is off (CUDA is here)")
    graphed_triton_matches_hf(checkpoint_factory("deepseek_v3"), [[3, 1, 4], list(range(100, 121))],
                              num_kv_blocks=128, max_num_seqs=8)


def test_served_with_reasoning_and_a_tool_call_parsed(checkpoint_factory):
    """DeepSeek-V3 behind the API app over real HTTP, as R1 is served (`--reasoning-parser
    deepseek_r1`: the answer starts inside its thinking; tool calls in the chat template's
    markup): an output forced by guided_regex comes back split into reasoning_content and a
    tool call, streamed or not."""
    import re

    import openai
    from test_api import running

    from app.api.app import attach, build_api
    from app.api.engine_client import LocalEngineClient
    from app.api.settings import ServerSettings

    path = checkpoint_factory("deepseek_v3", max_position_embeddings=1024)  # the tools' prompt is 416 tokens
    forced = 'Need the weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = dict(model="", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=200,
               extra_body={"guided_regex": re.escape(forced).replace('\\"', '"').replace("\\ ", " ")})
    engine = LocalEngineClient(EngineConfig(model_path=str(path), num_kv_blocks=128))
    settings = ServerSettings(model_path=str(path), reasoning_parser="deepseek_r1")
    try:
        with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as url:
            oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            choice = oai.chat.completions.create(**ask).choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Need the weather."
            (call,) = choice.message.tool_calls
            assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
            reasoning, names = "", []
            for chunk in oai.chat.completions.create(**ask, stream=True):
                for c in chunk.choices:
                    reasoning += getattr(c.delta, "reasoning_content", None) or ""
                    names += [d.function.name for d in c.delta.tool_calls or [] if d.function.name]
            assert (reasoning, names) == ("Need the weather.", ["get_weather"])
    finally:
        engine.shutdown()
