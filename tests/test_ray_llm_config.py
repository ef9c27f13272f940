"""Ray Serve LLM's `llm_configs` shape read as shoal options (app/serving/ray_llm_config.py);
tests/test_serve_e2e.py runs serve_configs/ray-serve-llm.yaml with `serve run`."""
from pathlib import Path

import pytest
import yaml

from app.config import ConfigError, load_config
from app.serving.ray_llm_config import from_llm_configs

REPO = Path(__file__).resolve().parent.parent


def config_of(llm_config: dict, **rest):
    return load_config(from_llm_configs({"llm_configs": [llm_config], **rest}))


def test_the_shipped_example_maps_onto_shoal_options():
    args = yaml.safe_load((REPO / "serve_configs/ray-serve-llm.yaml").read_text())
    config = load_config(from_llm_configs(args["applications"][0]["args"]))
    assert config.server.served_model_name == "shoal-demo" and config.engine.model_path is None
    assert (config.engine.max_model_len, config.engine.max_num_seqs) == (1024, 64)
    assert (config.deploy.min_replicas, config.deploy.max_replicas) == (1, 1)
    assert config.engine.placement_strategy == "STRICT_PACK" and config.engine.shard_cpus == 1


def test_vllm_names_and_serve_options_map(tmp_path):
    config = config_of({
        "model_loading_config": {"model_id": "qwen", "model_source": str(tmp_path)},
        "engine_kwargs": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
                          "enforce_eager": True, "num_gpu_blocks_override": 64},
        "deployment_config": {"num_replicas": 3, "max_ongoing_requests": 9},
        "placement_group_config": {"bundles": [{"CPU": 2, "GPU": 1}] * 2}})
    e, d = config.engine, config.deploy
    assert config.server.served_model_name == "qwen" and e.model_path == str(tmp_path)
    assert (e.tp_size, e.gpu_memory_utilization, e.num_kv_blocks, e.eager_decode) == (2, 0.5, 64, True)
    assert (d.num_replicas, d.max_ongoing_requests) == (3, 9)
    assert (e.shard_cpus, e.shard_gpus) == (2, 1)
    assert config_of({"model_loading_config": {"model_id": "org/repo"}}).engine.model_path == "org/repo"


@pytest.mark.parametrize("llm_config, says", [
    ({"accelerator_type": "A10G"}, "llm_configs[0].accelerator_type is not supported"),
    ({"engine_kwargs": {"trust_remote_code": True}}, "engine_kwargs.trust_remote_code is not supported"),
    ({"deployment_config": {"ray_actor_options": {}}}, "deployment_config.ray_actor_options"),
    ({"deployment_config": {"autoscaling_config": {"upscale_delay_s": 1}}}, "autoscaling_config.upscale_delay_s"),
    ({"model_loading_config": {"model_source": {"bucket_uri": "s3://x"}}}, "not a bucket"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}] * 2}}, "2 bundles, but"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}, {"CPU": 1}]}}, "make them equal"),
    ({"llm_engine": "SGLang"}, "llm_engine"),
])
def test_what_shoal_lacks_is_refused_by_name_in_one_line(llm_config, says):
    with pytest.raises(ConfigError) as info:
        config_of(llm_config)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_one_model_per_application_and_no_option_twice():
    with pytest.raises(ConfigError, match="exactly one llm_config"):
        from_llm_configs({"llm_configs": [{}, {}]})
    with pytest.raises(ConfigError, match="tp_size is given both"):
        from_llm_configs({"llm_configs": [{"engine_kwargs": {"tp": 2}}], "tensor_parallel_size": 2})
