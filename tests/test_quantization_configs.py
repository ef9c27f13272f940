"""Real releases' quantization settings, verbatim (config.json's quantization_config, or the
legacy quantize_config.json / quant_config.json / hf_quant_config.json beside it), each with
what shoal makes of it: the format its readers take (bits, group size, sym, GPTQ's zero offset;
int8 scheme; FP8 block; NVFP4 / MXFP4), or a one-line refusal naming why. No model loads: the
loading tests of each format are in test_int4_checkpoints.py, test_int8_checkpoints.py,
test_quantization.py and test_nvfp4_checkpoints.py.

`source` names the release (or the public code quoting it) each block stands for. Most are pasted
as published; LLM Compressor's are built by `ct` with every field its writer spells out (one
group over Linear), and long module lists are cut short."""
from __future__ import annotations

import json
import re

import pytest

from actors.worker import fp8_checkpoint, int4_checkpoint, int8_checkpoint, mxfp4_checkpoint, nvfp4_checkpoint
from actors.worker import quantization_config
from actors.worker.checkpoint_files import read_config

null, true, false = None, True, False  # (the blocks below are JSON, pasted as published)

# -- GPTQ -----------------------------------------------------------------------------------
THEBLOKE_GPTQ_FILE = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": false, "static_groups": false,
                      "sym": true, "true_sequential": true, "model_name_or_path": null,
                      "model_file_base_name": "model"}
THEBLOKE_GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": true, "sym": true,
                 "true_sequential": true, "model_name_or_path": null, "model_file_base_name": "model",
                 "quant_method": "gptq"}
OPTIMUM_GPTQ = {"batch_size": 1, "bits": 4, "block_name_to_quantize": null, "cache_block_outputs": true,
                "damp_percent": 0.01, "dataset": null, "desc_act": false, "exllama_config": {"version": 1},
                "group_size": 128, "max_input_length": null, "model_seqlen": null,
                "module_name_preceding_first_block": null, "modules_in_block_to_quantize": null,
                "pad_token_id": null, "quant_method": "gptq", "sym": true, "tokenizer": null,
                "true_sequential": true, "use_cuda_fp16": false, "use_exllama": true}
GPTQMODEL = {"bits": 8, "checkpoint_format": "gptq", "desc_act": false, "group_size": 128, "lm_head": false,
             "meta": {"damp_auto_increment": 0.0025, "damp_percent": 0.01, "mse": 0.0,
                      "quantizer": ["gptqmodel:2.2.0"], "static_groups": false, "true_sequential": true,
                      "uri": "https://github.com/modelcloud/gptqmodel"},
             "pack_dtype": "int32", "quant_method": "gptq", "sym": true}
# GPTQModel's README: `dynamic` overrides per module ("+:" or bare: other settings, "-:": left float)
GPTQMODEL_DYNAMIC = {r"+:.*\.18\..*gate.*": {"bits": 4, "group_size": 32},
                     r".*\.19\..*gate.*": {"bits": 8, "group_size": 64},
                     r"-:.*\.20\..*gate.*": {}, r"-:.*down.*": {}}

# -- AWQ ------------------------------------------------------------------------------------
AUTOAWQ_FILE = {"zero_point": true, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": null, "quant_method": "awq", "version": "gemm",
       "zero_point": true}

# -- compressed-tensors ---------------------------------------------------------------------


def ct(weights: dict, inputs: dict | None, fmt: str, **top) -> dict:
    """An LLM Compressor config as it writes one: one group over Linear, every field spelled out."""
    base = {"actorder": null, "block_structure": null, "dynamic": false, "group_size": null, "observer": "minmax",
            "observer_kwargs": {}, "symmetric": true}
    group = {"input_activations": inputs and {**base, "observer": null, **inputs}, "output_activations": null,
             "targets": ["Linear"], "weights": {**base, **weights}}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": null,
            "ignore": ["lm_head"], "kv_cache_scheme": null, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.10.2",
            **top}


FP8_DYNAMIC = ct({"num_bits": 8, "strategy": "channel", "type": "float"},
                 {"dynamic": true, "num_bits": 8, "strategy": "token", "type": "float"}, "float-quantized")
FP8_STATIC_KV = ct({"num_bits": 8, "strategy": "tensor", "type": "float"},
                   {"num_bits": 8, "strategy": "tensor", "type": "float"}, "float-quantized",
                   kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false,
                                    "symmetric": true})
FP8_BLOCK = ct({"num_bits": 8, "strategy": "block", "block_structure": [128, 128], "type": "float"},
               {"dynamic": true, "num_bits": 8, "strategy": "group", "group_size": 128, "type": "float"},
               "float-quantized")
W8A8 = ct({"num_bits": 8, "strategy": "channel", "type": "int"},
          {"dynamic": true, "num_bits": 8, "strategy": "token", "type": "int", "observer": "memoryless"},
          "int-quantized")
W4A16 = ct({"num_bits": 4, "strategy": "group", "group_size": 128, "type": "int"}, None, "pack-quantized")


def w4a16(**weights) -> dict:
    q = json.loads(json.dumps(W4A16))
    q["config_groups"]["group_0"]["weights"].update(weights)
    return q


LLAMA4_FP8 = ct({"num_bits": 8, "strategy": "channel", "type": "float"},
                {"dynamic": true, "num_bits": 8, "strategy": "token", "type": "float"}, "float-quantized",
                ignore=["re:.*self_attn", "re:.*router", "re:.*vision_model", "re:.*multi_modal_projector",
                        "re:.*shared_expert", "lm_head"])
# transformers' docs (docs/source/en/quantization/compressed_tensors.md) on nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf
NAIVE_FP8 = {"config_groups": {"group_0": {"input_activations": {"num_bits": 8, "strategy": "tensor", "type": "float"},
                                           "targets": ["Linear"],
                                           "weights": {"num_bits": 8, "strategy": "tensor", "type": "float"}}},
             "format": "naive-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors",
             "quantization_status": "frozen"}
# an llm-compressor issue (vllm-project/llm-compressor#1914): a Qwen3-VL-MoE W8A16 release, groups of 32
QWEN3_VL_W8 = {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": null,
                                             "output_activations": null, "targets": ["Linear"],
                                             "weights": {"actorder": null, "block_structure": null, "dynamic": false,
                                                         "group_size": 32, "num_bits": 8, "observer": "mse",
                                                         "observer_kwargs": {}, "strategy": "group",
                                                         "symmetric": true, "type": "int"}}},
               "format": "pack-quantized", "global_compression_ratio": null,
               "ignore": ["model.visual.blocks.0.attn.qkv", "lm_head"], "kv_cache_scheme": null,
               "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
               "transform_config": {}, "version": "0.12.2"}
SPARSE_24 = {**FP8_DYNAMIC, "sparsity_config": {"format": "sparse-24-bitmask", "global_sparsity": 0.45,
                                                "ignore": ["lm_head"], "registry_requires_subclass": false,
                                                "sparsity_structure": "2:4", "targets": ["Linear"]}}

# -- FP8 (transformers / DeepSeek / Meta / Mistral / AutoFP8) --------------------------------
DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
MISTRAL_FP8 = {"activation_scheme": "static", "dequantize": false,
               "modules_to_not_convert": ["model.vision_tower", "model.multi_modal_projector", "lm_head"],
               "quant_method": "fp8", "weight_block_size": null}
LLAMA31_FP8 = {"activation_scale_ub": 1200.0,
               "modules_to_not_convert": ["model.layers.0.mlp.down_proj", "model.layers.125.mlp.down_proj",
                                          "lm_head"],
               "quant_method": "fbgemm_fp8"}

# -- ModelOpt (hf_quant_config.json) ----------------------------------------------------------
MODELOPT_FP8_FILE = {"producer": {"name": "modelopt", "version": "0.17.0"},
                     "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                      "exclude_modules": ["lm_head"]}}
MODELOPT_NVFP4_FILE = {"producer": {"name": "modelopt", "version": "0.23.0"},
                       "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                                        "exclude_modules": ["lm_head", "model.layers.0.self_attn*"]}}

BNB_4BIT = {"_load_in_4bit": true, "_load_in_8bit": false, "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
            "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false,
            "llm_int8_skip_modules": null, "llm_int8_threshold": 6.0, "load_in_4bit": true, "load_in_8bit": false,
            "quant_method": "bitsandbytes"}

GPTQ4, GPTQ8 = ("int4", "gptq", 4, 128, True, 1), ("int4", "gptq", 8, 128, True, 1)
AWQ4 = ("int4", "awq", 4, 128, False, 0)

# (release or repository it is read from, its files {name: JSON}, what shoal makes of it)
CASES = [
    ("TheBloke/Llama-2-7B-GPTQ quantize_config.json (AutoGPTQ)", {"quantize_config.json": THEBLOKE_GPTQ_FILE}, GPTQ4),
    ("TheBloke/Mistral-7B-Instruct-v0.2-GPTQ config.json (act-order)", {"qc": THEBLOKE_GPTQ}, GPTQ4),
    ("TheBloke/Llama-2-7B-GPTQ branch gptq-3bit-128g-actorder_True",
     {"qc": {**THEBLOKE_GPTQ, "bits": 3}}, ("refused", r"GPTQ checkpoint with bits 3")),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 (optimum)", {"qc": OPTIMUM_GPTQ}, GPTQ4),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8 (optimum)", {"qc": {**OPTIMUM_GPTQ, "bits": 8}}, GPTQ8),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4", {"qc": {**OPTIMUM_GPTQ, "damp_percent": 0.1,
                                                                    "desc_act": true}}, GPTQ4),
    ("Qwen/Qwen3-0.6B-GPTQ-Int8 (GPTQModel: meta, pack_dtype)", {"qc": GPTQMODEL}, GPTQ8),
    ("sgl-project/sglang test/srt/quant (GPTQModel quantize_config.json, dynamic {})",
     {"quantize_config.json": {"bits": 4, "group_size": 128, "desc_act": false, "lm_head": false, "dynamic": {},
                               "checkpoint_format": "gptq", "true_sequential": true, "static_groups": false}}, GPTQ4),
    ("GPTQModel v2 config (meta.quantizer gptqmodel:2.0.0, desc_act)",
     {"qc": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": true, "desc_act": true,
             "checkpoint_format": "gptq", "meta": {"quantizer": ["gptqmodel:2.0.0"]}}}, GPTQ4),
    ("GPTQModel gptq_v2 checkpoint_format", {"qc": {**GPTQMODEL, "bits": 4, "checkpoint_format": "gptq_v2"}},
     ("int4", "gptq", 4, 128, True, 0)),
    ("GPTQModel README dynamic: modules left float only",
     {"qc": {**GPTQMODEL, "bits": 4, "dynamic": {k: v for k, v in GPTQMODEL_DYNAMIC.items() if k[0] == "-"}}}, GPTQ4),
    ("GPTQModel README dynamic: other bits per module", {"qc": {**GPTQMODEL, "bits": 4, "dynamic": GPTQMODEL_DYNAMIC}},
     ("refused", r"`dynamic` gives .* bits/group_size/sym \(4, 32, True\)")),
    ("GPTQModel pack_dtype int16", {"qc": {**GPTQMODEL, "pack_dtype": "int16"}}, ("refused", r"pack_dtype 'int16'")),
    ("AutoGPTQ 0.7 marlin-serialized quantize_config.json",
     {"quantize_config.json": {**THEBLOKE_GPTQ_FILE, "is_marlin_format": true, "quant_method": "gptq"}},
     ("refused", r"checkpoint_format 'marlin'")),
    ("quant_method spelled upper-case (vLLM lower-cases it)", {"qc": {**OPTIMUM_GPTQ, "quant_method": "GPTQ"}}, GPTQ4),
    ("TheBloke/Mistral-7B-Instruct-v0.2-AWQ quant_config.json (AutoAWQ)", {"quant_config.json": AUTOAWQ_FILE}, AWQ4),
    ("TheBloke/Mistral-7B-Instruct-v0.2-AWQ config.json",
     {"qc": {"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm", "zero_point": true}}, AWQ4),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", {"qc": AWQ}, AWQ4),
    ("Qwen/Qwen3-8B-AWQ", {"qc": AWQ}, AWQ4),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", {"qc": AWQ}, AWQ4),
    ("casperhansen/mixtral-instruct-awq (router left float)", {"qc": {**AWQ, "modules_to_not_convert": ["gate"]}},
     AWQ4),
    ("AutoAWQ GEMV release quant_config.json", {"quant_config.json": {**AUTOAWQ_FILE, "version": "GEMV"}},
     ("refused", r"AWQ version 'gemv'")),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", {"qc": FP8_DYNAMIC}, ("fp8", None)),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8 (static scales, FP8 KV cache scheme)", {"qc": FP8_STATIC_KV},
     ("fp8", None)),
    ("RedHatAI/Qwen3-8B-FP8-block (FP8_BLOCK)", {"qc": FP8_BLOCK}, ("fp8", (128, 128))),
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8 (re: ignores)", {"qc": LLAMA4_FP8}, ("fp8", None)),
    ("nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf (naive-quantized float8)", {"qc": NAIVE_FP8}, ("fp8", None)),
    ("neuralmagic FP8 release under compression_config (compressed-tensors 0.4)",
     {"config.json": {"compression_config": NAIVE_FP8}}, ("fp8", None)),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", {"qc": W8A8}, ("int8", "w8a8_int8", False)),
    ("deepseek int8 converter (quantization_status frozen)", {"qc": {**W8A8, "quantization_status": "frozen",
                                                                      "ignore": ["lm_head", "embed_tokens"]}},
     ("int8", "w8a8_int8", False)),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", {"qc": W4A16}, ("int4", "compressed-tensors", 4, 128,
                                                                             True, 0)),
    ("RedHatAI w4a16, actorder group", {"qc": w4a16(actorder="group")},
     ("int4", "compressed-tensors", 4, 128, True, 0)),
    ("RedHatAI w4a16, actorder weight", {"qc": w4a16(actorder="weight")},
     ("int4", "compressed-tensors", 4, 128, True, 0)),
    ("Qwen3-VL-MoE W8A16, groups of 32 (llm-compressor#1914)", {"qc": QWEN3_VL_W8},
     ("int4", "compressed-tensors", 8, 32, True, 0)),
    ("RedHatAI/Sparse-Llama-3.1-8B-2of4-FP8-dynamic (2:4 bitmask)", {"qc": SPARSE_24},
     ("refused", r"sparsity_config format 'sparse-24-bitmask'")),
    ("compressed-tensors with a SpinQuant transform_config",
     {"qc": {**W4A16, "transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": []}}}}},
     ("refused", r"transform_config")),
    ("deepseek-ai/DeepSeek-V3 (as sglang's DeepSeek docs quote it)", {"qc": DEEPSEEK_V3},
     ("fp8", (128, 128))),
    ("Qwen/Qwen3-8B-FP8", {"qc": DEEPSEEK_V3}, ("fp8", (128, 128))),
    ("deepseek-ai/DeepSeek-V3.1 (scale_fmt ue8m0)", {"qc": {**DEEPSEEK_V3, "scale_fmt": "ue8m0"}}, ("fp8", (128, 128))),
    ("transformers 5 re-save of an FP8 release", {"qc": {"activation_scheme": "dynamic", "dequantize": false,
                                                        "modules_to_not_convert": null, "quant_method": "fp8",
                                                        "scale_fmt": "float", "weight_block_size": [128, 128]}},
     ("fp8", (128, 128))),
    ("mistralai Ministral 3 / Devstral FP8 (static, per tensor)", {"qc": MISTRAL_FP8}, ("fp8", None)),
    ("neuralmagic/Meta-Llama-3-8B-Instruct-FP8 (AutoFP8)",
     {"qc": {"activation_scheme": "static", "ignored_layers": ["lm_head"], "quant_method": "fp8"}}, ("fp8", None)),
    ("meta-llama/Llama-3.1-405B-Instruct-FP8 (fbgemm_fp8)", {"qc": LLAMA31_FP8}, ("fp8", None)),
    ("nvidia/Llama-3.1-8B-Instruct-FP8 hf_quant_config.json", {"hf_quant_config.json": MODELOPT_FP8_FILE},
     ("fp8", None)),
    ("nvidia/DeepSeek-R1-FP4 hf_quant_config.json", {"hf_quant_config.json": MODELOPT_NVFP4_FILE},
     ("nvfp4", "modelopt")),
    ("ModelOpt W4A8_AWQ", {"hf_quant_config.json": {**MODELOPT_FP8_FILE, "quantization": {"quant_algo": "W4A8_AWQ"}}},
     ("refused", r"ModelOpt W4A8_AWQ checkpoints are not supported")),
    ("openai/gpt-oss-20b (mxfp4)", {"qc": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                      "model.layers.*.mlp.router",
                                                                      "model.embed_tokens", "lm_head"],
                                           "quant_method": "mxfp4"}}, ("mxfp4",)),
    ("unsloth/llama-3-8b-bnb-4bit (bitsandbytes)", {"qc": BNB_4BIT}, ("refused", r"'bitsandbytes' checkpoints")),
    ("bitsandbytes 8-bit", {"qc": {"llm_int8_threshold": 6.0, "load_in_8bit": true, "quant_method": "bitsandbytes"}},
     ("refused", r"'bitsandbytes' checkpoints")),
    ("Intel AutoRound (tensorfold tests)", {"qc": {"quant_method": "auto-round", "packing_format":
                                                   "auto_round:auto_gptq", "bits": 4, "group_size": 128,
                                                   "sym": true, "data_type": "int"}},
     ("refused", r"'auto-round' checkpoints")),
]


def verdict(path) -> tuple:
    """What shoal makes of a checkpoint directory's settings, as the engine reads them."""
    cfg = read_config(path)
    try:
        quantization_config.check(cfg)
        int4, int8 = int4_checkpoint.read_format(cfg), int8_checkpoint.scheme(cfg)
        block, nvfp4 = fp8_checkpoint.block_size(cfg), nvfp4_checkpoint.read_layout(cfg)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return "refused", str(exc)
    if int4:
        return "int4", int4.method, int4.bits, int4.group_size, int4.sym, int4.zero_offset
    if int8:
        return "int8", int8.kind, int8.static_activations
    if nvfp4:
        return "nvfp4", nvfp4.writer
    if mxfp4_checkpoint.is_mxfp4(cfg):
        return ("mxfp4",)
    method = quantization_config.settings(cfg).get("quant_method")
    return ("fp8", block) if method else ("float",)


@pytest.mark.parametrize("source,files,expected", CASES, ids=[c[0] for c in CASES])
def test_real_quantization_settings_read_as_published(source, files, expected, tmp_path):
    """Every release's settings give its format, or one line naming what shoal cannot read."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for name, body in files.items():
        if name == "qc":
            config["quantization_config"] = body
        elif name == "config.json":
            config.update(body)
        else:
            (tmp_path / name).write_text(json.dumps(body))
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = verdict(tmp_path)
    if expected[0] == "refused":
        assert got[0] == "refused", got
        assert re.search(expected[1], got[1]), got[1]
    else:
        assert got == expected


def test_there_are_thirty_real_releases_or_more():
    assert len(CASES) >= 30
