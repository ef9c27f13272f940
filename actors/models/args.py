"""The shape of a decoder, read from a Hugging Face config (transformers 4.x or 5.x spelling)."""
from __future__ import annotations

import math
from dataclasses import dataclass

MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
             "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Ernie4_5_MoeForCausalLM", "GraniteMoeForCausalLM",
             "GraniteMoeSharedForCausalLM", "Llama4ForCausalLM", "PhimoeForCausalLM", "HunYuanMoEV1ForCausalLM")
HUNYUAN = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")  # per-head q/k norms after the rotary
GRANITE = ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
           "GraniteMoeHybridForCausalLM")  # the four multipliers
# (GLM-4.7-Flash, Glm4MoeLite, is DeepSeek-V3's latent attention with GLM-4.5's MoE, which routes as V3's)
# (Mistral 4 is V3's latent attention with softmax routing and queries scaled by position)
# (DeepSeek-V3.2 and GLM-5, GlmMoeDsa, are V3 with sparse attention: an indexer picks index_topk
# keys per query, all of them below that length, where they are served)
DSA_ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                  *DSA_ARCHS)
# Where a context is served only up to ModelArgs.max_context: what is not implemented past it
CONTEXT_CAPS = {"Llama4ForCausalLM": "its chunked attention", **dict.fromkeys(
    DSA_ARCHS, "its sparse attention's choice of index_topk keys per query")}
GPT_OSS = "GptOssForCausalLM"  # its own module: actors/models/gpt_oss.py
LEARNED_POSITIONS = ("OPTForCausalLM", "GPT2LMHeadModel")  # actors/models/gpt.py
GPTJ = "GPTJForCausalLM"  # its checkpoint names translated in actors/models/gpt.py
FALCON = "FalconForCausalLM"  # its own config fields (falcon_args) and names (actors/models/gpt.py)
GPT_NEOX = "GPTNeoXForCausalLM"  # its checkpoint names translated in actors/models/gpt.py too
# Linear-attention (Gated DeltaNet) layers between gated full-attention ones: actors/models/hybrid.py
HYBRID_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "Lfm2ForCausalLM",
                "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "BambaForCausalLM")
MAMBA1 = ("MambaForCausalLM", "FalconMambaForCausalLM")  # every layer a Mamba(-1) mixer: actors/models/nemotron_h.py
QWEN_HYBRID = HYBRID_ARCHS[:3]  # Gated DeltaNet; LFM2's are short convolutions
GEMMA4 = "Gemma4ForCausalLM"  # per-layer head sizes, KV sharing, per-layer embeddings: actors/models/gemma4.py
# Image-text checkpoints (Gemma 3 4B-27B, Mistral Small 3.x, LLaVA, Qwen2-VL / 2.5-VL / 3-VL) are
# served for their text: their language model (by its config's model_type, else the one named
# here, as transformers reads it) runs as the text architecture below, its weights read from
# under `language_model.` (actors/worker/checkpoint_files.py text_config, weight_files.py); the
# vision tower is never loaded.
IMAGE_TEXT_ARCHS = {"Gemma3ForConditionalGeneration": "gemma3_text", "Mistral3ForConditionalGeneration": "mistral",
                    "LlavaForConditionalGeneration": "llama", "Qwen2VLForConditionalGeneration": "qwen2_vl_text",
                    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_text",
                    "Qwen3VLForConditionalGeneration": "qwen3_vl_text",
                    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe_text",
                    "Llama4ForConditionalGeneration": "llama4_text",
                    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
                    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
                    "Gemma4ForConditionalGeneration": "gemma4_text"}
# A release's config.json naming its remote code's class where transformers loads it (by model_type)
# as its own: Phi-3.5-MoE's PhiMoEForCausalLM is transformers' PhimoeForCausalLM
ARCH_ALIASES = {"PhiMoEForCausalLM": "PhimoeForCausalLM"}
TEXT_ARCH_OF = {"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "llama4_text": "Llama4ForCausalLM", "ministral3": "Ministral3ForCausalLM",
                "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                "mistral4": "Mistral4ForCausalLM", "gemma4_text": GEMMA4}


@dataclass(frozen=True)
class Routing:
    """How a token picks its experts. Defaults: softmax, then the top k (Mixtral, Qwen-MoE)."""
    scoring: str = "softmax"  # softmax | sigmoid (DeepSeek-V3) | sparsemixer (PhiMoE: kernels/moe.py)
    # Grouped top-k (DeepSeek): experts come in n_group groups and a token only picks from its
    # topk_group best groups, a group scored by its best expert ("max", V2) or best two ("top2", V3).
    group_score: str | None = None
    n_group: int = 1
    topk_group: int = 1
    score_bias: bool = False  # V3: a learned bias steers the choice, not the weights
    scale: float = 1.0  # routed_scaling_factor: the chosen weights are multiplied by it
    jitter_eps: float = 0.0  # PhiMoE's router_jitter_noise: how near the top a logit must be to weigh in
    float32_logits: bool = False  # HunYuan: the router is a float32 layer (softmax, top-k, renormalised)


@dataclass
class MoeArgs:
    """The mixture-of-experts part of a decoder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5,
    MiniMax-M2, DeepSeek, gpt-oss)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    shared_intermediate_size: int  # the always-on shared expert(s) (Qwen2-MoE, DeepSeek); 0: none
    renormalize: bool  # rescale the top-k router weights to sum to 1
    sparse_step: int  # every sparse_step-th layer is a MoE layer ...
    dense_layers: tuple[int, ...]  # ... except these, which keep a dense MLP
    routing: Routing = Routing()
    shared_gate: bool = True  # Qwen2-MoE gates its shared expert by a sigmoid; DeepSeek adds it as is
    swiglu: tuple[float, float] | None = None  # gpt-oss's clamped SwiGLU (alpha, limit); None: SiLU x up
    weight_input: bool = False  # Llama 4: the router's weight scales the expert's input, not its output
    latent_size: int | None = None  # Nemotron 3: experts read and write a projection of the hidden state
    # Experts stacked in one tensor per projection: Llama 4's and Qwen3-VL-MoE's releases stack them
    # for x @ W ([E, H, 2I], [E, I, H]); otherwise they are in transformers' own layout ([E, 2I, H],
    # [E, H, I]: what it saves where no conversion applies, Mistral 4's)
    stacked_for_x_at_w: bool = False

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf(cls, arch: str, cfg: dict) -> "MoeArgs | None":
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # either spelling, by version
        if arch == GPT_OSS:  # every layer sparse; softmax over the top-k logits (renormalised by nature)
            return cls(experts, cfg.get("num_experts_per_tok", 4), cfg["intermediate_size"], 0, True, 1, (),
                       swiglu=(cfg.get("swiglu_alpha", 1.702), cfg.get("swiglu_limit", 7.0)))
        if arch == "MixtralForCausalLM":  # every layer is sparse; top-k always renormalised
            return cls(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"], 0, True, 1, ())
        if arch in GRANITE[1:]:  # every layer sparse, softmax over the top-k logits; Shared: an ungated shared MLP
            if arch == "GraniteMoeHybridForCausalLM" and not experts:  # (Granite 4.0-H-Micro: the shared MLP alone)
                return None
            return cls(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"],
                       cfg.get("shared_intermediate_size") or 0, True, 1, (), shared_gate=False)
        if arch in (*DEEPSEEK_ARCHS, "Glm4MoeForCausalLM"):
            return deepseek_moe(arch, cfg)
        if arch == "MiniMaxM2ForCausalLM":  # every layer sparse; sigmoid scores, chosen with a bias, renormalised
            return cls(experts, cfg.get("num_experts_per_tok", 8), cfg["intermediate_size"], 0, True, 1, (),
                       Routing(scoring="sigmoid", score_bias=True))
        if arch == "Ernie4_5_MoeForCausalLM":
            return ernie_moe(cfg)
        if arch == "Llama4ForCausalLM":
            return llama4_moe(cfg)
        if arch == "Qwen3_5MoeForCausalLM":  # every layer sparse, renormalised, a sigmoid-gated shared expert
            return cls(experts or 256, cfg.get("num_experts_per_tok", 8), cfg.get("moe_intermediate_size", 512),
                       cfg.get("shared_expert_intermediate_size", 512), True, 1, ())
        if arch == "PhimoeForCausalLM":
            return phimoe_moe(cfg)
        if arch == "HunYuanMoEV1ForCausalLM":
            return hunyuan_moe(cfg)
        if arch == "OlmoeForCausalLM":  # every layer sparse, its experts intermediate_size wide
            return cls(experts, cfg.get("num_experts_per_tok", 8), cfg["intermediate_size"], 0,
                       bool(cfg.get("norm_topk_prob", False)), 1, ())
        if arch == "Qwen3NextForCausalLM":  # Qwen2-MoE's block (a gated shared expert), renormalised by default
            return cls(experts or 512, cfg.get("num_experts_per_tok", 10), cfg.get("moe_intermediate_size", 512),
                       cfg.get("shared_expert_intermediate_size", 512), bool(cfg.get("norm_topk_prob", True)),
                       cfg.get("decoder_sparse_step", 1) or 1, tuple(cfg.get("mlp_only_layers") or ()))
        if arch not in MOE_ARCHS:
            return None
        return cls(experts, cfg.get("num_experts_per_tok", 4), cfg["moe_intermediate_size"],
                   cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0,
                   bool(cfg.get("norm_topk_prob", False)), cfg.get("decoder_sparse_step", 1) or 1,
                   tuple(cfg.get("mlp_only_layers") or ()),
                   stacked_for_x_at_w=bool(cfg.get("experts_stacked_for_x_at_w")))  # (Qwen3-VL-MoE's)


def llama4_moe(cfg: dict) -> MoeArgs:
    """Llama 4's MoE as transformers reads it: the top-k router logits through a sigmoid weigh
    each chosen expert's input; a shared expert of the same width; MoE layers `moe_layers`
    (default: every interleave_moe_layer_step-th), the others a dense MLP intermediate_size_mlp wide."""
    n, k = cfg["num_hidden_layers"], cfg.get("num_experts_per_tok", 1)
    if k != 1:
        raise ValueError(f"Llama 4 with {k} experts per token is not supported (its releases route to one)")
    step = cfg.get("interleave_moe_layer_step") or 1
    sparse = set(cfg["moe_layers"] if cfg.get("moe_layers") is not None else range(step - 1, n, step))
    width = cfg.get("intermediate_size", 8192)
    return MoeArgs(cfg.get("num_local_experts", 16), k, width, width, False, 1,
                   tuple(i for i in range(n) if i not in sparse), Routing(scoring="sigmoid"), shared_gate=False,
                   weight_input=True, stacked_for_x_at_w=True)


def phimoe_moe(cfg: dict) -> MoeArgs:
    """PhiMoE's (Phi-3.5-MoE) as transformers reads it: every layer sparse, two experts a token
    chosen and weighted by its sparsemixer (eval mode) with router_jitter_noise as its threshold."""
    k, act = cfg.get("num_experts_per_tok", 2), cfg.get("hidden_act", "silu")
    if k != 2:
        raise ValueError(f"PhiMoE with num_experts_per_tok={k} is not supported (its sparsemixer routes to 2)")
    if act != "silu":
        raise ValueError(f"PhiMoE with hidden_act={act!r} is not supported (its experts: SiLU-gated)")
    return MoeArgs(cfg.get("num_local_experts", 16), 2, cfg["intermediate_size"], 0, False, 1, (),
                   Routing(scoring="sparsemixer", jitter_eps=float(cfg.get("router_jitter_noise", 0.01))))


def hunyuan_moe(cfg: dict) -> MoeArgs:
    """HunYuan MoE's (Hunyuan-A13B) as transformers reads it: every layer sparse, the router's
    float32 softmax top-k renormalised, one always-on shared MLP; its experts and shared MLP both
    intermediate_size wide. What transformers' class leaves out is refused (its releases name it
    and keep to what transformers runs)."""
    def one(field: str, default):
        value = cfg.get(field, default)
        values = set(value) if isinstance(value, list) else {value}
        if len(values) != 1:
            raise ValueError(f"HunYuan MoE with a {field} that differs by layer is not supported")
        return values.pop()
    width = cfg["intermediate_size"]
    if cfg.get("use_cla") or one("num_shared_expert", 1) != 1 or not cfg.get("use_mixed_mlp_moe", True) \
            or one("moe_intermediate_size", width) != width:
        raise ValueError("HunYuan MoE with cross-layer attention (use_cla), other than one shared MLP "
                         "(num_shared_expert, use_mixed_mlp_moe) or experts of another width than "
                         "intermediate_size (moe_intermediate_size) is not supported")
    return MoeArgs(one("num_experts", 1), one("moe_topk", 1), width, width, True, 1, (),
                   Routing(float32_logits=True), shared_gate=False)


def ernie_moe(cfg: dict) -> MoeArgs:
    """ERNIE 4.5's MoE as transformers reads it: softmax scores, the choice steered by a bias
    (`moe_statics`), renormalised; shared experts beside the routed ones; sparse every
    moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index."""
    if cfg.get("use_bias"):
        raise ValueError("ERNIE 4.5 MoE with use_bias (biased shared experts) is not supported")
    n = cfg["num_hidden_layers"]
    first, last = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_end_index", -1)
    last = n - 1 if last in (-1, None) else last
    width = cfg.get("moe_intermediate_size", 1536)
    return MoeArgs(cfg.get("moe_num_experts", 64), cfg.get("moe_k", 6), width,
                   width * (cfg.get("moe_num_shared_experts") or 0), True, cfg.get("moe_layer_interval") or 1,
                   tuple(i for i in range(n) if not first <= i <= last), Routing(score_bias=True), shared_gate=False)


# What transformers' config class assumes where a DeepSeek-style config leaves a routing field out
MOE_FIELD_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(n_shared_experts=2, routed_scaling_factor=1.0, first_k_dense_replace=0,
                                  norm_topk_prob=False, n_group=1, topk_group=1),
    "DeepseekV3ForCausalLM": dict(n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=3,
                                  norm_topk_prob=True, n_group=8, topk_group=4),
    "Glm4MoeForCausalLM": dict(n_shared_experts=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                               norm_topk_prob=True, n_group=1, topk_group=1),
    "Glm4MoeLiteForCausalLM": dict(n_shared_experts=1, routed_scaling_factor=1.8, first_k_dense_replace=1,
                                   norm_topk_prob=True, n_group=1, topk_group=1),
    "Mistral4ForCausalLM": dict(n_shared_experts=1, routed_scaling_factor=1.0, first_k_dense_replace=0,
                                norm_topk_prob=True, n_group=1, topk_group=1),
    "DeepseekV32ForCausalLM": dict(n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=3,
                                   norm_topk_prob=True, n_group=8, topk_group=4),
    "GlmMoeDsaForCausalLM": dict(n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=3,
                                 norm_topk_prob=True, n_group=1, topk_group=1),
}


def deepseek_moe(arch: str, cfg: dict) -> MoeArgs:
    """DeepSeek's MoE as transformers reads it: the first first_k_dense_replace layers dense, shared
    experts beside the routed ones; V2 scores by softmax (grouped by each group's best expert
    under "group_limited_greedy") and never renormalises; V3 (and GLM-4.5, which routes as V3 does)
    by sigmoid, grouped by each group's best two, with a bias on the choice; Mistral 4 by softmax,
    grouped by each group's best two, without a bias."""
    cfg = {**MOE_FIELD_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}
    v2 = arch == "DeepseekV2ForCausalLM"
    sigmoid = not v2 and arch != "Mistral4ForCausalLM"
    grouped = not v2 or cfg.get("topk_method") == "group_limited_greedy"
    routing = Routing(scoring="sigmoid" if sigmoid else "softmax",
                      group_score=("max" if v2 else "top2") if grouped else None,
                      n_group=cfg["n_group"], topk_group=cfg["topk_group"], score_bias=sigmoid,
                      scale=float(cfg["routed_scaling_factor"]))
    width = cfg["moe_intermediate_size"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    types = cfg.get("mlp_layer_types")  # (Glm4MoeLite's spelling of which layers stay dense)
    dense = (tuple(i for i, t in enumerate(types) if t == "dense") if types
             else tuple(range(cfg["first_k_dense_replace"])))
    return MoeArgs(experts, cfg["num_experts_per_tok"], width, width * cfg["n_shared_experts"],
                   not v2 and bool(cfg["norm_topk_prob"]), 1, dense, routing, shared_gate=False)


@dataclass(frozen=True)
class MlaArgs:
    """DeepSeek's multi-head latent attention. Keys and values are rebuilt per head from one
    latent vector per token (kv_lora_rank wide) and a rotary key shared by all heads: those two
    are all the KV cache holds."""
    q_lora_rank: int | None  # the query's own low-rank step (V3); None: straight from the hidden state
    kv_lora_rank: int
    nope_dim: int  # per head: the query/key channels without rotary ...
    rope_dim: int  # ... and with it
    v_dim: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "MlaArgs":
        return cls(cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                   cfg["v_head_dim"])


DENSE_ARCHS = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
    "Glm4ForCausalLM", "SmolLM3ForCausalLM", "Olmo3ForCausalLM", "MinistralForCausalLM", "SeedOssForCausalLM",
    "Ernie4_5ForCausalLM", "Exaone4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM",
    "ArceeForCausalLM", "NemotronForCausalLM", "PhiForCausalLM", "StableLmForCausalLM", GPT_NEOX,
    "Ministral3ForCausalLM", GPTJ,
    "HunYuanDenseV1ForCausalLM", "OlmoForCausalLM", "GlmForCausalLM", "HeliumForCausalLM", "ApertusForCausalLM",
)
COHERE = ("CohereForCausalLM", "Cohere2ForCausalLM")  # LayerNorm, attention and MLP in parallel, logit scale
# up -> activation -> down
PLAIN_MLP = ("Starcoder2ForCausalLM", "ArceeForCausalLM", "NemotronForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM",
             "GPTJForCausalLM", "ApertusForCausalLM")
NORM_KINDS = {**dict.fromkeys(("Starcoder2ForCausalLM", "PhiForCausalLM", "StableLmForCausalLM", "GPTNeoXForCausalLM",
                               "GPTJForCausalLM", "PhimoeForCausalLM"), "layer_bias"),
              "NemotronForCausalLM": "layer_1p", "OlmoForCausalLM": "layer_plain", **dict.fromkeys(COHERE, "layer")}
OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")  # norms after each sublayer only, q/k norms over all heads
ALL_HEADS_QK_NORM = (*OLMO, "OlmoeForCausalLM", "MiniMaxM2ForCausalLM")  # one q and one k norm over all heads
GLM = ("GlmForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM")  # biased q/k/v, the output projection not
ERNIE = ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")
INTERLEAVED_ROPE = ("GlmForCausalLM", "Glm4ForCausalLM", *ERNIE, *COHERE, "Llama4ForCausalLM", "GPTJForCausalLM",
                    "HeliumForCausalLM")  # (even, odd) pairs
# What transformers' config class assumes where a family's config leaves a field out (the attention's
# shape, norms, rotary), where that differs from Llama's
CONFIG_DEFAULTS = {
    **dict.fromkeys(("GlmForCausalLM", "Glm4ForCausalLM"), dict(
        head_dim=128, num_key_value_heads=2, attention_bias=True, partial_rotary_factor=0.5,
        rms_norm_eps=1.5625e-07, max_position_embeddings=131072)),
    "HeliumForCausalLM": dict(head_dim=128, num_key_value_heads=20, rms_norm_eps=1e-8, rope_theta=100_000.0,
                              max_position_embeddings=4096),
    "PhimoeForCausalLM": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                              max_position_embeddings=131072),
    "HunYuanMoEV1ForCausalLM": dict(rms_norm_eps=1e-5),
    "ApertusForCausalLM": dict(hidden_act="xielu", rms_norm_eps=1e-5, rope_theta=12_000_000.0,
                               max_position_embeddings=65536),
}
# Apertus's class without rope_parameters or rope_scaling: llama3 over a 12M base, whatever rope_theta says
APERTUS_ROPE = dict(rope_type="llama3", rope_theta=12_000_000.0, factor=8.0, original_max_position_embeddings=8192,
                    low_freq_factor=1.0, high_freq_factor=4.0)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # (Gemma 1 has the (1 + w) norms and scaled embedding only)
QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def with_config_defaults(arch: str, cfg: dict) -> dict:
    """`cfg` with the fields it leaves out filled as the family's transformers config class fills them."""
    cfg = {**CONFIG_DEFAULTS.get(arch, {}), **cfg}
    if arch == "ApertusForCausalLM" and not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg["rope_parameters"] = APERTUS_ROPE
    return cfg


@dataclass(frozen=True)
class LinearAttnArgs:
    """Gated DeltaNet's shape (Qwen3.5): key heads (q and k), value heads (each key head serves
    v_heads // k_heads of them), their widths, and the depthwise convolution's kernel."""
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "LinearAttnArgs":
        return cls(cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32),
                   cfg.get("linear_key_head_dim", 128), cfg.get("linear_value_head_dim", 128),
                   cfg.get("linear_conv_kernel_dim", 4))


@dataclass(frozen=True)
class MambaArgs:
    """Mamba-2's mixer (Granite 4.0-H): heads of head_dim channels, B and C shared by the heads
    of each of `groups` groups, a d_state-wide state per channel, the convolution's kernel, dt's
    clamp, biases."""
    heads: int
    head_dim: int
    groups: int
    d_state: int
    conv_kernel: int
    inner: int  # heads x head_dim (expand x hidden)
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]

    @classmethod
    def from_hf(cls, cfg: dict) -> "MambaArgs":
        inner = int(cfg.get("mamba_expand", 2) * cfg["hidden_size"])
        heads = cfg.get("mamba_n_heads", 128)
        head_dim = cfg.get("mamba_d_head")
        limit = cfg.get("time_step_limit") or (0.0, float("inf"))
        return cls(heads, inner // heads if head_dim in (None, "auto") else head_dim, cfg.get("mamba_n_groups", 1),
                   cfg.get("mamba_d_state", 256), cfg.get("mamba_d_conv", 4), inner,
                   bool(cfg.get("mamba_conv_bias", True)), bool(cfg.get("mamba_proj_bias", False)),
                   (float(limit[0]), float(limit[1])))


@dataclass(frozen=True)
class Mamba1Args:
    """Mamba(-1)'s mixer: inner channels, the state's width per channel, the convolution's kernel,
    dt's low rank, biases, and FalconMamba's weightless RMS norms on dt, B and C (their epsilon)."""
    inner: int
    d_state: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    rms_eps: float | None


@dataclass(frozen=True)
class ShortConvArgs:
    """LFM2's convolution layers: the depthwise causal convolution's kernel and whether its
    projections and convolution have biases."""
    kernel: int
    bias: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "ShortConvArgs":
        return cls(cfg.get("conv_L_cache", 3), bool(cfg.get("conv_bias", False)))


def linear_layers(cfg: dict) -> tuple[bool, ...]:
    """True for each linear-attention (LFM2: convolution) layer: `layer_types`, else every
    full_attention_interval-th layer is full attention (transformers' default for an older config)."""
    n, types = cfg["num_hidden_layers"], cfg.get("layer_types")
    if not types and cfg.get("attn_layer_indices") is not None:  # (Bamba's spelling)
        return tuple(i not in cfg["attn_layer_indices"] for i in range(n))
    if types:
        types = [{"conv": "linear_attention", "mamba": "linear_attention", "attention": "full_attention"}.get(t, t)
                 for t in types]  # (LFM2's and Granite 4.0-H's names)
        unknown = set(types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"{cfg['architectures'][0]} layer types {sorted(unknown)} are not supported")
        return tuple(t == "linear_attention" for t in types)
    every = cfg.get("full_attention_interval", 4)
    return tuple(bool((i + 1) % every) for i in range(n))


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: base, Hugging Face rope_scaling dict (None: plain), rotated dims."""
    theta: float
    scaling: dict | None
    dim: int  # < head_dim: partial rotary (Phi-4-mini, GLM-4): the rest passes through
    interleaved: bool = False  # GLM-4 rotates pairs (0, 1), (2, 3), ... instead of halves


@dataclass
class ModelArgs:
    """A decoder's shape and each family's twists on the Llama block (defaults: Llama's)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, GLM-4, or Llama's attention_bias
    o_bias: bool  # Llama's attention_bias
    # "head": per head (Qwen3, Gemma 3); "all": over all heads (OLMo 2); "head_layer": Cohere's
    # LayerNorm per head, each head its own weights; "l2": Llama 4's, per head without weights,
    # after the rotary, in rotary layers only
    qk_norm: str | None
    mlp_bias: bool
    moe: MoeArgs | None = None  # None: a dense model
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: sees everything)
    local_rope: Rope | None = None  # Gemma 3: the sliding layers' own rotary base
    nope_layers: tuple[bool, ...] = ()  # SmolLM3, EXAONE 4: True for a layer without rotary (NoPE); (): none
    attn_scale: float | None = None  # query scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> softcap * tanh(scores / softcap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight)
    embed_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: each block's output is scaled before it is added
    logits_divisor: float = 1.0  # Granite: logits / logits_scaling
    activation: str = "silu"  # of the gated MLP: silu | gelu_tanh (Gemma's GeGLU)
    # pre (Llama) | sandwich (pre and post: Gemma, GLM-4) | post (OLMo 2) | parallel (Cohere: one
    # norm, attention and MLP both read it, both added to the residual) | parallel2 (GPT-NeoX: the
    # same with a norm each)
    norms: str = "pre"
    # rms | layer (Cohere: mean-centred, weight only) | layer_bias (torch's LayerNorm) | layer_1p
    # (Nemotron: torch's LayerNorm scaled by 1 + weight) | layer_plain (OLMo: no weight, no bias)
    norm_kind: str = "rms"
    gated_mlp: bool = True  # False: up -> activation -> down (PLAIN_MLP: StarCoder2, GPT-J, Phi-2, ...)
    logit_scale: float = 1.0  # Cohere: the logits are multiplied by it
    lm_head_bias: bool = False  # Phi-2
    mla: MlaArgs | None = None  # DeepSeek; then head_dim is the cached latent's width, one KV "head"
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    learned_positions: int = 0  # OPT, GPT-2: a table of this many position embeddings (no rotary)
    # Llama 4, DeepSeek-V3.2, GLM-5: the longest context served exactly (what CONTEXT_CAPS names,
    # not implemented, changes nothing below it); None: max_position_embeddings
    max_context: int | None = None
    qk_norm_after_rope: bool = False  # HunYuan: the per-head q/k norms follow the rotary
    # Queries scaled by position (Llama 4's NoPE layers, Ministral 3): (beta, span, shift) gives
    # 1 + beta * log(1 + floor((position + shift) / span))
    q_position_scale: tuple[float, int, int] | None = None
    position_offset: int = 0  # OPT: position p reads row p + 2
    clip_qkv: float | None = None  # OLMo, OLMoE: q, k and v clamped to [-clip, clip]
    # Qwen3.5: Gated DeltaNet in the layers marked True (a recurrent state per sequence, no KV
    # cache), full attention with a sigmoid output gate (attn_output_gate) in the others
    linear_attn: "LinearAttnArgs | ShortConvArgs | MambaArgs | Mamba1Args | None" = None
    linear_layers: tuple[bool, ...] = ()
    attn_output_gate: bool = False  # (the Qwen hybrids')
    gemma4: "Gemma4Args | None" = None  # Gemma 4's per-layer shapes and additions
    # Nemotron-H: each layer one norm and one mixer, "mamba" | "attention" | "mlp" | "moe" (): the usual block)
    mixer_blocks: tuple[str, ...] = ()

    def caches_kv(self, layer: int) -> bool:
        """Whether layer `layer` keeps K/V in the pool (a linear-attention layer keeps a state)."""
        return not (self.linear_layers and self.linear_layers[layer])

    @property
    def kv_planes(self) -> int:
        """Tensors cached per layer: K and V, or MLA's one latent (its values are its first channels)."""
        return 1 if self.mla else 2

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch in DEEPSEEK_ARCHS:
            return deepseek_args(arch, cfg)
        if arch in LEARNED_POSITIONS:
            return learned_position_args(arch, cfg)
        if arch == GEMMA4:
            return gemma4_args(cfg)
        if arch == "NemotronHForCausalLM":
            return nemotron_h_args(cfg)
        if arch in MAMBA1:
            return mamba1_args(arch, cfg)
        if arch == FALCON:
            return falcon_args(cfg)
        cfg = with_config_defaults(arch, cfg)
        heads = cfg["num_attention_heads"]
        head_dim = (cfg.get("head_dim", 128) if arch == "Ernie4_5ForCausalLM" else cfg.get("head_dim")
                    ) or cfg["hidden_size"] // heads  # (ERNIE 4.5's config class: 128 when unnamed)
        # every projection biased: ERNIE 4.5 with use_bias, StarCoder2 unless use_bias is off, Phi-2
        all_biased = (arch in ERNIE and bool(cfg.get("use_bias", False))
                      or arch == "Starcoder2ForCausalLM" and bool(cfg.get("use_bias", True)) or arch == "PhiForCausalLM")
        if arch in ("PhiForCausalLM", "StableLmForCausalLM") and cfg.get("qk_layernorm"):
            raise ValueError(f"{arch} with qk_layernorm is not supported")
        stablelm = arch == "StableLmForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", arch == GPT_NEOX)) or all_biased  # (NeoX: on by default)
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        gemma = arch in GEMMA
        gemma_norms = gemma or arch == "GemmaForCausalLM"  # (1 + w) norms, embeddings scaled by sqrt(hidden)
        granite = arch in GRANITE
        hybrid, lfm2 = arch in QWEN_HYBRID, arch == "Lfm2ForCausalLM"
        mamba = arch in ("GraniteMoeHybridForCausalLM", "BambaForCausalLM")
        rope, local_rope = ropes(arch, cfg, head_dim)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=mlp_width(arch, cfg),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=(cfg.get("num_key_value_heads") if arch != GPT_NEOX else None) or heads,  # (NeoX: MHA)
            head_dim=head_dim,
            rms_norm_eps=norm_eps(arch, cfg),
            rope=rope,
            local_rope=local_rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             gemma_norms or arch in (*COHERE, "Starcoder2ForCausalLM",
                                                                     "Lfm2ForCausalLM"))),
            qkv_bias=(bool(cfg.get("qkv_bias", True)) if qwen2 else bool(cfg.get("use_qkv_bias")) if stablelm
                      else attention_bias),
            o_bias=(bool(cfg.get("attention_out_bias", False)) if arch == "SeedOssForCausalLM"
                    else attention_bias and not qwen2 and arch not in (*GLM, "HeliumForCausalLM")),
            qk_norm=("head" if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                                        "Exaone4ForCausalLM", *HUNYUAN, "ApertusForCausalLM", *QWEN_HYBRID,
                                        "Lfm2ForCausalLM")
                     or arch == "Glm4MoeForCausalLM" and cfg.get("use_qk_norm")
                     else "all" if arch in ALL_HEADS_QK_NORM
                     else "head_layer" if arch == "CohereForCausalLM" and cfg.get("use_qk_norm")
                     else "l2" if arch == "Llama4ForCausalLM" and cfg.get("use_qk_norm", True) else None),
            clip_qkv=cfg.get("clip_qkv") if arch in ("OlmoeForCausalLM", "OlmoForCausalLM") else None,
            mlp_bias=bool(cfg.get("mlp_bias", False)) or all_biased or arch in (GPTJ, GPT_NEOX),
            moe=MoeArgs.from_hf(arch, cfg),
            layer_windows=layer_windows(arch, cfg),
            attn_scale=(cfg["query_pre_attn_scalar"] ** -0.5 if gemma
                        else cfg.get("attention_multiplier", 1.0) if granite else None),
            # Gemma 3's config has the field too, but transformers' Gemma 3 never applies it
            attn_softcap=cfg.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            norm_offset=1.0 if gemma_norms or hybrid else 0.0,  # (Qwen3.5's zero-centred norms too)
            embed_scale=(cfg["hidden_size"] ** 0.5 if gemma_norms
                         else cfg.get("embedding_multiplier", 1.0) if granite else 1.0),
            residual_scale=cfg.get("residual_multiplier", 1.0) if granite else 1.0,
            logits_divisor=cfg.get("logits_scaling", 1.0) if granite else 1.0,
            activation=(plain_activation if arch in PLAIN_MLP else gated_activation)(
                _gemma_legacy_gelu(arch, cfg.get("hidden_activation") or cfg.get("hidden_act")
                                   or cfg.get("activation_function") or "silu")),  # (GPT-J's name)
            gated_mlp=arch not in PLAIN_MLP,
            norms=("sandwich" if gemma or arch == "Glm4ForCausalLM"
                   else "post" if arch in (*OLMO, "Exaone4ForCausalLM")
                   else "parallel" if arch in (*COHERE, "PhiForCausalLM", GPTJ)
                   or stablelm and cfg.get("use_parallel_residual")
                   else "parallel2" if arch == GPT_NEOX and cfg.get("use_parallel_residual", True) else "pre"),
            norm_kind=NORM_KINDS.get(arch, "rms"),
            logit_scale=float(cfg.get("logit_scale") or 0.0625) if arch in COHERE else 1.0,
            lm_head_bias=(arch in ("PhiForCausalLM", GPTJ)
                          or arch == "PhimoeForCausalLM" and bool(cfg.get("lm_head_bias"))),
            max_context=cfg.get("attention_chunk_size") if arch == "Llama4ForCausalLM" else None,
            q_position_scale=q_position_scale(arch, cfg),
            qk_norm_after_rope=arch in HUNYUAN,
            attn_sinks=arch == GPT_OSS,
            nope_layers=nope_layers(arch, cfg),
            linear_attn=(LinearAttnArgs.from_hf(cfg) if hybrid else ShortConvArgs.from_hf(cfg) if lfm2
                         else MambaArgs.from_hf(cfg) if mamba else None),
            linear_layers=linear_layers(cfg) if hybrid or lfm2 or mamba else (),
            attn_output_gate=hybrid,
        )


def deepseek_args(arch: str, cfg: dict) -> ModelArgs:
    """DeepSeek-V2 / V3: MLA, dense first layers, then MoE with shared experts. The rotary part
    of each head rotates interleaved pairs (V2 always, V3 unless rope_interleave is off); the
    score scale is the whole query/key head's, times YaRN's mscale squared."""
    mla = MlaArgs.from_hf(cfg)
    rope, _ = ropes(arch, cfg, mla.rope_dim)  # (the rotary part is rope_dim wide whatever a partial factor says)
    interleaved = arch == "DeepseekV2ForCausalLM" or cfg.get("rope_interleave", True)
    scale = (mla.nope_dim + mla.rope_dim) ** -0.5
    mscale_all_dim = (rope.scaling or {}).get("mscale_all_dim")
    if rope.scaling and mscale_all_dim:
        scale *= yarn_mscale(rope.scaling["factor"], mscale_all_dim) ** 2
    return ModelArgs(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=1, head_dim=mla.kv_lora_rank + mla.rope_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=Rope(rope.theta, rope.scaling, mla.rope_dim, bool(interleaved)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=None, mlp_bias=False, moe=MoeArgs.from_hf(arch, cfg), layer_windows=(None,) * cfg["num_hidden_layers"],
        attn_scale=scale, activation=gated_activation(cfg.get("hidden_act") or "silu"), mla=mla,
        q_position_scale=q_position_scale(arch, cfg),
        max_context=cfg.get("index_topk", 2048) if arch in DSA_ARCHS else None)


def learned_position_args(arch: str, cfg: dict) -> ModelArgs:
    """OPT and GPT-2 as transformers reads them: learned absolute positions, LayerNorms with
    biases before each sublayer, an ungated MLP, every projection biased, full attention."""
    if arch == "OPTForCausalLM":
        hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        width, positions, eps = cfg["ffn_dim"], cfg.get("max_position_embeddings", 2048), 1e-5
        act, bias, offset = cfg.get("activation_function", "relu"), bool(cfg.get("enable_bias", True)), 2
        if not cfg.get("do_layer_norm_before", True) or cfg.get("word_embed_proj_dim", hidden) != hidden:
            raise ValueError("OPT with its norms after each sublayer or an embedding projection (OPT-350m) "
                             "is not supported")
        scale = None
    else:
        hidden, heads, layers = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
        width, positions, eps = cfg.get("n_inner") or 4 * hidden, cfg.get("n_positions", 1024), cfg.get(
            "layer_norm_epsilon", 1e-5)
        act, bias, offset = cfg.get("activation_function", "gelu_new"), True, 0
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
        scale = None if cfg.get("scale_attn_weights", True) else 1.0
    head_dim = hidden // heads
    return ModelArgs(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden, intermediate_size=width,
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, rms_norm_eps=eps,
        rope=Rope(10_000.0, None, head_dim), max_position_embeddings=positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=bias, o_bias=bias, qk_norm=None,
        mlp_bias=bias, layer_windows=(None,) * layers, nope_layers=(True,) * layers, attn_scale=scale,
        activation=plain_activation(act), gated_mlp=False, norm_kind="layer_bias",
        learned_positions=positions + offset, position_offset=offset)


def falcon_args(cfg: dict) -> ModelArgs:
    """Falcon as transformers reads it: one fused query_key_value (multi-query: every query head,
    one key, one value; new_decoder_architecture: per KV group its query heads, a key and a value;
    otherwise q, k and v per head), LayerNorms with biases, an ungated MLP, `bias` on every
    projection; the attention and MLP in parallel off one norm (parallel_attn) or, in the new
    architecture, a norm each (num_ln_in_parallel_attn, 2 by default), else Llama's order."""
    if cfg.get("alibi"):
        raise ValueError("Falcon with alibi (positions as attention biases, Falcon-RW) is not supported")
    new, parallel = bool(cfg.get("new_decoder_architecture", False)), bool(cfg.get("parallel_attn", True))
    if new and not parallel:
        raise ValueError("Falcon with new_decoder_architecture and parallel_attn off is not supported")
    hidden = cfg.get("n_embed") or cfg.get("hidden_size", 4544)  # (n_embed, its first spelling, wins)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads = (cfg.get("num_kv_heads") or heads) if new else 1 if cfg.get("multi_query", True) else heads
    ln = cfg.get("num_ln_in_parallel_attn") or (2 if new else 1)
    head_dim, bias = hidden // heads, bool(cfg.get("bias", False))
    rope, _ = ropes(FALCON, cfg, head_dim)
    return ModelArgs(
        architecture=FALCON, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg.get("ffn_hidden_size") or 4 * hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=cfg.get("layer_norm_epsilon") or 1e-5, rope=rope,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=bias, o_bias=bias, qk_norm=None,
        mlp_bias=bias, layer_windows=(None,) * layers, activation=plain_activation(cfg.get("activation") or "gelu"),
        gated_mlp=False, norm_kind="layer_bias",
        norms="parallel2" if new and ln == 2 else "parallel" if parallel else "pre")


def nemotron_h_args(cfg: dict) -> ModelArgs:
    """Nemotron-H (Nemotron Nano 2, Nemotron 3) as transformers' class completes its config: layers
    of one norm and one mixer each, Mamba-2, attention without rotary, a squared-ReLU MLP or an MoE
    of such experts, as layers_block_type (its releases' hybrid_override_pattern) lays them out."""
    types = list(cfg["layers_block_type"])
    n, heads = len(types), cfg["num_attention_heads"]
    blocks = tuple({"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}[t]
                   for t in types)
    moe = None
    if "moe" in blocks:  # Nemotron 3: DeepSeek-V3's routing over squared-ReLU experts, a shared one
        if cfg.get("moe_latent_size") and cfg.get("mlp_bias"):
            raise ValueError("Nemotron-H with a latent MoE projection and MLP biases is not supported")
        moe = MoeArgs(cfg.get("n_routed_experts", 8), cfg.get("num_experts_per_tok", 2),
                      cfg.get("moe_intermediate_size", 7688), cfg.get("moe_shared_expert_intermediate_size", 7688),
                      bool(cfg.get("norm_topk_prob", True)), 1, (),
                      Routing(scoring="sigmoid", group_score="top2", n_group=cfg.get("n_group") or 1,
                              topk_group=cfg.get("topk_group") or 1, score_bias=True,
                              scale=float(cfg.get("routed_scaling_factor", 1.0))),
                      shared_gate=False, latent_size=cfg.get("moe_latent_size"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    mamba_heads, mamba_dim = cfg.get("mamba_num_heads", 128), cfg.get("mamba_head_dim", 64)
    mamba = MambaArgs(mamba_heads, mamba_dim, cfg.get("n_groups", 8), cfg.get("ssm_state_size", 128),
                      cfg.get("conv_kernel", 4), mamba_heads * mamba_dim, bool(cfg.get("use_conv_bias", True)),
                      bool(cfg.get("use_bias", False)),  # (its mixer's projections read use_bias)
                      (float(cfg.get("time_step_min", 0.001)), float("inf")))  # (its mixer's clamp: dt >= min)
    bias = False  # (its attention's projections never have biases, whatever attention_bias says)
    return ModelArgs(
        architecture="NemotronHForCausalLM", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5), rope=Rope(10_000.0, None, head_dim),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bias, o_bias=bias, qk_norm=None,
        mlp_bias=bool(cfg.get("mlp_bias", False)), layer_windows=(None,) * n, nope_layers=(True,) * n,
        activation=plain_activation(cfg.get("mlp_hidden_act") or "relu2"), gated_mlp=False,
        linear_attn=mamba, linear_layers=tuple(b == "mamba" for b in blocks), mixer_blocks=blocks, moe=moe)


def mamba1_args(arch: str, cfg: dict) -> ModelArgs:
    """Mamba (state-spaces' releases in transformers' layout) and FalconMamba: every layer one norm
    and one Mamba(-1) mixer, no attention (so no KV cache at all)."""
    hidden, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    inner = cfg.get("intermediate_size") or int(cfg.get("expand", 2) * hidden)
    rank = cfg.get("time_step_rank", "auto")
    mixer = Mamba1Args(inner, cfg.get("state_size", 16), cfg.get("conv_kernel", 4),
                       -(-hidden // 16) if rank == "auto" else int(rank), bool(cfg.get("use_conv_bias", True)),
                       bool(cfg.get("use_bias", False)),
                       (cfg.get("mixer_rms_eps") or 1e-6) if arch == "FalconMambaForCausalLM" else None)
    return ModelArgs(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden, intermediate_size=inner, num_layers=n,
        num_heads=1, num_kv_heads=1, head_dim=hidden, rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        # (no positions: a context of 16,384 tokens by default; a token rotary table, never read)
        rope=Rope(10_000.0, None, 2), max_position_embeddings=cfg.get("max_position_embeddings") or 16_384,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=False, o_bias=False,
        qk_norm=None, mlp_bias=False, layer_windows=(None,) * n, nope_layers=(True,) * n,
        linear_attn=mixer, linear_layers=(True,) * n, mixer_blocks=("mamba1",) * n)


@dataclass(frozen=True)
class Gemma4Args:
    """What Gemma 4 sets layer by layer, and what it adds to Gemma 3's block (actors/models/gemma4.py)."""
    head_dims: tuple[int, ...]  # each layer's head width (its global layers': global_head_dim)
    kv_heads: tuple[int, ...]
    values_are_keys: tuple[bool, ...]  # attention_k_eq_v's global layers: no v_proj, V is K's projection
    kv_source: tuple[int | None, ...]  # KV sharing: the earlier layer whose cache a layer reads (None: its own)
    mlp_widths: tuple[int, ...]  # (use_double_wide_mlp: twice as wide in the layers that share KV)
    ple_dim: int  # per-layer embeddings' width (hidden_size_per_layer_input; 0: none)
    ple_vocab: int
    experts: tuple[int, int, int] | None  # (experts, top k, width) of the MoE block beside each MLP


def gemma4_args(cfg: dict) -> ModelArgs:
    """Gemma 4 as transformers' config class completes it (actors/worker/checkpoint_files.py):
    Gemma 3's sandwich norms (plain weights, not 1 + w) with q, k and weightless v norms and no
    score scale; sliding layers of head_dim on their own rotary, global ones of per_layer_config's
    wider heads (fewer KV heads where keys are values) on the proportional rotary; the last
    num_kv_shared_layers layers reading the cache of the last earlier layer of their kind;
    per-layer embeddings; an MoE block beside each MLP; a final logit soft-cap."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention 'all' (an encoder) is not supported")
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    types = cfg["layer_types"]
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    head_dim = cfg.get("head_dim") or hidden // heads
    dims = tuple(per_layer.get(i, {}).get("head_dim", head_dim) for i in range(n))
    kv = tuple(per_layer.get(i, {}).get("num_key_value_heads", cfg["num_key_value_heads"]) for i in range(n))
    first_shared = n - (cfg.get("num_kv_shared_layers") or 0)
    source = tuple(None if i < first_shared else max(j for j in range(first_shared) if types[j] == types[i])
                   for i in range(n))
    double = bool(cfg.get("use_double_wide_mlp"))
    global_dim = next((dims[i] for i in range(n) if types[i] == "full_attention"), head_dim)
    params = cfg["rope_parameters"]
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    full_type = full.get("rope_type", "default")
    if full_type not in ("default", "proportional") or sliding.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 4 with rope types {full_type!r} / {sliding.get('rope_type')!r} is not supported")
    gemma4 = Gemma4Args(
        head_dims=dims, kv_heads=kv,
        values_are_keys=tuple(bool(cfg.get("attention_k_eq_v")) and t == "full_attention" for t in types),
        kv_source=source,
        mlp_widths=tuple(cfg["intermediate_size"] * (2 if double and i >= first_shared else 1) for i in range(n)),
        ple_dim=cfg.get("hidden_size_per_layer_input") or 0, ple_vocab=cfg.get("vocab_size_per_layer_input") or 0,
        experts=((cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"])
                 if cfg.get("enable_moe_block") else None))
    window = cfg.get("sliding_window")
    return ModelArgs(
        architecture=GEMMA4, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=heads, num_kv_heads=kv[0],
        head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=Rope(float(full.get("rope_theta", 1_000_000.0)), full if full_type == "proportional" else None,
                  global_dim),
        local_rope=Rope(float(sliding.get("rope_theta", 10_000.0)), None, head_dim),
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias")), o_bias=bool(cfg.get("attention_bias")), qk_norm="head",
        mlp_bias=False, layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attn_scale=1.0, final_softcap=cfg.get("final_logit_softcapping"), embed_scale=hidden ** 0.5,
        activation=gated_activation(cfg.get("hidden_activation") or "gelu_pytorch_tanh"), norms="sandwich",
        gemma4=gemma4)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def nope_layers(arch: str, cfg: dict) -> tuple[bool, ...]:
    """The layers without rotary: SmolLM3's, where `no_rope_layers` holds 0 (its default: every
    `no_rope_layer_interval`-th layer); EXAONE 4's global layers where its config has a window."""
    if arch == "Exaone4ForCausalLM":  # (as transformers: whenever the config names a window)
        return tuple(w is None for w in layer_windows(arch, cfg)) if cfg.get("sliding_window") else ()
    if arch == "GraniteMoeHybridForCausalLM":  # rotary only with position_embedding_type "rope" (4.0-H: none)
        return () if cfg.get("position_embedding_type") == "rope" else (True,) * cfg["num_hidden_layers"]
    if arch == "Cohere2ForCausalLM":  # rotary in its sliding layers only
        return tuple(w is None for w in layer_windows(arch, cfg))
    if arch == "Llama4ForCausalLM":  # no_rope_layers: 1 where a layer rotates (default: not every 4th)
        n = cfg["num_hidden_layers"]
        uses = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
        return tuple(not use for use in uses)
    if arch != "SmolLM3ForCausalLM":
        return ()
    n, every = cfg["num_hidden_layers"], cfg.get("no_rope_layer_interval", 4)
    uses = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    return tuple(not use for use in uses)


def mlp_width(arch: str, cfg: dict) -> int:
    """The dense MLP's width: GPT-J's n_inner (4 x hidden when unnamed), Llama 4's intermediate_size_mlp."""
    if arch == GPTJ:
        return cfg.get("n_inner") or 4 * cfg["hidden_size"]
    if arch == "Qwen3_5MoeForCausalLM":  # (no dense MLP: every layer is sparse)
        return cfg.get("intermediate_size") or cfg.get("moe_intermediate_size", 512)
    if arch == "GraniteMoeHybridForCausalLM" and not (cfg.get("num_local_experts") or 0):  # its shared MLP alone
        return cfg.get("shared_intermediate_size", 1024)
    if arch == "Lfm2ForCausalLM" and cfg.get("block_auto_adjust_ff_dim", True):  # as its MLP works it out
        width = int(2 * cfg["intermediate_size"] / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            multiple = cfg.get("block_multiple_of", 256)
            width = multiple * -(-int(cfg["block_ffn_dim_multiplier"] * width) // multiple)
        return width
    return cfg["intermediate_size_mlp" if arch == "Llama4ForCausalLM" else "intermediate_size"]


def norm_eps(arch: str, cfg: dict) -> float:
    """The norms' epsilon, under each family's name for it."""
    if arch in (*COHERE, "PhiForCausalLM", "StableLmForCausalLM", GPT_NEOX):
        return cfg.get("layer_norm_eps", 1e-5)
    if arch == "Starcoder2ForCausalLM":
        return cfg.get("norm_epsilon", 1e-5)
    if arch == GPTJ:
        return cfg.get("layer_norm_epsilon", 1e-5)
    if arch == "OlmoForCausalLM":
        return 1e-5  # (its LayerNorm's, fixed)
    if arch in ("NemotronForCausalLM", "Lfm2ForCausalLM"):
        return cfg.get("norm_eps", 1e-5)
    return cfg.get("rms_norm_eps", 1e-6)


def q_position_scale(arch: str, cfg: dict) -> tuple[float, int, int] | None:
    """Llama 4's NoPE layers' temperature tuning (attn_scale, floor_scale, shift 1) and Ministral
    3's (and Mistral 4's) llama_4_scaling_beta (over the rotary's original length, shift 0), as transformers applies
    them: queries times 1 + beta * log(1 + floor((position + shift) / span))."""
    if arch == "Llama4ForCausalLM" and cfg.get("attn_temperature_tuning", True):
        return float(cfg.get("attn_scale", 0.1)), int(cfg.get("floor_scale", 8192)), 1
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if arch in ("Ministral3ForCausalLM", "Mistral4ForCausalLM") and rope.get("llama_4_scaling_beta") is not None:
        return float(rope["llama_4_scaling_beta"]), int(rope["original_max_position_embeddings"]), 0
    return None


def _gemma_legacy_gelu(arch: str, name: str) -> str:
    """Gemma 1's releases say "gelu" and mean its tanh approximation (transformers reads it so)."""
    return "gelu_pytorch_tanh" if arch == "GemmaForCausalLM" and name == "gelu" else name


def gated_activation(name: str) -> str:
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"unsupported MLP activation {name!r}; supported: silu, gelu_pytorch_tanh")


def plain_activation(name: str) -> str:
    """The activation of an ungated MLP (StarCoder2's GELU, Arcee's and Nemotron's squared ReLU,
    Apertus's xIELU)."""
    found = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "gelu_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu", "relu2": "relu2", "xielu": "xielu"}.get(name)
    if found is None:
        raise ValueError(f"unsupported MLP activation {name!r}; supported: gelu_pytorch_tanh, gelu_new, gelu, relu, "
                         "relu2, xielu")
    return found


def layer_windows(arch: str, cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers reads the config: its `layer_types` where the
    config has them (transformers 5 writes them), else each family's rule for older configs."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if arch in (*QWEN_WINDOWS, "SmolLM3ForCausalLM") and not cfg.get("use_sliding_window"):
        window = None  # Qwen configs carry a window they don't use unless use_sliding_window is set
    if not window:
        return (None,) * n
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if arch == "Gemma2ForCausalLM":  # even layers slide
        return tuple(window if (i + 1) % 2 else None for i in range(n))
    if arch in ("Gemma3ForCausalLM", "Olmo3ForCausalLM", "Cohere2ForCausalLM"):  # five (OLMo 3, Cohere 2: three)
        pattern = cfg.get("sliding_window_pattern", 6 if arch == "Gemma3ForCausalLM" else 4)  # local, one global
        return tuple(window if (i + 1) % pattern else None for i in range(n))
    if arch in QWEN_WINDOWS:  # the layers from max_window_layers on
        return tuple(window if i >= cfg.get("max_window_layers", n) else None for i in range(n))
    return (window,) * n  # Mistral, Mixtral, Phi-3: every layer


def ropes(arch: str, cfg: dict, head_dim: int) -> tuple[Rope, Rope | None]:
    """(the rotary embedding, Gemma 3's or OLMo 3's sliding layers' one or None), from transformers 5's rope_parameters
    (flat, or by layer type) or 4's rope_theta / rope_scaling / rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    by_type = "full_attention" in params
    glob = dict(params["full_attention"] if by_type else params or cfg.get("rope_scaling") or {})
    factor = (glob.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or cfg.get("rotary_pct")
              or (cfg["rotary_dim"] / head_dim if cfg.get("rotary_dim") else None)  # MiniMax-M2's releases
              or {"Glm4MoeForCausalLM": 0.5, "NemotronForCausalLM": 0.5, "PhiForCausalLM": 0.5,
                  "StableLmForCausalLM": 0.25, GPT_NEOX: 0.25, **dict.fromkeys(QWEN_HYBRID, 0.25),
                  "BambaForCausalLM": 0.5}.get(arch, 1.0))
    dim = int(head_dim * factor)
    default_theta = {"Gemma3ForCausalLM": 1_000_000.0, "Lfm2ForCausalLM": 1_000_000.0, "Olmo3ForCausalLM": 500_000.0,
                     "MiniMaxM2ForCausalLM": 5_000_000.0, **dict.fromkeys(ERNIE, 500_000.0)}.get(arch, 10_000.0)
    theta = float(glob.pop("rope_theta", None) or cfg.get("rope_theta") or cfg.get("rotary_emb_base") or default_theta)
    kind = glob.get("rope_type", glob.get("type", "default"))
    if kind == "dynamic" and glob.get("alpha"):  # HunYuan's NTK alpha: a fixed, larger base
        theta *= float(glob["alpha"]) ** (dim / (dim - 2))
        kind = "default"
    if kind in ("longrope", "su"):  # Phi-3 (early configs said "su"); its lengths sit beside rope_scaling
        kind = glob["rope_type"] = "longrope"
        glob.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        glob["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    if kind == "yarn":  # as transformers standardises it: a top-level original length wins
        glob["rope_type"] = kind
        glob["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings")
                                                     or glob.get("original_max_position_embeddings")
                                                     or cfg.get("max_position_embeddings", 2048))
        glob["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    rope = Rope(theta, glob if kind != "default" else None, dim, interleaved=arch in INTERLEAVED_ROPE)
    if arch not in ("Gemma3ForCausalLM", "Olmo3ForCausalLM"):
        return rope, None
    # The sliding layers' own rotary: Gemma 3's local base (rope_local_base_freq), OLMo 3's
    # unscaled one (of a default base, 500,000, as transformers reads an older config).
    local = dict(params.get("sliding_attention") or {}) if by_type else {}
    local_default = (cfg.get("rope_local_base_freq") or 10_000.0) if arch == "Gemma3ForCausalLM" else default_theta
    local_theta = float(local.pop("rope_theta", None) or local_default)
    kind = local.get("rope_type", local.get("type", "default"))
    return rope, Rope(local_theta, local if kind != "default" else None, dim)
