"""Every engine option is checked before anything starts, with one line naming it."""
import pytest

from app.config import ConfigError, load_config

BAD = {
    "kv_cache_fraction": (0, "--kv-cache-fraction must be in \\(0, 1\\]"),
    "kv_cache_memory": (-1, "--kv-cache-memory must be a positive"),
    "max_num_seqs": (0, "--max-num-seqs must be at least 1"),
    "max_model_len": (0, "--max-model-len must be at least 1"),
    "max_queued_requests": (0, "--max-queued-requests must be at least 1"),
    "num_threads": (0, "--num-threads must be at least 1"),
    "dist_timeout": (0, "--dist-timeout must be positive"),
    "watchdog_timeout": (-1, "--watchdog-timeout must be >= 0"),
    "itl_target_ms": (-5, "--itl-target-ms must be >= 0"),
    "attn_backend": ("fast", "--attn-backend must be auto, native, flash or triton"),
    "gpu_memory_utilization": (1.5, "--gpu-memory-utilization must be in \\(0, 1\\]"),
    "cuda_graph_sizes": ("0,8", "--cuda-graph-sizes must be positive batch sizes"),
    "max_seq_len_to_capture": (0, "--max-seq-len-to-capture must be at least 1"),
    "metrics_ttft_buckets": ("0.5,0.1", "must be increasing positive numbers"),
    "quantization": ("bitsandbytes", "--quantization must be one of int8, fp8, w8a8_int8, gptq, gptq_marlin, awq"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_engine_option_is_one_clear_line(name):
    value, message = BAD[name]
    with pytest.raises(ConfigError, match=message) as error:
        load_config({name: value}, environ={})
    assert "\n" not in str(error.value)


def test_serve_layout_is_merged_unless_a_separate_ingress_is_needed():
    from app.config import split_layout

    def split(**options) -> bool:
        return split_layout(load_config(options, environ={}))

    assert not split()  # each model replica is its own HTTP ingress
    assert split(routing="prefix-aware") and split(ingress_replicas=2)  # a router before the replicas
    assert split(serve_layout="split") and not split(serve_layout="merged")
    for bad in ({"serve_layout": "merged", "routing": "prefix-aware"},
                {"serve_layout": "merged", "ingress_replicas": 2}):
        with pytest.raises(ConfigError, match="need --serve-layout split"):
            load_config(bad, environ={})
    with pytest.raises(ConfigError, match="--serve-layout must be merged or split"):
        load_config({"serve_layout": "both"}, environ={})


def test_speculative_config_from_yaml_environment_and_command_line(tmp_path):
    """vLLM's JSON object from every source: a mapping in YAML, JSON text elsewhere."""
    config = tmp_path / "serve.yaml"
    config.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    engine = load_config({"config": str(config)}, environ={}).engine
    assert engine.speculative.num_speculative_tokens == 2 and engine.speculative.prompt_lookup_max == 5
    env = {"SHOAL_SPECULATIVE_CONFIG": '{"method": "ngram", "prompt_lookup_max": 3}'}
    assert load_config({"config": str(config)}, environ=env).engine.speculative.prompt_lookup_min == 3
    got = load_config({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 6}'}, environ=env)
    assert got.engine.speculative.num_speculative_tokens == 6  # the command line wins
    for bad, why in [("ngram", "is not a valid JSON object"), ('{"method": "ngram", "num_speculative_tokens": -1}',
                                                                "num_speculative_tokens must be a positive integer")]:
        with pytest.raises(ConfigError, match=why):
            load_config({"speculative_config": bad}, environ={})


@pytest.mark.parametrize("name", ["gptq_marlin", "awq", "compressed-tensors", "w8a8_int8"])
def test_vllms_quantization_names_are_taken(name):
    """vLLM's --quantization values that name a checkpoint's format (model cards' commands carry
    them) are accepted; resolve_model checks them against the checkpoint (test_int4_checkpoints)."""
    import argparse

    from app.cli.engine_args import add_engine_args

    assert load_config({"quantization": name}, environ={}).engine.quantization == name
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--quantization", name]).quantization == name


@pytest.mark.parametrize("name,value,message", [
    ("upscale_delay_s", -1, "--upscale-delay-s must be >= 0, got -1"),
    ("downscale_delay_s", -0.5, "--downscale-delay-s must be >= 0, got -0.5"),
    ("look_back_period_s", 0, "--look-back-period-s must be positive, got 0"),
])
def test_bad_autoscaling_timing_is_one_clear_line(name, value, message):
    """Checked here, not left to Serve's pydantic error when the application deploys."""
    with pytest.raises(ConfigError, match=message):
        load_config({"max_replicas": 2, name: value}, environ={})
    assert load_config({"max_replicas": 2, name: 3}, environ={}).deploy.__dict__[name] == 3
