"""Model definitions. Each architecture name maps to the class that implements it. The names
are known without importing torch (the `shoal serve` driver checks a checkpoint's before it
starts Ray); the classes are imported when one is asked for."""
from actors.models.args import (
    DEEPSEEK_ARCHS, DENSE_ARCHS, FALCON, GEMMA4, GPT_NEOX, GPT_OSS, GPTJ, HYBRID_ARCHS, IMAGE_TEXT_ARCHS,
    LEARNED_POSITIONS, MAMBA1, MOE_ARCHS,
)

ARCHITECTURES = (*DENSE_ARCHS, *MOE_ARCHS, *DEEPSEEK_ARCHS, GPT_OSS, *LEARNED_POSITIONS, FALCON, *HYBRID_ARCHS,
                 GEMMA4, *MAMBA1)


def check_architecture(architecture: str) -> None:
    """ValueError (one line) for an architecture shoal does not implement."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted([*ARCHITECTURES, *IMAGE_TEXT_ARCHS]))} "
                         "(the image-text ones for their text)")


def model_class(architecture: str):
    check_architecture(architecture)
    if architecture == GEMMA4:
        from actors.models.gemma4 import Gemma4ForCausalLM
        return Gemma4ForCausalLM
    if architecture in ("NemotronHForCausalLM", *MAMBA1):
        from actors.models.nemotron_h import NemotronHForCausalLM
        return NemotronHForCausalLM
    if architecture in HYBRID_ARCHS:
        from actors.models.hybrid import HybridForCausalLM, HybridMoeForCausalLM
        # (Granite 4.0-H: with or without experts, by its config)
        dense = architecture in ("Qwen3_5ForCausalLM", "Lfm2ForCausalLM", "BambaForCausalLM")
        return HybridForCausalLM if dense else HybridMoeForCausalLM
    if architecture in MOE_ARCHS:
        from actors.models.moe import MoeForCausalLM
        return MoeForCausalLM
    if architecture in DEEPSEEK_ARCHS:
        from actors.models.deepseek import DeepseekForCausalLM
        return DeepseekForCausalLM
    if architecture == GPT_OSS:
        from actors.models.gpt_oss import GptOssForCausalLM
        return GptOssForCausalLM
    if architecture in (*LEARNED_POSITIONS, GPTJ):
        from actors.models.gpt import GptForCausalLM
        return GptForCausalLM
    if architecture == GPT_NEOX:
        from actors.models.gpt import GptNeoXForCausalLM
        return GptNeoXForCausalLM
    if architecture == FALCON:
        from actors.models.gpt import FalconForCausalLM
        return FalconForCausalLM
    from actors.models.llama import LlamaForCausalLM
    return LlamaForCausalLM
