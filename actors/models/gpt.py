"""Checkpoints of the GPT lineage, whose names differ from Llama's: GPT-J (Llama's parallel block,
actors/models/args.py), GPT-NeoX and Falcon (below), and OPT and GPT-2 (vLLM's and transformers' first
examples, `facebook/opt-125m`, `gpt2`): the
Llama block with learned absolute positions instead of rotary (ModelArgs.learned_positions; every
layer rotates by angle 0), LayerNorms with biases, an ungated MLP and biased projections
(actors/models/args.py learned_position_args). Only their checkpoints' names differ: each is
translated to the Llama block's, and GPT-2's Conv1D weights, stored [in, out], are transposed.
"""
from __future__ import annotations

import re

from actors.models.llama import LlamaForCausalLM, local_heads

OPT_NAMES = (  # (pattern, replacement) on names without their "model." / "transformer." prefix
    (r"^decoder\.embed_tokens\.", "model.embed_tokens."),
    (r"^decoder\.embed_positions\.", "model.embed_positions."),
    (r"^decoder\.final_layer_norm\.", "model.norm."),
    (r"^decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^decoder\.layers\.(\d+)\.self_attn\.", r"model.layers.\1.self_attn."),
    (r"^decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^decoder\.layers\.(\d+)\.final_layer_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^decoder\.layers\.(\d+)\.fc1\.", r"model.layers.\1.mlp.fc1."),
    (r"^decoder\.layers\.(\d+)\.fc2\.", r"model.layers.\1.mlp.fc2."),
)
GPT2_NAMES = (
    (r"^wte\.", "model.embed_tokens."),
    (r"^wpe\.", "model.embed_positions."),
    (r"^ln_f\.", "model.norm."),
    (r"^h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
    (r"^h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^h\.(\d+)\.attn\.c_attn\.", r"model.layers.\1.self_attn.qkv_proj."),
    (r"^h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^h\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
)
GPTJ_NAMES = (
    (r"^wte\.", "model.embed_tokens."),
    (r"^ln_f\.", "model.norm."),
    (r"^h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
    (r"^h\.(\d+)\.attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^h\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^h\.(\d+)\.mlp\.fc_in\.", r"model.layers.\1.mlp.fc1."),
    (r"^h\.(\d+)\.mlp\.fc_out\.", r"model.layers.\1.mlp.fc2."),
)
NAMES = {"OPTForCausalLM": OPT_NAMES, "GPT2LMHeadModel": GPT2_NAMES, "GPTJForCausalLM": GPTJ_NAMES}
GPT2_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
GPT2_MASKS = re.compile(r"^h\.\d+\.attn\.(masked_)?bias$")  # old checkpoints' causal-mask buffers (GPT-J's too)


class GptForCausalLM(LlamaForCausalLM):
    def weight_rule(self, name: str):
        if name in ("lm_head.weight", "lm_head.bias"):
            return super().weight_rule(name)
        gpt2 = self.args.architecture == "GPT2LMHeadModel"
        bare = re.sub(r"^(transformer|model)\.", "", name)
        if GPT2_MASKS.match(bare):
            return None
        ours = translated(bare, NAMES[self.args.architecture])
        if ours == "model.embed_positions.weight":  # whole, on the first stage
            return (ours, 0, None, 0, 0) if self.p.first_stage else None
        rule = super().weight_rule(ours)
        return _transposed(rule) if gpt2 and GPT2_CONV1D.match(bare) else rule


def translated(name: str, table) -> str:
    """`name` under the first (pattern, replacement) of `table` that matches it, else as it is."""
    for pattern, replacement in table:
        ours, found = re.subn(pattern, replacement, name)
        if found:
            return ours
    return name


def _transposed(rule):
    """Rules for a weight stored [in, out] (GPT-2's Conv1D): each part cut from the stored
    tensor as the rule would cut its transpose, then transposed."""
    if rule is None or isinstance(rule, list):
        return rule and [_transposed(r) for r in rule]
    target, offset, dim, start, size, *slot = rule
    if dim is None:
        take = lambda t: t[:].t()  # noqa: E731
    elif dim == 0:  # rows of the transpose: columns here
        take = lambda t: t[:, start:start + size].t()  # noqa: E731
    else:
        take = lambda t: t[start:start + size].t()  # noqa: E731
    return (target, offset, take, 0, 0, *slot)


NEOX_NAMES = (  # GPT-NeoX (Pythia, Dolly, RedPajama-INCITE), on names without their "gpt_neox." prefix
    (r"^embed_in\.", "model.embed_tokens."),
    (r"^final_layer_norm\.", "model.norm."),
    (r"^embed_out\.", "lm_head."),
    (r"^layers\.(\d+)\.attention\.dense\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"model.layers.\1.mlp.fc1."),
    (r"^layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"model.layers.\1.mlp.fc2."),
    (r"^layers\.(\d+)\.", r"model.layers.\1."),  # input_layernorm, post_attention_layernorm
)
NEOX_QKV = re.compile(r"^layers\.(\d+)\.attention\.query_key_value\.(weight|bias)$")
NEOX_BUFFERS = re.compile(r"^layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")


class GptNeoXForCausalLM(LlamaForCausalLM):
    """GPT-NeoX: the parallel block with a norm per sublayer (norms "parallel2"); its fused
    query_key_value holds each head's q, k and v rows together ([heads, 3, head_dim]), cut here
    into this rank's heads of q, then k, then v."""

    def weight_rule(self, name: str):
        bare = re.sub(r"^gpt_neox\.", "", name)
        if NEOX_BUFFERS.match(bare):
            return None
        m = NEOX_QKV.match(bare)
        if m:
            layer = int(m.group(1))
            if layer not in self.p.layers(self.args.num_layers):
                return None
            target = f"model.layers.{layer - self.first_layer}.self_attn.qkv_proj.{m.group(2)}"
            heads, d = self.args.num_heads // self.p.tp_size, self.args.head_dim
            first = self.p.tp_rank * heads
            return [(target, part * heads * d, _neox_part(first, heads, part, d), 0, 0) for part in range(3)]
        return super().weight_rule(translated(bare, NEOX_NAMES))


def _neox_part(first: int, heads: int, part: int, d: int):
    """Rows (or bias entries) of q (part 0), k (1) or v (2) of heads first.. first + heads."""
    def take(t):
        t = t[:]
        return t.view(-1, 3, d, *t.shape[1:])[first:first + heads, part].reshape(heads * d, *t.shape[1:])
    return take


FALCON_NAMES = (  # Falcon, on names without their "transformer." prefix
    (r"^word_embeddings\.", "model.embed_tokens."),
    (r"^ln_f\.", "model.norm."),
    (r"^h\.(\d+)\.self_attention\.", r"model.layers.\1.self_attn."),  # (dense: the output projection)
    (r"^h\.(\d+)\.mlp\.dense_h_to_4h\.", r"model.layers.\1.mlp.fc1."),
    (r"^h\.(\d+)\.mlp\.dense_4h_to_h\.", r"model.layers.\1.mlp.fc2."),
    (r"^h\.(\d+)\.ln_attn\.", r"model.layers.\1.input_layernorm."),  # (the new architecture's two norms)
    (r"^h\.(\d+)\.ln_mlp\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^h\.(\d+)\.", r"model.layers.\1."),  # input_layernorm, post_attention_layernorm
)
FALCON_QKV = re.compile(r"^h\.(\d+)\.self_attention\.query_key_value\.(weight|bias)$")


class FalconForCausalLM(LlamaForCausalLM):
    """Falcon: its fused query_key_value holds, per KV group, the group's query heads, then its key
    and its value ([groups, heads / groups + 2, head_dim]: one group for multi-query Falcon-7B, a
    group per head for plain multi-head attention, num_kv_heads for the new architecture); each
    rank takes its query heads, then its KV heads' key and value rows."""

    def weight_rule(self, name: str):
        if name in ("lm_head.weight", "lm_head.bias"):
            return super().weight_rule(name)
        bare = re.sub(r"^transformer\.", "", name)
        m = FALCON_QKV.match(bare)
        if not m:
            return super().weight_rule(translated(bare, FALCON_NAMES))
        layer = int(m.group(1))
        if layer not in self.p.layers(self.args.num_layers):
            return None
        target = f"model.layers.{layer - self.first_layer}.self_attn.qkv_proj.{m.group(2)}"
        h, kvh, kv0 = local_heads(self.args, self.p)
        d = self.args.head_dim
        return [(target, 0, _falcon_part(self.args, "q", self.p.tp_rank * h, h), 0, 0),
                (target, h * d, _falcon_part(self.args, "k", kv0, kvh), 0, 0),
                (target, (h + kvh) * d, _falcon_part(self.args, "v", kv0, kvh), 0, 0)]


def _falcon_part(a, part: str, first: int, count: int):
    """Rows (or bias entries) of query heads (or of KV heads' keys, values) first.. first + count."""
    groups, d = a.num_kv_heads, a.head_dim
    per = a.num_heads // groups

    def take(t):
        t = t[:]
        grouped = t.view(groups, per + 2, d, *t.shape[1:])
        heads = (grouped[:, :per].reshape(a.num_heads, d, *t.shape[1:]) if part == "q"
                 else grouped[:, per if part == "k" else per + 1])
        return heads[first:first + count].reshape(count * d, *t.shape[1:])
    return take
