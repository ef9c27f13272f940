"""Model definitions. Each architecture name maps to the class that implements it."""
from actors.models.args import DEEPSEEK_ARCHS, DENSE_ARCHS, GPT_OSS, MOE_ARCHS
from actors.models.deepseek import DeepseekForCausalLM
from actors.models.gpt_oss import GptOssForCausalLM
from actors.models.llama import LlamaForCausalLM
from actors.models.moe import MoeForCausalLM

MODEL_REGISTRY = {**{arch: LlamaForCausalLM for arch in DENSE_ARCHS}, **{arch: MoeForCausalLM for arch in MOE_ARCHS},
                  **{arch: DeepseekForCausalLM for arch in DEEPSEEK_ARCHS}, GPT_OSS: GptOssForCausalLM}


def model_class(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]
