"""Model definitions. Each architecture name maps to the class that implements it."""
from actors.models.llama import LlamaForCausalLM
from actors.models.moe import MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
}


def model_class(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]
