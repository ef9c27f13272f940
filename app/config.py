"""Serving options: one flat namespace over three dataclasses, loaded with precedence
command line (or `serve run` args) > SHOAL_* environment > YAML (`config: FILE.yaml`) > defaults.

Every option name is a field of EngineConfig (the engine), ServerSettings (the HTTP layer)
or DeployOptions (Ray Serve layout). A name in two of them (model_path, max_model_len)
sets both. Other spellings of a name (vLLM's, SGLang's) are in one table, ALIASES, which the
command line reads too: a spelling `shoal serve` takes works in every source. Bad values and
bad combinations raise ConfigError with one clear line, before anything starts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from actors.config import ENGINE_ALIASES, NEGATED_ALIASES, VALUE_ALIASES, EngineConfig
from app.api.settings import ServerSettings
from kernels.env import truthy

ENV_PREFIX = "SHOAL_"



@dataclass
class DeployOptions:
    """How the app is laid out on Ray Serve."""
    world_size: int | None = None  # total shard ranks; replicas = world_size / (tp x pp); None: one replica
    num_replicas: int | None = None  # fixed replica count (overrides world_size)
    min_replicas: int | None = None  # autoscaling lower bound (with max_replicas)
    max_replicas: int | None = None  # set to autoscale between min_replicas and this
    target_ongoing_requests: float = 64.0  # autoscaling target per replica
    upscale_delay_s: float | None = None  # autoscaling: load above target this long adds replicas (Serve: 30)
    downscale_delay_s: float | None = None  # ... below target this long removes them (Serve: 600)
    look_back_period_s: float | None = None  # ... the load averaged over this window (Serve: 30)
    max_ongoing_requests: int = 1024  # per replica; above it Serve queues at the router
    replica_cpus: float = 0.1  # the LLMServer replica process (placement bundle 0)
    ingress_replicas: int = 1
    ingress_cpus: float = 0.1
    host: str = "0.0.0.0"  # HTTP proxy (`shoal serve`; under `serve run` the YAML's http_options)
    port: int = 8000
    address: str | None = None  # Ray cluster to join; None starts a local Ray
    app_name: str = "shoal"
    log_level: str = "INFO"
    decode_progress_interval_s: float = 0.0  # > 0: the scheduler logs throughput this often
    # Stream pacing (app/serving/replica.py StreamPacing): a stream's first token leaves at once,
    # later ones every `stream_interval` tokens (vLLM's and SGLang's --stream-interval), gathered
    # under load for up to `stream_flush_ms` so a replica sends about `stream_chunks_per_s`.
    stream_interval: int = 1
    stream_flush_ms: float = 50.0
    stream_chunks_per_s: float = 100.0  # per replica; 0: no gathering by time
    routing: str = "load"  # load (Serve's power of two choices) | prefix-aware
    # merged: each replica is the HTTP ingress too; split: an Ingress deployment in front of
    # the LLMServer pool. None: split where it is needed (prefix-aware routing, or
    # --ingress-replicas above 1), else merged (one process hop fewer per request and chunk).
    serve_layout: str | None = None
    # The one model replica answers HTTP on host:port itself instead of behind Serve's proxy
    # (app/serving/direct_http.py). None: on under `shoal serve` when it starts a local Ray and
    # the app is a single merged replica; `serve run` configs keep the proxy.
    direct_ingress: bool | None = None
    shutdown_timeout: float = 30.0  # seconds requests in flight may finish after SIGTERM / shutdown


@dataclass
class ShoalConfig:
    engine: EngineConfig
    server: ServerSettings
    deploy: DeployOptions

    def flat(self) -> dict:
        """Every option by name (what --print-config shows; loadable again with --config)."""
        return {**dataclasses.asdict(self.deploy), **dataclasses.asdict(self.server),
                **dataclasses.asdict(self.engine)}


class ConfigError(ValueError):
    """A bad option: the message is one line meant for the user."""


SECTIONS = (EngineConfig, ServerSettings, DeployOptions)

# Every option's other spellings (vLLM, SGLang and areno names), by canonical name: the one
# table both sides read. The command line adds `--spelling` for each (app/cli/engine_args.py
# `add_option`); YAML files, `serve run` args and SHOAL_* variables resolve them with
# `canonical()`. Dashes and underscores are the same (`tensor-parallel-size` in YAML works).
ALIASES: dict[str, tuple[str, ...]] = {
    **ENGINE_ALIASES,  # actors/config.py: the engine's options, which `LLM(...)` reads too
    "num_replicas": ("data_parallel_size", "dp_size", "dp"),
    "max_top_logprobs": ("max_logprobs",),  # (vLLM's)
}
# (NEGATED_ALIASES: spellings of a boolean option that mean its opposite, `--disable-radix-cache`;
# argparse's `--no-NAME` forms are command-line only: a file writes `NAME: false`. VALUE_ALIASES:
# other spellings of values, `--dtype bf16`. Both from actors/config.py.)
_SPELLINGS = {alias: (name, False) for name, aliases in ALIASES.items() for alias in aliases}
_SPELLINGS.update({alias: (name, True) for name, aliases in NEGATED_ALIASES.items()
                   for alias in aliases})


def option_types() -> dict[str, type]:
    types_: dict[str, type] = {}
    for cls in SECTIONS:
        types_.update(typing.get_type_hints(cls))
    return types_


def canonical(name: str) -> str:
    """The option a spelling names (`gpu-memory-utilization` -> kv_cache_fraction)."""
    return resolve(name)[0]


def resolve(name: str) -> tuple[str, bool]:
    """(canonical name, whether the spelling negates it)."""
    name = name.replace("-", "_").lower()
    return _SPELLINGS.get(name, (name, False))


# --------------------------------------------------------------------------- sources

def load_config(cli: dict | None = None, environ: typing.Mapping[str, str] | None = None) -> ShoalConfig:
    """Options from every source, merged and validated."""
    cli = normalize(cli or {}, "the command line")
    env = env_options(os.environ if environ is None else environ)
    path = cli.pop("config", None) or env.get("config")  # --config wins over SHOAL_CONFIG
    env.pop("config", None)
    file = yaml_options(path) if path else {}
    return validate(build({**file, **env, **cli}))


def normalize(options: dict, source: str) -> dict:
    """Canonical names, unknown ones refused, values converted to the option's type."""
    known = option_types()
    out = {}
    for key, value in options.items():
        name, negated = resolve(key)
        if name == "config":
            out[name] = value
        elif name in known:
            value = convert(name, value, known[name])
            if negated:
                value = not value
            elif name in VALUE_ALIASES:
                value = VALUE_ALIASES[name].get(value, value)
            out[name] = value
        else:
            raise ConfigError(f"unknown option {key!r} in {source}")
    return out


def env_options(environ: typing.Mapping[str, str]) -> dict:
    """SHOAL_<OPTION> variables; other SHOAL_* variables (not options) are left alone."""
    names = set(option_types()) | {"config"}
    found = {k[len(ENV_PREFIX):]: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    return normalize({k: v for k, v in found.items() if canonical(k) in names}, "the environment")


def yaml_options(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of option: value")
    data.pop("config", None)  # no nesting
    return normalize(data, path)


# --------------------------------------------------------------------------- values

def convert(name: str, value, kind):
    """`value` (maybe a string from the environment or `serve run k=v`) as type `kind`."""
    optional = _is_optional(kind)
    base = _base_type(kind)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"option {name} needs a value")
    try:
        if base is bool:
            return _bool(value)
        if base is dict:  # JSON text from the command line or the environment
            value = json.loads(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise ValueError
            return value
        if base is list:
            return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) \
                else list(value)
        if base in (int, float):
            if isinstance(value, bool) or (base is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return base(value)
        return str(value)
    except (TypeError, ValueError):
        what = "JSON object" if base is dict else base.__name__
        raise ConfigError(f"option {name}: {value!r} is not a valid {what}") from None


def _is_optional(kind) -> bool:
    return type(None) in typing.get_args(kind)


def _base_type(kind) -> type:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return typing.get_origin(kind) or kind


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    parsed = truthy(str(value))
    if parsed is None:
        raise ValueError(value)
    return parsed


# --------------------------------------------------------------------------- build + check

def build(options: dict) -> ShoalConfig:
    def section(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names})
    try:
        return ShoalConfig(section(EngineConfig), section(ServerSettings), section(DeployOptions))
    except ValueError as exc:  # ServerSettings checks its own values
        raise ConfigError(str(exc)) from None


def validate(config: ShoalConfig) -> ShoalConfig:
    try:
        config.engine.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for check in (_check_layout, _check_replicas, _check_resources):
        check(config)
    return config


def shards_per_replica(config: ShoalConfig) -> int:
    return config.engine.tp_size * config.engine.pp_size


def _check_layout(config: ShoalConfig) -> None:
    """How the replicas are laid out (the engine's own layout was checked by EngineConfig.validate)."""
    e, d = config.engine, config.deploy
    if d.world_size is not None and d.world_size < 1:
        raise ConfigError("--world-size must be positive")
    if d.routing not in ("load", "prefix-aware"):
        raise ConfigError(f"--routing must be load or prefix-aware, got {d.routing!r}")
    if d.serve_layout not in (None, "merged", "split"):
        raise ConfigError(f"--serve-layout must be merged or split, got {d.serve_layout!r}")
    if d.serve_layout == "merged" and (d.routing == "prefix-aware" or d.ingress_replicas > 1):
        raise ConfigError("--routing prefix-aware and --ingress-replicas need --serve-layout split "
                          "(a separate ingress in front of the model replicas)")
    if d.direct_ingress and not single_model_server(config):
        raise ConfigError("--direct-ingress needs one model replica in the merged layout "
                          "(no autoscaling, no --serve-layout split)")
    if d.world_size is not None and d.world_size % shards_per_replica(config):
        raise ConfigError(f"--world-size {d.world_size} is not divisible by --tp-size x --pp-size "
                          f"= {e.tp_size} x {e.pp_size} = {shards_per_replica(config)}")


def _check_replicas(config: ShoalConfig) -> None:
    d = config.deploy
    if d.max_replicas is None:
        if d.min_replicas is not None:
            raise ConfigError("--min-replicas needs --max-replicas (autoscaling)")
        if d.num_replicas is not None and d.num_replicas < 1:
            raise ConfigError(f"--num-replicas must be positive, got {d.num_replicas}")
        return
    if d.num_replicas is not None or d.world_size not in (None, shards_per_replica(config)):
        raise ConfigError("give a fixed size (--world-size / --num-replicas) or autoscaling "
                          "(--min-replicas / --max-replicas), not both")
    low = 1 if d.min_replicas is None else d.min_replicas
    if not 0 <= low <= d.max_replicas or d.max_replicas < 1:
        raise ConfigError(f"need 0 <= --min-replicas ({low}) <= --max-replicas ({d.max_replicas}), "
                          "with --max-replicas at least 1")
    for name in ("upscale_delay_s", "downscale_delay_s"):
        if (value := getattr(d, name)) is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value:g}")
    if d.look_back_period_s is not None and d.look_back_period_s <= 0:
        raise ConfigError(f"--look-back-period-s must be positive, got {d.look_back_period_s:g}")


def _check_resources(config: ShoalConfig) -> None:
    d = config.deploy
    if d.replica_cpus <= 0 or d.ingress_cpus <= 0:
        raise ConfigError("--replica-cpus and --ingress-cpus must be positive")
    if not 0 < d.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {d.port}")
    if d.ingress_replicas < 1:
        raise ConfigError("--ingress-replicas must be positive")
    if d.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {d.shutdown_timeout}")
    if d.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be at least 1, got {d.stream_interval}")
    if d.stream_flush_ms < 0 or d.stream_chunks_per_s < 0:
        raise ConfigError("--stream-flush-ms and --stream-chunks-per-s must be >= 0")


def split_layout(config: ShoalConfig) -> bool:
    """A separate Ingress deployment in front of the LLMServer pool (see DeployOptions)."""
    d = config.deploy
    if d.serve_layout is not None:
        return d.serve_layout == "split"
    return d.routing == "prefix-aware" or d.ingress_replicas > 1


def single_model_server(config: ShoalConfig) -> bool:
    """One ModelServer replica and nothing else: what direct ingress can serve."""
    return (not split_layout(config) and config.deploy.max_replicas is None
            and replica_count(config) == 1)


def replica_count(config: ShoalConfig) -> int:
    """Fixed replicas: --num-replicas, else world_size / (tp x pp), else one."""
    d = config.deploy
    return d.num_replicas or (d.world_size or shards_per_replica(config)) // shards_per_replica(config)


def check_model_path(config: ShoalConfig, missing_ok: bool = False) -> None:
    """The checkpoint is there, and config.json names an architecture and a quantization shoal
    reads (ValueError, one line): checked before Ray starts (`shoal serve`) or when `serve run`
    builds the application, without torch. missing_ok: a checkpoint not on this machine is
    left to the nodes the engines run on."""
    from actors.models import check_architecture
    from actors.worker import quantization_config
    from actors.worker.checkpoint_files import read_config, resolve_model_path, resolve_tokenizer_path
    try:
        path = resolve_model_path(config.engine.model_path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    hf = read_config(path)
    check_architecture((hf.get("architectures") or ["LlamaForCausalLM"])[0])
    quantization_config.check(hf, config.engine.quantization)
    if config.engine.tokenizer and not missing_ok:
        try:
            resolve_tokenizer_path(config.engine.tokenizer, None)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"--tokenizer: {exc}") from None
    speculative = config.engine.speculative
    if speculative is not None and speculative.model and not missing_ok:  # a draft model
        try:
            resolve_model_path(speculative.model)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"--speculative-config's draft model: {exc}") from None
