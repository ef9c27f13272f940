"""The application `serve run` imports: `import_path: app.serving.builder:build_app` with `args:`.

`build_app(args)` takes the same option names as `shoal serve` (see app/config.py), or Ray
Serve LLM's `llm_configs` shape; the YAML's `args:` rank like command-line flags, above SHOAL_*
variables and `config: FILE`. With several `llm_configs` (a chat model next to an embedding
model, say) one Ingress serves them all, each model with its own LLMServer pool; a request's
`model` picks the pool.
"""
from __future__ import annotations

import ray
from ray import serve

from actors.executor.placement import check_fits, default_strategy
from app.config import ConfigError, ShoalConfig, check_model_path, replica_count, split_layout
from app.serving.ingress import Ingress
from app.serving.llm_server import LLMServer
from app.serving.model_server import ModelServer
from app.serving.ray_llm_config import load_configs
from app.serving.replica import StreamPacing, placement_bundles


def build_app(args: dict | None = None) -> serve.Application:
    """`args`: shoal's options, or Ray Serve LLM's `llm_configs` (app/serving/ray_llm_config.py)."""
    configs = load_configs(args or {})
    if any(c.deploy.direct_ingress for c in configs):
        raise ConfigError("direct_ingress is a `shoal serve` option: under `serve run` the "
                          "config's http_options and Serve's proxy answer HTTP")
    for config in configs:  # here, not in engine actors that Serve would start again and again
        check_model_path(config, missing_ok=True)
    return application(configs[0]) if len(configs) == 1 else models_application(configs)


def models_application(configs: list[ShoalConfig]) -> serve.Application:
    """Several models: one Ingress (the first config's ingress options) in front of an
    LLMServer pool per model, named after it."""
    if ray.is_initialized():
        for config in configs:
            check_placement(config)
    pools = [LLMServer.options(name=f"LLMServer:{c.server.served_model_name}", **replica_options(c)).bind(
        c.engine, c.deploy.log_level, c.deploy.decode_progress_interval_s, StreamPacing.of(c.deploy),
        c.server.served_model_name) for c in configs]
    return ingress_deployment(configs[0]).bind(pools, [c.server for c in configs], configs[0].deploy.log_level)


def application(config: ShoalConfig, listener: str | None = None) -> serve.Application:
    """The ModelServer pool (merged layout), or Ingress -> LLMServer pool (split); each model
    replica with its own placement group. `listener`: where `shoal serve` lends the listening
    socket its one ModelServer replica answers on (direct ingress). On a running Ray the layout is checked against the
    cluster first: one that can never be placed fails here (PlacementError, one line) instead
    of waiting forever."""
    if ray.is_initialized():
        check_placement(config)
    d = config.deploy
    if not split_layout(config):
        return ModelServer.options(**replica_options(config)).bind(
            config.engine, config.server, d.log_level, d.decode_progress_interval_s,
            StreamPacing.of(d), listener)
    llm = LLMServer.options(**replica_options(config)).bind(
        config.engine, d.log_level, d.decode_progress_interval_s, StreamPacing.of(d),
        config.server.served_model_name)
    return ingress_deployment(config).bind([llm], [config.server], d.log_level)


def ingress_deployment(config: ShoalConfig):
    d = config.deploy
    return Ingress.options(num_replicas=d.ingress_replicas, max_ongoing_requests=d.max_ongoing_requests,
                           graceful_shutdown_timeout_s=d.shutdown_timeout,
                           graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_POLL_S,
                           ray_actor_options={"num_cpus": d.ingress_cpus},
                           logging_config={"log_level": d.log_level.upper(), "enable_access_log": False})


def replica_options(config: ShoalConfig) -> dict:
    """Serve options of the model replicas' deployment (ModelServer or LLMServer)."""
    d, e = config.deploy, config.engine
    bundles = placement_bundles(e, d.replica_cpus)
    options = dict(
        ray_actor_options={"num_cpus": d.replica_cpus},
        placement_group_bundles=bundles,
        placement_group_strategy=e.placement_strategy or pack_strategy(bundles),
        max_ongoing_requests=d.max_ongoing_requests,
        # A dead engine (a rank died, the loop failed) fails check_health: replace it soon.
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        # serve shutdown / a scale-down: requests in flight get this long, then __del__ ends them.
        graceful_shutdown_timeout_s=d.shutdown_timeout,
        # ... checked this often (Serve's default, 2 s, made every stop wait 2 s for nothing).
        graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_POLL_S,
        # Serve's access log: the API logs every request itself (app/api/request_log.py).
        logging_config={"log_level": d.log_level.upper(), "enable_access_log": False},
    )
    if d.routing == "prefix-aware":
        options["request_router_config"] = prefix_aware_router()
    if d.max_replicas is None:
        options["num_replicas"] = replica_count(config)
    else:
        options["autoscaling_config"] = {
            "min_replicas": 1 if d.min_replicas is None else d.min_replicas,
            "max_replicas": d.max_replicas,
            "target_ongoing_requests": d.target_ongoing_requests,
            **{k: v for k in AUTOSCALING_WINDOWS if (v := getattr(d, k)) is not None},
        }
    return options


# Serve's autoscaling timings, passed on where set (else Serve's defaults).
AUTOSCALING_WINDOWS = ("upscale_delay_s", "downscale_delay_s", "look_back_period_s")


def prefix_aware_router():
    """Ray Serve LLM's prefix-tree router: the replica that served the longest matching prefix,
    unless it has PREFIX_BUSY_MARGIN more requests in flight than the least busy one."""
    from ray.serve.config import RequestRouterConfig
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:  # that path imports ray[llm]'s pyarrow; the router itself needs none
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    return RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter,
                               request_router_kwargs={"imbalanced_threshold": PREFIX_BUSY_MARGIN})


PREFIX_BUSY_MARGIN = 8


HEALTH_CHECK_PERIOD_S = 2.0
GRACEFUL_SHUTDOWN_POLL_S = 0.2


def pack_strategy(bundles: list[dict]) -> str:
    """STRICT_PACK when one node can hold a whole replica, else PACK (the engine's rule)."""
    return default_strategy(bundles) if ray.is_initialized() else "STRICT_PACK"


def check_placement(config: ShoalConfig, nodes: list[dict] | None = None) -> None:
    """Can the nodes (default: the cluster's) hold the replicas (the minimum, when autoscaling)
    and the split layout's ingress?"""
    d = config.deploy
    bundles = placement_bundles(config.engine, d.replica_cpus)
    replicas = replica_count(config) if d.max_replicas is None else (1 if d.min_replicas is None else d.min_replicas)
    strategy = config.engine.placement_strategy or ("STRICT_PACK" if nodes else pack_strategy(bundles))
    ingress = [{"CPU": d.ingress_cpus}] * d.ingress_replicas if split_layout(config) else []
    check_fits(bundles, replicas, strategy, ingress, nodes)
