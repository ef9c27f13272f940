"""The shape of a decoder, read from a Hugging Face config (transformers 4.x or 5.x spelling)."""
from __future__ import annotations

from dataclasses import dataclass

MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass
class MoeArgs:
    """The mixture-of-experts part of a decoder (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    shared_intermediate_size: int  # Qwen2-MoE's always-on shared expert; 0: none
    renormalize: bool  # rescale the top-k router weights to sum to 1
    sparse_step: int  # every sparse_step-th layer is a MoE layer ...
    dense_layers: tuple[int, ...]  # ... except these, which keep a dense MLP

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf(cls, arch: str, cfg: dict) -> "MoeArgs | None":
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # either spelling, by version
        if arch == "MixtralForCausalLM":  # every layer is sparse; top-k always renormalised
            return cls(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"], 0, True, 1, ())
        if arch not in MOE_ARCHS:
            return None
        return cls(experts, cfg.get("num_experts_per_tok", 4), cfg["moe_intermediate_size"],
                   cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0,
                   bool(cfg.get("norm_topk_prob", False)), cfg.get("decoder_sparse_step", 1) or 1,
                   tuple(cfg.get("mlp_only_layers") or ()))


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama's attention_bias
    o_bias: bool  # Llama's attention_bias
    qk_norm: bool  # Qwen3
    mlp_bias: bool
    moe: MoeArgs | None = None  # None: a dense model

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        attention_bias = bool(cfg.get("attention_bias", False))
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else attention_bias,
            o_bias=attention_bias and not qwen2,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            moe=MoeArgs.from_hf(arch, cfg),
        )
