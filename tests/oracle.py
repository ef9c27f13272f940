"""The correctness oracle: Hugging Face transformers in float32 on the same checkpoint.

shoal's greedy tokens and prompt log-probs must equal these. Models are loaded once per
path (lru_cache), so never rewrite a checkpoint directory in place within a test session.
"""
from __future__ import annotations

import copy
import functools
import pathlib

import torch


@functools.lru_cache(maxsize=16)
def _load(path: str):
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # eager attention: the plainest float32 reference (no fused-kernel rounding); an
    # image-text checkpoint (text prompts only) through its own class.
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((pathlib.Path(path) / "config.json").read_text())
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    if "vision_config" not in config and config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = getattr(transformers, config["architectures"][0])  # (Mistral 4: not in the causal-LM auto map)
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_model(path, adapter=None):
    """The cached transformers model for a checkpoint directory (with a PEFT LoRA adapter
    directory on top: transformers + peft, float32)."""
    if adapter is not None:
        from lora_adapters import peft_model
        return peft_model(path, adapter)
    return _load(str(pathlib.Path(path).resolve()))


@torch.inference_mode()
def hf_logits(path, ids: list[int], adapter=None) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one forward over `ids`."""
    model = hf_model(path, adapter)
    out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    return out.logits[0].float()


@torch.inference_mode()
def hf_hidden_states(path, ids: list[int]) -> torch.Tensor:
    """Float32 final hidden states [len(ids), hidden], after the final norm: what embeddings pool."""
    out = hf_model(path)(input_ids=torch.tensor([ids], dtype=torch.long), output_hidden_states=True)
    return out.hidden_states[-1][0].float()


def hf_prompt_logprobs(path, prompt_ids: list[int], adapter=None) -> list[float]:
    """log P(prompt_ids[i] | prompt_ids[:i]) for i >= 1 (len(prompt_ids) - 1 values)."""
    logprobs = torch.log_softmax(hf_logits(path, prompt_ids, adapter)[:-1], dim=-1)
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
    return logprobs.gather(1, targets[:, None])[:, 0].tolist()


@torch.inference_mode()
def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int,
              stop_at_eos: bool = False, adapter=None) -> list[int]:
    """Greedy new tokens from `model.generate`. With stop_at_eos=False exactly
    max_new_tokens come back (eos may appear and generation goes on, like ignore_eos)."""
    model = hf_model(path, adapter)
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.do_sample = False
    gen_config.max_new_tokens = max_new_tokens
    gen_config.min_new_tokens = None  # min_new_tokens would mask eos, changing argmax
    if not stop_at_eos:
        # None would be refilled from model.generation_config; an empty list means no eos.
        gen_config.eos_token_id = []
    if gen_config.pad_token_id is None:
        gen_config.pad_token_id = model.config.pad_token_id or 0
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         generation_config=gen_config)
    return out[0, len(prompt_ids):].tolist()


def assert_equals_eager_and_hf(path, prompts, got, want, max_tokens: int) -> None:
    """`got` (a captured / compiled decode path's RequestOutputs) against `want` (an eager
    engine's, same prompts and greedy params with logprobs): tokens equal both and
    transformers', log-probs equal the eager ones within 1e-4."""
    for g, w, ids in zip(got, want, prompts, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids == hf_greedy(path, ids, max_tokens)
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            assert max(abs(lg[t] - lw[t]) for t in lw) < 1e-4
