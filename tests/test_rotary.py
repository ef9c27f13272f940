"""YaRN rotary tables (kernels/rotary.py) bit for bit against transformers' own
_compute_yarn_parameters (ROPE_INIT_FUNCTIONS["yarn"]): inverse frequencies, attention factor,
and the cos / sin a model's rotary embedding hands its attention."""
import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from actors.models.args import ModelArgs
from kernels.rotary import _inv_frequencies, _yarn, cos_sin_cache

DEEPSEEK_YARN = dict(rope_type="yarn", factor=40, mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                     original_max_position_embeddings=4096, rope_theta=10000.0)
CASES = {
    # gpt-oss's own defaults: factor 32, truncate False, rope_theta 150000
    "gpt-oss": lambda: GptOssConfig(num_hidden_layers=2),
    # DeepSeek-V3: mscale and mscale_all_dim, factor 40, truncated correction range
    "deepseek": lambda: DeepseekV3Config(rope_parameters=dict(DEEPSEEK_YARN)),
    # mscale != mscale_all_dim (an attention factor != 1), no factor (the length ratio), other betas
    "deepseek-ratio": lambda: DeepseekV3Config(max_position_embeddings=65536, rope_parameters=dict(
        DEEPSEEK_YARN, factor=None, mscale=1.0, beta_fast=16, beta_slow=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_equals_transformers_bit_for_bit(case):
    config = CASES[case]()
    want_inv_freq, want_attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    if case == "gpt-oss":  # through the config reader too
        rope = ModelArgs.from_hf({**config.to_dict(), "architectures": ["GptOssForCausalLM"]}).rope
        dim, theta, scaling = rope.dim, rope.theta, rope.scaling
    else:
        dim, theta = config.qk_rope_head_dim, config.rope_parameters["rope_theta"]
        scaling = dict(config.rope_parameters, max_position_embeddings=config.max_position_embeddings)
    inv_freq, attention = _yarn(dim, theta, scaling)
    assert torch.equal(inv_freq, want_inv_freq) and attention == want_attention
    assert (attention != 1.0) == (case != "deepseek")  # mscale == mscale_all_dim cancels out
    cos, sin = cos_sin_cache(dim, theta, scaling, 300)
    positions = torch.arange(300, dtype=torch.float32)
    freqs = positions[:, None] * want_inv_freq[None, :]  # what GptOssRotaryEmbedding computes
    assert torch.equal(cos, torch.cat((freqs, freqs), -1).cos() * want_attention)
    assert torch.equal(sin, torch.cat((freqs, freqs), -1).sin() * want_attention)


def test_yarn_differs_from_plain_rope():
    """The scaling does something at these sizes (a table equal to plain rope would pass above
    only if the reference did nothing either)."""
    yarn, plain = _yarn(64, 10000.0, dict(DEEPSEEK_YARN, max_position_embeddings=4096))[0], _inv_frequencies(64, 10000.0)
    assert torch.equal(yarn[:4], plain[:4]) and torch.allclose(yarn[-4:], plain[-4:] / 40)
