"""Ray Serve LLM's `llm_configs` shape read as shoal options (app/serving/ray_llm_config.py);
tests/test_serve_e2e.py runs serve_configs/ray-serve-llm.yaml with `serve run`."""
from pathlib import Path

import pytest
import yaml

from app.config import ConfigError
from app.serving.ray_llm_config import load_configs, model_args

REPO = Path(__file__).resolve().parent.parent


def config_of(llm_config: dict, **rest):
    [config] = load_configs({"llm_configs": [llm_config], **rest})
    return config


def test_the_shipped_example_maps_onto_shoal_options():
    args = yaml.safe_load((REPO / "serve_configs/ray-serve-llm.yaml").read_text())
    [config] = load_configs(args["applications"][0]["args"])
    assert config.server.served_model_name == "shoal-demo" and config.engine.model_path is None
    assert (config.engine.max_model_len, config.engine.max_num_seqs) == (1024, 64)
    assert (config.deploy.min_replicas, config.deploy.max_replicas) == (1, 1)
    assert config.engine.placement_strategy == "STRICT_PACK" and config.engine.shard_cpus == 1


def test_autoscaling_delays_reach_serves_autoscaling_config():
    from app.serving.builder import replica_options
    config = config_of({"deployment_config": {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 2, "downscale_delay_s": 60,
        "look_back_period_s": 5}}})
    assert replica_options(config)["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 64.0, "upscale_delay_s": 2,
        "downscale_delay_s": 60, "look_back_period_s": 5}
    assert "upscale_delay_s" not in replica_options(config_of({"deployment_config": {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 3}}}))["autoscaling_config"]  # Serve's own defaults


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
    ({"engine_kwargs": {"enable_sleep_mode": True}}, "engine_kwargs.enable_sleep_mode is not supported"),
    ({"deployment_config": {"ray_actor_options": {}}}, "deployment_config.ray_actor_options"),
    ({"deployment_config": {"autoscaling_config": {"metrics_interval_s": 1}}}, "autoscaling_config.metrics_interval_s"),
    ({"model_loading_config": {"model_source": {"bucket_uri": "s3://x"}}}, "not a bucket"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}] * 2}}, "2 bundles, but"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}, {"CPU": 1}]}}, "make them equal"),
    ({"llm_engine": "SGLang"}, "llm_engine"),
])
def test_what_shoal_lacks_is_refused_by_name_in_one_line(llm_config, says):
    with pytest.raises(ConfigError) as info:
        config_of(llm_config)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_several_models_share_the_options_outside_llm_configs(tmp_path, llama_ckpt):
    """A chat model next to an embedding model: one config each, the options outside
    llm_configs given to both, errors naming the entry."""
    chat, embed = load_configs({"llm_configs": [
        {"model_loading_config": {"model_id": "chat", "model_source": str(llama_ckpt)},
         "engine_kwargs": {"max_model_len": 512}},
        {"model_loading_config": {"model_id": "embed", "model_source": str(tmp_path)},
         "deployment_config": {"num_replicas": 2}}], "replica_cpus": 0.25})
    assert (chat.server.served_model_name, embed.server.served_model_name) == ("chat", "embed")
    assert (chat.engine.model_path, embed.engine.model_path) == (str(llama_ckpt), str(tmp_path))
    assert (chat.engine.max_model_len, embed.engine.max_model_len) == (512, None)
    assert (chat.deploy.num_replicas, embed.deploy.num_replicas) == (None, 2)
    assert chat.deploy.replica_cpus == embed.deploy.replica_cpus == 0.25
    with pytest.raises(ConfigError, match=r"llm_configs\[1\]\.engine_kwargs\.enable_sleep_mode"):
        model_args({"llm_configs": [{}, {"engine_kwargs": {"enable_sleep_mode": True}}]})
    with pytest.raises(ConfigError, match="two models are served as 'same'"):
        load_configs({"llm_configs": [{"model_loading_config": {"model_id": "same", "model_source": str(llama_ckpt)}}] * 2})


def test_no_option_twice_and_no_empty_list():
    with pytest.raises(ConfigError, match="one llm_config per model"):
        model_args({"llm_configs": []})
    with pytest.raises(ConfigError, match=r"tp_size is given both in llm_configs\[0\]"):
        model_args({"llm_configs": [{"engine_kwargs": {"tp": 2}}], "tensor_parallel_size": 2})
