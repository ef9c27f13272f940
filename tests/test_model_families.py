"""The families built on the Llama block (actors/models/llama.py) against transformers, float32:
greedy tokens equal and prompt log-probs within 1e-4, through chunked prefill, a prefix-cache
hit and prompts and generations longer than the sliding window, at tp=1 (in process) and tp=2
(Ray shard actors). Each tiny checkpoint turns its family's twists up so they change the
output (tests/checkpoints.py FAMILY_DEFAULTS): a window of 8 keys, soft-caps the scores reach,
Granite's multipliers far from 1, partial and interleaved rotary, longrope."""
import os
import random

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from oracle import hf_greedy, hf_prompt_logprobs  # noqa: E402
from test_engine import assert_pool_free, prompts_of  # noqa: E402

from actors.engine.llm import LLM  # noqa: E402
from actors.models.args import ModelArgs  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

FAMILIES = {
    "gemma2": {},
    "gemma2-tied": dict(arch="gemma2", tie_word_embeddings=True),
    "gemma3": {},
    "phi3": {},
    "olmo2": {},
    "granite": {},
    "glm4": {},
    # sliding windows the configs of older families carry
    "mistral-window": dict(arch="mistral", sliding_window=8),
    "qwen2-window": dict(arch="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
}
SHARED = [random.Random(3).randrange(500) for _ in range(12)]
# short, past the window, a long one over several chunks, then two sharing a cached prefix
PROMPTS = prompts_of([5, 30, 13]) + [SHARED + [1, 2], SHARED + [5]]
MAX_TOKENS = 14


def checkpoint(factory, name):
    options = dict(FAMILIES[name])
    return factory(options.pop("arch", name), **options)


def check(path, **layout):
    llm = LLM(str(path), num_kv_blocks=96, block_size=4, max_num_batched_tokens=16, **layout)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(PROMPTS[:-1], params)
        for ids, out in zip(PROMPTS, outs):
            ours = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
            assert ours == pytest.approx(hf_prompt_logprobs(path, ids), abs=1e-4)
        # once the prompt it shares a prefix with is cached (prompt log-probs skip the cache)
        outs += llm.generate(PROMPTS[-1:], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        for ids, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, ids, MAX_TOKENS), f"prompt of {len(ids)} tokens"
        if not layout:
            assert llm.engine.scheduler.hit_tokens > 0
        assert_pool_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(checkpoint_factory, name):
    check(checkpoint(checkpoint_factory, name))


def test_the_twists_are_read_from_the_configs(checkpoint_factory):
    """Each family's settings reach ModelArgs (a family parsed as plain Llama would fail above,
    but this says which setting went missing)."""
    import json

    def args(name):
        return ModelArgs.from_hf(json.loads((checkpoint(checkpoint_factory, name) / "config.json").read_text()))

    g2, g3, phi, olmo, granite, glm = (args(n) for n in ("gemma2", "gemma3", "phi3", "olmo2", "granite", "glm4"))
    assert g2.layer_windows == (8, None) and g2.attn_softcap == 4.0 and g2.final_softcap == 8.0
    assert g2.norm_offset == 1.0 and g2.embed_scale == 8.0 and g2.activation == "gelu_tanh" and g2.norms == "sandwich"
    assert g2.attn_scale == 24 ** -0.5
    assert g3.layer_windows == (8, None) and g3.qk_norm == "head"
    assert (g3.rope.theta, g3.rope.scaling["factor"], g3.local_rope.theta) == (1e6, 2.0, 1e4)
    assert phi.rope.dim == 12 and phi.rope.scaling["rope_type"] == "longrope"
    assert olmo.qk_norm == "all" and olmo.norms == "post"
    assert (granite.embed_scale, granite.residual_scale, granite.attn_scale, granite.logits_divisor) == (3, .5, .2, 2)
    assert glm.rope.interleaved and glm.rope.dim == 8 and glm.qkv_bias and not glm.o_bias and glm.norms == "sandwich"
    assert args("qwen2-window").layer_windows == (None, 8)
    assert args("mistral-window").layer_windows == (8, 8)


def test_unsupported_architecture_fails_at_start_with_one_line(checkpoint_factory, tmp_path):
    import json
    import shutil

    path = shutil.copytree(checkpoint_factory("llama"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(str(path))
    message = str(e.value)
    assert "\n" not in message and "'MambaForCausalLM'" in message
    assert "Gemma2ForCausalLM" in message and "LlamaForCausalLM" in message


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [
    ("gemma2", {}), ("gemma3", {}), ("phi3", {}), ("granite", {}), ("glm4", {}), ("mistral-window", {}),
    ("olmo2", {}), ("olmo2", dict(num_key_value_heads=1)),  # its all-heads k norm with the KV head replicated
], ids=["gemma2", "gemma3", "phi3", "granite", "glm4", "mistral-window", "olmo2", "olmo2-kv1"])
def test_family_at_tp2_matches_transformers(local_ray, checkpoint_factory, name, options):
    base = dict(FAMILIES[name])
    path = checkpoint_factory(base.pop("arch", name), **base, **options)
    check(path, tp_size=2, shard_cpus=0.5)
