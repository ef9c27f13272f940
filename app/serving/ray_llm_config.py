"""Ray Serve LLM's `llm_configs` shape, read as shoal options.

A Ray Serve LLM app config switches to shoal by changing its import path to
`app.serving.builder:build_app` and keeping its `args:` (one entry per model: several models,
say a chat model and an embedding model, are served by one application, chosen by `model`):

    llm_configs:
      - model_loading_config: {model_id: NAME, model_source: PATH_OR_REPO}
        engine_kwargs: {tensor_parallel_size: 2, max_model_len: 8192, ...}  # vLLM's names
        deployment_config: {autoscaling_config: {min_replicas: 1, max_replicas: 4}}
        placement_group_config: {bundles: [{GPU: 1}, {GPU: 1}], strategy: STRICT_PACK}

What shoal supports maps onto its options (engine_kwargs through the one alias table in
app/config.py); anything else is refused by name in one line (ConfigError), never ignored.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from app.api.settings import DEMO_MODEL_NAME
from app.config import ConfigError, ShoalConfig, canonical, load_config, option_types

LLM_CONFIG_KEYS = {"model_loading_config", "engine_kwargs", "deployment_config",
                   "placement_group_config", "llm_engine"}
DEPLOYMENT_KEYS = {"num_replicas": "num_replicas", "max_ongoing_requests": "max_ongoing_requests"}
AUTOSCALING_KEYS = {"min_replicas": "min_replicas", "max_replicas": "max_replicas",
                    "target_ongoing_requests": "target_ongoing_requests", "upscale_delay_s": "upscale_delay_s",
                    "downscale_delay_s": "downscale_delay_s", "look_back_period_s": "look_back_period_s"}


def load_configs(args: dict) -> list[ShoalConfig]:
    """One ShoalConfig per model the application serves; their served names must differ."""
    configs = [load_config(a) for a in model_args(args)]
    names = [c.server.served_model_name for c in configs]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"llm_configs: two models are served as {twice!r}; give each its own "
                          "model_loading_config.model_id")
    return configs


def model_args(args: dict) -> list[dict]:
    """One set of shoal options per model the application serves: `args` itself, or with
    `llm_configs` each entry's options over the options outside it (shared by every model)."""
    if "llm_configs" not in args:
        return [args]
    rest = {k: v for k, v in args.items() if k != "llm_configs"}
    configs = args["llm_configs"]
    if not isinstance(configs, list) or not configs:
        raise ConfigError("llm_configs: give a list of one llm_config per model")
    out = []
    for i, config in enumerate(configs):
        options = llm_config_options(_load(config, i), i)
        clash = sorted({canonical(k) for k in options} & {canonical(k) for k in rest})
        if clash:
            raise ConfigError(f"{clash[0]} is given both in llm_configs[{i}] and as an option; keep one")
        out.append({**rest, **options})
    return out


def _load(config, i: int) -> dict:
    if isinstance(config, str):  # Ray Serve LLM also takes a path to a YAML file per model
        try:
            config = yaml.safe_load(Path(config).read_text())
        except (OSError, yaml.YAMLError) as exc:
            reason = str(exc).splitlines()[0]
            raise ConfigError(f"llm_configs: cannot read {config}: {reason}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"llm_configs[{i}] must be a mapping (or the path of a YAML file)")
    return config


def llm_config_options(config: dict, i: int) -> dict:
    where = f"llm_configs[{i}]"
    _refuse_unknown(where, config, LLM_CONFIG_KEYS)
    if config.get("llm_engine", "vLLM") != "vLLM":
        raise ConfigError(f"{where}.llm_engine: shoal is the engine; leave it out")
    engine = engine_options(config.get("engine_kwargs") or {}, where)
    placement, ranks = placement_options(config.get("placement_group_config") or {}, where)
    check_rank_count(ranks, engine, where)
    return {**model_options(config.get("model_loading_config") or {}, where), **engine,
            **deployment_options(config.get("deployment_config") or {}, where), **placement}


def model_options(loading: dict, where: str) -> dict:
    where += ".model_loading_config"
    _refuse_unknown(where, loading, {"model_id", "model_source"})
    model_id, source = loading.get("model_id"), loading.get("model_source")
    if source is not None and not isinstance(source, str):
        raise ConfigError(f"{where}.model_source: shoal loads a local directory or a repo id in "
                          "the local Hugging Face cache, not a bucket")
    options = {"served_model_name": model_id} if model_id else {}
    # As in Ray Serve LLM the source defaults to the id; the bundled model's name means itself.
    if source or (model_id and model_id != DEMO_MODEL_NAME):
        options["model_path"] = source or model_id
    return options


def engine_options(kwargs: dict, where: str) -> dict:
    known = option_types()
    for key in kwargs:
        if canonical(key) not in known:
            raise ConfigError(f"{where}.engine_kwargs.{key} is not supported by shoal "
                              "(see `shoal serve --help` for the options it has)")
    return dict(kwargs)  # load_config resolves the spellings and converts the values


def deployment_options(deployment: dict, where: str) -> dict:
    where += ".deployment_config"
    _refuse_unknown(where, deployment, set(DEPLOYMENT_KEYS) | {"autoscaling_config"})
    options = {DEPLOYMENT_KEYS[k]: v for k, v in deployment.items() if k in DEPLOYMENT_KEYS}
    autoscaling = deployment.get("autoscaling_config") or {}
    _refuse_unknown(f"{where}.autoscaling_config", autoscaling, set(AUTOSCALING_KEYS))
    options.update({AUTOSCALING_KEYS[k]: v for k, v in autoscaling.items()})
    return options


def placement_options(placement: dict, where: str) -> tuple[dict, int | None]:
    """(options, bundles per replica). shoal places one bundle per rank itself, so the
    bundles must be equal: they set each rank's CPUs and GPUs."""
    where += ".placement_group_config"
    _refuse_unknown(where, placement, {"bundles", "strategy"})
    options = {"placement_strategy": placement["strategy"]} if "strategy" in placement else {}
    bundles = placement.get("bundles") or []
    if not bundles:
        return options, None
    if any(b != bundles[0] for b in bundles):
        raise ConfigError(f"{where}.bundles: shoal gives every rank the same bundle; "
                          "make them equal")
    _refuse_unknown(f"{where}.bundles[0]", bundles[0], {"CPU", "GPU"})
    names = {"CPU": "shard_cpus", "GPU": "shard_gpus"}
    options.update({names[k]: v for k, v in bundles[0].items()})
    return options, len(bundles)


def check_rank_count(ranks: int | None, engine: dict, where: str) -> None:
    """Ray Serve LLM sizes a replica by its bundles: one per rank, tp x pp of them."""
    named = {canonical(k): v for k, v in engine.items()}
    tp, pp = int(named.get("tp_size", 1)), int(named.get("pp_size", 1))
    if ranks is not None and ranks != tp * pp:
        raise ConfigError(f"{where}.placement_group_config.bundles: {ranks} bundles, but "
                          f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}; give one "
                          "bundle per rank")


def _refuse_unknown(where: str, given: dict, allowed: set[str]) -> None:
    if not isinstance(given, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]} is not supported by shoal"
                          f" (supported here: {', '.join(sorted(allowed))})")
