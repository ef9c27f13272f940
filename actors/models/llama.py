"""The dense decoder: Llama and the families built on its block.

Llama (GQA, rope scaling), Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (per-head q/k
norm), Gemma 1 ((1 + w) RMSNorm, GeGLU, scaled embeddings), Gemma 2 / 3 (norms before and
after each sublayer too, score and logit soft-capping, alternating sliding and global layers,
Gemma 3's local rotary base), Phi-3 (fused qkv / gate_up in the checkpoint, longrope, partial
rotary), OLMo 2 / 3 (q/k norm over all heads, norms after each sublayer only; OLMo 3's sliding
layers' own rotary), Granite (its four multipliers), GLM-4 (interleaved partial rotary, norms
after each sublayer too), SmolLM3 (layers without rotary), Seed-OSS (biased q/k/v), ERNIE 4.5
(interleaved rotary, biases), EXAONE 4 (per-head q/k norms, norms after each sublayer,
global layers without rotary) and Cohere / Cohere 2 (LayerNorm, attention and MLP in parallel
off one norm, a logit scale; Cohere's per-head q/k LayerNorms), StarCoder2 (LayerNorms with
biases, an ungated MLP), Arcee and Nemotron (a squared-ReLU ungated MLP; Nemotron's LayerNorm1P),
Phi-2 (Cohere's parallel block with biased LayerNorms, partial rotary, a biased LM head), StableLM
and GPT-NeoX (the parallel block with a norm per sublayer), Llama 4's attention (interleaved
rotary, NoPE layers, weightless q/k norms after the rotary; its MoE: actors/models/moe.py),
Ministral 3 (queries scaled by position), HunYuan (per-head q/k norms after the rotary), GLM
(GLM-4's attention without its norms after each sublayer), Helium (interleaved rotary), Apertus
(per-head q/k norms, an ungated xIELU MLP with each layer's learned parameters). What
differs is read once into ModelArgs (actors/models/args.py); the block below switches on it.

q/k/v and gate/up are fused into one matmul each. Under tensor parallelism each rank holds
its share of the heads and of the MLP; under pipeline parallelism each stage holds a slice of
the layers (the first also the embedding, the last the final norm and LM head).
`weight_rule` says where each Hugging Face tensor, or the slice of it this rank needs, goes.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs
from actors.models.layers import (
    ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, vocab_shard,
)
from kernels import kv_quant, triton_fused
from kernels.activation import XIELU, gated_activation, plain_activation
from kernels.attention import AttentionMetadata, paged_attention, write_kv
from kernels.norms import LayerNorm, LayerNorm1P, PlainLayerNorm, RMSNorm
from kernels.rotary import apply_rotary, cos_sin_cache

# Checkpoint norm names -> ours, by where the family puts its norms (ModelArgs.norms). Ours:
# input_layernorm before attention, post_attn_norm after it, pre_mlp_norm / post_mlp_norm.
NORM_NAMES = {
    "pre": {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_norm",
            "attention_layernorm": "input_layernorm", "feedforward_layernorm": "pre_mlp_norm"},  # (and Apertus's)
    "sandwich": {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attn_norm",
                 "pre_feedforward_layernorm": "pre_mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"},
    "post": {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"},
    "parallel": {"input_layernorm": "input_layernorm"},
    "parallel2": {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_norm"},
}
# Multi-token-prediction modules some releases carry beside the model (ERNIE 4.5's mtp_block,
# MiMo's mtp_layers): not run (DeepSeek's and GLM's sit in a layer past the last, skipped as such)
MTP_WEIGHTS = re.compile(r"(^|\.)mtp[._]")
GLM4_NORM_NAMES = {"input_layernorm": "input_layernorm", "post_self_attn_layernorm": "post_attn_norm",
                   "post_attention_layernorm": "pre_mlp_norm", "post_mlp_layernorm": "post_mlp_norm"}


def local_heads(a: ModelArgs, p: Parallel) -> tuple[int, int, int]:
    """(q heads, kv heads, first kv head) on this rank; kv heads are replicated when fewer than ranks."""
    t = p.tp_size
    if a.num_heads % t or a.intermediate_size % t:
        raise ValueError(f"tensor parallel size {t} must divide the attention heads ({a.num_heads}) "
                         f"and the MLP width ({a.intermediate_size})")
    if a.num_kv_heads >= t:
        if a.num_kv_heads % t:
            raise ValueError(f"tensor parallel size {t} must divide the KV heads ({a.num_kv_heads})")
        kvh = a.num_kv_heads // t
        return a.num_heads // t, kvh, p.tp_rank * kvh
    if t % a.num_kv_heads:
        raise ValueError(f"KV heads ({a.num_kv_heads}) must divide the tensor parallel size {t}")
    return a.num_heads // t, 1, p.tp_rank * a.num_kv_heads // t


class AllHeadsNorm(nn.Module):
    """OLMo 2's q/k norm: one RMSNorm over all heads' channels together. Under tensor parallelism
    each rank holds some heads, so the sum of squares is all-reduced (KV heads replicated over
    `copies` ranks are counted once)."""

    def __init__(self, local: int, total: int, eps: float, p: Parallel, copies: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local))
        self.total, self.eps, self.p, self.copies = total, eps, p, copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.p.tp_size > 1:
            squares = self.p.all_reduce(squares) / self.copies
        return (self.weight.float() * (xf * torch.rsqrt(squares / self.total + self.eps))).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel, layer: int):
        super().__init__()
        self.h, self.kvh, _ = local_heads(a, p)
        self.d = a.head_dim
        self.qkv_proj = ColumnParallelLinear(a.hidden_size, (self.h + 2 * self.kvh) * self.d, a.qkv_bias)
        self.o_proj = RowParallelLinear(self.h * self.d, a.hidden_size, a.o_bias, p)
        self.q_norm = self.k_norm = None
        if a.qk_norm == "head":
            self.q_norm = RMSNorm(self.d, a.rms_norm_eps, a.norm_offset)
            self.k_norm = RMSNorm(self.d, a.rms_norm_eps, a.norm_offset)
        elif a.qk_norm == "head_layer":  # Cohere: this rank's heads' own weights
            self.q_norm = LayerNorm((self.h, self.d), a.rms_norm_eps)
            self.k_norm = LayerNorm((self.kvh, self.d), a.rms_norm_eps)
        elif a.qk_norm == "all":
            copies = max(1, p.tp_size // a.num_kv_heads)
            self.q_norm = AllHeadsNorm(self.h * self.d, a.num_heads * self.d, a.rms_norm_eps, p)
            self.k_norm = AllHeadsNorm(self.kvh * self.d, a.num_kv_heads * self.d, a.rms_norm_eps, p, copies)
        self.per_head_norm = a.qk_norm in ("head", "head_layer")
        self.norm_after_rope = a.qk_norm_after_rope  # HunYuan
        self.scale = a.attn_scale if a.attn_scale is not None else self.d ** -0.5
        self.window = a.layer_windows[layer] if a.layer_windows else None
        self.softcap = a.attn_softcap
        self.local_rope = a.local_rope is not None and self.window is not None  # Gemma 3's, OLMo 3's local layers
        self.nope = bool(a.nope_layers) and a.nope_layers[layer]  # SmolLM3: no rotary in this layer
        self.l2_norm = a.qk_norm == "l2" and not self.nope  # Llama 4: q and k L2-normed after the rotary
        # Queries scaled by position (Ministral 3; Llama 4's NoPE layers): the model passes q_scale
        self.scales_q = a.q_position_scale is not None and (a.architecture != "Llama4ForCausalLM" or self.nope)
        self.interleaved = a.rope.interleaved
        rope = a.local_rope if self.local_rope else a.rope
        # Norm, rotary and the KV write in one Triton kernel: whole-head rotate-half rotary.
        self.fusable = (a.qk_norm in (None, "head") and not a.qk_norm_after_rope and rope.dim == self.d
                        and not rope.interleaved
                        and a.clip_qkv is None and not self.scales_q and triton_fused.enabled())
        self.clip = a.clip_qkv
        self.eps, self.norm_offset = a.rms_norm_eps, a.norm_offset
        self.sinks = nn.Parameter(torch.empty(self.h)) if a.attn_sinks else None  # gpt-oss: this rank's heads'
        self.k_cache = self.v_cache = None  # views into the engine's KV pool, set at start-up
        # An fp8 pool's scales (a stored 1.0 means this much): the checkpoint's, else 1.0
        self.k_scale = self.v_scale = 1.0

    def forward(self, x, cos, sin, meta: AttentionMetadata, q_scale: torch.Tensor | None = None):
        """q_scale: [T] per-token factors on the queries (scales_q layers)."""
        t = x.shape[0]
        # (the fused kernel writes float K/V: an fp8 pool is written by write_kv below)
        if meta.triton is not None and self.fusable and not kv_quant.is_fp8(self.k_cache):
            q = triton_fused.qk_rope_write(
                self.qkv_proj(x), self.h, self.kvh, cos, sin, meta.slot_mapping, self.k_cache, self.v_cache,
                *((self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)),
                self.eps, self.norm_offset)
            o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, window=self.window,
                                softcap=self.softcap, sinks=self.sinks)
            return self.o_proj(o.reshape(t, self.h * self.d))
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], -1)
        if self.q_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:  # OLMo, OLMoE: q and k after their norms
            q, k, v = (t_.clamp(-self.clip, self.clip) for t_ in (q, k, v))
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)
        if self.per_head_norm and not self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin, self.interleaved)
        if self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.l2_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if q_scale is not None:
            q = q * q_scale[:, None, None]
        write_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v, self.k_scale, self.v_scale)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, k, v, self.window, self.softcap,
                            self.sinks, self.k_scale, self.v_scale)
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        width = a.intermediate_size // p.tp_size
        self.gate_up_proj = ColumnParallelLinear(a.hidden_size, 2 * width, a.mlp_bias)
        self.down_proj = RowParallelLinear(width, a.hidden_size, a.mlp_bias, p)
        self.act = gated_activation(a.activation)
        self.silu = a.activation == "silu"

    def forward(self, x, fused: bool = False):
        """fused: SiLU x up through the Triton kernel (steps of the Triton backend)."""
        if fused and self.silu:
            return self.down_proj(triton_fused.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(self.act(self.gate_up_proj(x)))


class PlainMLP(nn.Module):
    """up -> activation -> down, no gate (StarCoder2's c_fc / c_proj; Arcee's, Nemotron's, Apertus's
    up / down; Apertus's xIELU holds each layer's own parameters, `mlp.act_fn.*`)."""

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        width = a.intermediate_size // p.tp_size
        self.up_proj = ColumnParallelLinear(a.hidden_size, width, a.mlp_bias)
        self.down_proj = RowParallelLinear(width, a.hidden_size, a.mlp_bias, p)
        self.act_fn = XIELU() if a.activation == "xielu" else plain_activation(a.activation)

    def forward(self, x, fused: bool = False):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        norm = lambda: make_norm(a)  # noqa: E731
        self.input_layernorm = norm() if a.norms != "post" else None
        self.pre_mlp_norm = norm() if a.norms in ("pre", "sandwich", "parallel2") else None
        self.post_attn_norm = norm() if a.norms in ("post", "sandwich") else None
        self.post_mlp_norm = norm() if a.norms in ("post", "sandwich") else None
        self.parallel = a.norms in ("parallel", "parallel2")
        self.residual_scale = a.residual_scale
        self.eps, self.norm_offset = a.rms_norm_eps, a.norm_offset
        self.fusable = fused_block(a)

    def forward(self, x, cos, sin, meta, q_scale=None):
        if meta.triton is not None and self.fusable:
            return self._fused(x, cos, sin, meta)
        extra = {} if q_scale is None else {"q_scale": q_scale}  # (only Llama's attention takes it)
        if self.parallel:  # Cohere: both sublayers read the one norm (GPT-NeoX: a norm each)
            h = self.input_layernorm(x)
            h_mlp = h if self.pre_mlp_norm is None else self.pre_mlp_norm(x)
            return x + self.self_attn(h, cos, sin, meta, **extra) + self.mlp(h_mlp)
        attn = self.self_attn(_norm(self.input_layernorm, x), cos, sin, meta, **extra)
        x = x + self._scaled(self.post_attn_norm, attn)
        return x + self._scaled(self.post_mlp_norm, self.mlp(_norm(self.pre_mlp_norm, x)))

    def _fused(self, x, cos, sin, meta):
        """The same block on a step of the Triton backend: its elementwise work in
        kernels/triton_fused.py's kernels (a GPU step is otherwise dozens of tiny launches)."""
        h = triton_fused.rms_norm(x, self.input_layernorm.weight, self.eps, self.norm_offset)
        h, x = triton_fused.add_rms_norm(self.self_attn(h, cos, sin, meta), x, self.pre_mlp_norm.weight, self.eps,
                                         self.norm_offset)
        return x + self.mlp(h, fused=True)

    def _scaled(self, norm, y):
        y = _norm(norm, y)
        return y if self.residual_scale == 1.0 else y * self.residual_scale  # Granite


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's q/k norm: RMS-normalised per head, no weight, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_block(a: ModelArgs) -> bool:
    """Whether a decoder layer runs its Triton-backend steps through the fused kernels: RMS norms
    before each sublayer only, so the residual add and the next norm fuse."""
    return a.norms == "pre" and a.norm_kind == "rms" and a.residual_scale == 1.0 and triton_fused.enabled()


def make_norm(a: ModelArgs) -> nn.Module:
    if a.norm_kind == "layer":
        return LayerNorm(a.hidden_size, a.rms_norm_eps)
    if a.norm_kind == "layer_bias":
        return nn.LayerNorm(a.hidden_size, a.rms_norm_eps)
    if a.norm_kind == "layer_1p":
        return LayerNorm1P(a.hidden_size, a.rms_norm_eps)
    if a.norm_kind == "layer_plain":
        return PlainLayerNorm(a.hidden_size, a.rms_norm_eps)
    return RMSNorm(a.hidden_size, a.rms_norm_eps, a.norm_offset)


def _norm(norm, x):
    return x if norm is None else norm(x)


class LlamaModel(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel, make_layer):
        super().__init__()
        if p.first_stage:
            self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, p)
        if p.first_stage and a.learned_positions:  # OPT, GPT-2 (actors/models/gpt.py)
            self.embed_positions = nn.Embedding(a.learned_positions, a.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in p.layers(a.num_layers))
        if p.last_stage:
            self.norm = make_norm(a)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, p: Parallel | None = None):
        super().__init__()
        self.args, self.p = args, p or Parallel()
        self.model = LlamaModel(args, self.p, self.make_layer)
        self.first_layer = self.p.layers(args.num_layers).start
        # the final norm, on steps of the Triton backend
        self.fused_norm = triton_fused.enabled() and args.norm_kind == "rms"
        if self.p.last_stage:
            self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, self.p, args.lm_head_bias)
        # Room for the rotary tables only: the model is built on the meta device, where
        # computing them would import torch._dynamo (seconds of start-up); the loader fills them.
        for name, rope in (("rope", args.rope), ("rope_local", args.local_rope)):
            if rope:
                self.register_buffer(f"{name}_cos", torch.empty(max_positions, rope.dim), persistent=False)
                self.register_buffer(f"{name}_sin", torch.empty(max_positions, rope.dim), persistent=False)

    def make_layer(self, layer: int) -> nn.Module:
        """Decoder layer `layer` (global index); Gemma 4 builds its own."""
        return DecoderLayer(self.args, self.p, self.make_attention(layer), self.make_mlp(layer))

    def make_attention(self, layer: int) -> nn.Module:
        """The attention of (global) layer `layer`; DeepSeek puts its latent attention here."""
        return Attention(self.args, self.p, layer)

    def make_mlp(self, layer: int) -> nn.Module:
        """The feed-forward block of (global) layer `layer`; MoE models put their experts here."""
        return MLP(self.args, self.p) if self.args.gated_mlp else PlainMLP(self.args, self.p)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings and self.p.first_stage and self.p.last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) -> this stage's output."""
        if self.p.first_stage:
            x = self.model.embed_tokens(x)
            if self.args.embed_scale != 1.0:  # Gemma: sqrt(hidden) rounded to the dtype, as transformers does
                x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
            if self.args.learned_positions:
                x = x + self.model.embed_positions(positions + self.args.position_offset)
        rope = (self.rope_cos[positions], self.rope_sin[positions])
        local = (self.rope_local_cos[positions], self.rope_local_sin[positions]) if self.args.local_rope else rope
        # A NoPE layer rotates by angle 0 (cos 1, sin 0: q and k exactly as they are), so every
        # attention path, the fused Triton one included, serves it unchanged.
        nope = (torch.ones_like(rope[0]), torch.zeros_like(rope[1])) if self.args.nope_layers else rope
        q_scale = self._q_scale(positions, x.dtype) if self.args.q_position_scale else None
        for layer in self.model.layers:
            attn = layer.self_attn
            scaled = q_scale if getattr(attn, "scales_q", False) else None
            x = layer(x, *(nope if attn.nope else local if attn.local_rope else rope), meta, scaled)
        if not self.p.last_stage:
            return x
        norm = self.model.norm
        if meta.triton is not None and self.fused_norm:
            return triton_fused.rms_norm(x, norm.weight, norm.eps, norm.offset)
        return norm(x)

    def _q_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each token's query factor, 1 + beta * log(1 + floor((position + shift) / span))."""
        beta, span, shift = self.args.q_position_scale
        return (1 + beta * torch.log1p(torch.floor((positions.float() + shift) / span))).to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        a = self.args
        if a.logits_divisor != 1.0:  # Granite
            logits = logits / a.logits_divisor
        if a.logit_scale != 1.0:  # Cohere
            logits = logits * a.logit_scale
        if a.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits

    # ---- weight loading -----------------------------------------------------------------
    def weight_rule(self, name: str):
        """(param name, row offset in the param, dim to slice, start, size), a list of them (a
        tensor the checkpoint fuses, split here) or None to skip.

        dim/start/size pick this rank's slice of the checkpoint tensor (dim None: all of it).
        """
        a, p = self.args, self.p
        if "rotary_emb.inv_freq" in name or MTP_WEIGHTS.search(name):
            return None
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m:
            layer = int(m.group(1))
            if layer not in self.p.layers(a.num_layers):
                return None
            return self._layer_rule(f"model.layers.{layer - self.first_layer}.", m.group(2))
        vocab_start, vocab_rows = vocab_shard(a.vocab_size, p)
        rows = min(vocab_rows, a.vocab_size - vocab_start)
        if name == "model.embed_tokens.weight":
            if p.last_stage and a.tie_word_embeddings and not p.first_stage:
                return ("lm_head.weight", 0, 0, vocab_start, rows)
            return ("model.embed_tokens.weight", 0, 0, vocab_start, rows) if p.first_stage else None
        if name in ("lm_head.weight", "lm_head.bias"):
            if a.tie_word_embeddings and name == "lm_head.weight":  # some tied checkpoints store a copy
                return None
            return (name, 0, 0, vocab_start, rows) if p.last_stage else None
        name = name.replace("model.final_layernorm.", "model.norm.", 1)  # (Phi's name)
        if name.startswith("model.norm."):
            return (name, 0, None, 0, 0) if p.last_stage else None
        return (name, 0, None, 0, 0)

    def _layer_rule(self, prefix: str, rest: str):
        a, p = self.args, self.p
        h, kvh, kv0 = local_heads(a, p)
        d, width = a.head_dim, a.intermediate_size // p.tp_size
        kind = rest.rsplit(".", 1)[-1]  # weight | bias
        row_parallel = 1 if kind == "weight" else None  # their biases stay whole
        q_rows, kv_rows = a.num_heads * d, a.num_kv_heads * d
        rules = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, 0, p.tp_rank * h * d, h * d),
            "self_attn.k_proj": ("self_attn.qkv_proj", h * d, 0, kv0 * d, kvh * d),
            "self_attn.v_proj": ("self_attn.qkv_proj", (h + kvh) * d, 0, kv0 * d, kvh * d),
            "self_attn.o_proj": ("self_attn.o_proj", 0, row_parallel, p.tp_rank * h * d, h * d),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, 0, p.tp_rank * width, width),
            "mlp.up_proj": ("mlp.gate_up_proj", width, 0, p.tp_rank * width, width),
            "mlp.down_proj": ("mlp.down_proj", 0, row_parallel, p.tp_rank * width, width),
            # an ungated MLP (StarCoder2's names, Phi's)
            "mlp.c_fc": ("mlp.up_proj", 0, 0, p.tp_rank * width, width),
            "mlp.c_proj": ("mlp.down_proj", 0, row_parallel, p.tp_rank * width, width),
            "mlp.fc1": ("mlp.up_proj", 0, 0, p.tp_rank * width, width),
            "mlp.fc2": ("mlp.down_proj", 0, row_parallel, p.tp_rank * width, width),
            "self_attn.dense": ("self_attn.o_proj", 0, row_parallel, p.tp_rank * h * d, h * d),  # (Phi's name)
            # fused in the checkpoint (Phi-3, GLM-4's MLP): each part's slice of its rows
            "self_attn.qkv_proj": [("self_attn.qkv_proj", 0, 0, p.tp_rank * h * d, h * d),
                                   ("self_attn.qkv_proj", h * d, 0, q_rows + kv0 * d, kvh * d),
                                   ("self_attn.qkv_proj", (h + kvh) * d, 0, q_rows + kv_rows + kv0 * d, kvh * d)],
            "mlp.gate_up_proj": [("mlp.gate_up_proj", 0, 0, p.tp_rank * width, width),
                                 ("mlp.gate_up_proj", width, 0, a.intermediate_size + p.tp_rank * width, width)],
        }
        if not a.gated_mlp:  # an ungated MLP's up_proj (Arcee, Nemotron) is its own layer
            rules["mlp.up_proj"] = ("mlp.up_proj", 0, 0, p.tp_rank * width, width)
        if a.qk_norm == "all":  # OLMo 2: this rank's heads' channels
            rules["self_attn.q_norm"] = ("self_attn.q_norm", 0, 0, p.tp_rank * h * d, h * d)
            rules["self_attn.k_norm"] = ("self_attn.k_norm", 0, 0, kv0 * d, kvh * d)
        if a.qk_norm == "head_layer":  # Cohere: this rank's heads' rows
            rules["self_attn.q_norm"] = ("self_attn.q_norm", 0, 0, p.tp_rank * h, h)
            rules["self_attn.k_norm"] = ("self_attn.k_norm", 0, 0, kv0, kvh)
        if rest.startswith("mlp.act_fn."):  # Apertus's xIELU: whole on every rank (beta and eps stored 0-d)
            return (f"{prefix}{rest}", 0, lambda t: t[...].reshape(-1), 0, 0)
        if rest == "self_attn.sinks":  # gpt-oss: one per head, split like the heads
            return (f"{prefix}self_attn.sinks", 0, 0, p.tp_rank * h, h)
        module = rest.rsplit(".", 1)[0]
        module = {"self_attn.query_layernorm": "self_attn.q_norm", "self_attn.key_layernorm": "self_attn.k_norm"}.get(
            module, module)  # (HunYuan's names)
        if module in rules:
            rule = rules[module]
            if isinstance(rule, list):
                return [(f"{prefix}{target}.{kind}", *r) for target, *r in rule]
            target, offset, dim, start, size = rule
            return (f"{prefix}{target}.{kind}", offset, dim, start, size)
        norms = GLM4_NORM_NAMES if a.architecture == "Glm4ForCausalLM" else NORM_NAMES[a.norms]
        if module in norms:
            return (f"{prefix}{norms[module]}.{kind}", 0, None, 0, 0)
        return (f"{prefix}{module}.{kind}", 0, None, 0, 0)


def rope_tables(a: ModelArgs, max_positions: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"rope": (cos, sin)}, and "rope_local" for Gemma 3's sliding layers: [positions, rotary dim]."""
    tables = {"rope": cos_sin_cache(a.rope.dim, a.rope.theta, a.rope.scaling, max_positions, a.rope.interleaved)}
    if a.local_rope:
        r = a.local_rope
        tables["rope_local"] = cos_sin_cache(r.dim, r.theta, r.scaling, max_positions, r.interleaved)
    return tables
