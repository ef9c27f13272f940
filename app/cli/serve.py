"""`shoal serve`: the OpenAI-compatible server on Ray Serve, with areno's option names.

Every option defaults to SUPPRESS, so the namespace holds only what the user typed and it
ranks above SHOAL_* variables, `--config FILE.yaml` and the defaults (app/config.py).
"""
from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import sys
import time

from actors.logs import setup_logging
from app.cli.engine_args import add_engine_args, add_option
from app.cli.own_session import run_in_own_session
from app.cli.serve_config import is_serve_config
from app.cli.stop_signal import StopSignal
from app.config import (ConfigError, ShoalConfig, check_model_path, load_config, replica_count,
                        single_model_server, split_layout)
from app.protocol.generation_defaults import CHOICES as GENERATION_CONFIG_CHOICES

log = logging.getLogger("shoal.serve")

ACTIONS = ("command", "handler", "print_config", "dry_run")


def add_serve_parser(subparsers) -> None:
    # conflict_handler="resolve": should add_engine_args gain one of the layout flags below
    # (same name, same dest), ours replaces it instead of breaking the parser.
    parser = subparsers.add_parser(
        "serve", allow_abbrev=False, conflict_handler="resolve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve chat and text completions on Ray Serve: a pool of model replicas "
                    "(each its own HTTP ingress, or behind a separate one: --serve-layout), a "
                    "scheduler actor per replica.")
    add_server_args(parser)
    add_engine_args(parser)
    add_layout_args(parser)
    parser.set_defaults(handler=serve_command)


def _adder(group):
    def add(flag, **kwargs):
        add_option(group, flag, **kwargs)  # with its aliases from app/config.py
    return add


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add = _adder(parser.add_argument_group("server"))
    add("--host", help="HTTP bind host (default 0.0.0.0)")
    add("--port", type=int, help="HTTP bind port (default 8000)")
    add("--served-model-name", help="model name clients use (default: the checkpoint directory name)")
    add("--api-key", help="require `Authorization: Bearer KEY` on API routes")
    add("--allowed-origins", help="CORS origins, comma separated (default: CORS off)")
    add("--default-max-tokens", type=int,
        help="budget for chat requests that set none (default 1024, capped by the context left)")
    add("--disable-thinking", action="store_true",
        help="pass enable_thinking=False to chat templates that support it")
    add("--log-requests", type=int, choices=[0, 1, 2, 3],
        help="0: a line per request, 1: + sampling params, 2: + text, 3: + whole text")
    add("--tool-call-parser", metavar="NAME",
        help="tool-call format: hermes (qwen), llama3_json, mistral, gemma, json, harmony "
             "(openai: gpt-oss) (default: the one the model's config.json declares, else from "
             "the chat template)")
    add("--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM compatibility: tool_choice \"auto\" is always on")
    add("--reasoning-parser", metavar="NAME",
        help="split reasoning into reasoning_content: qwen3, deepseek_r1 (<think>), harmony "
             "(openai_gptoss: gpt-oss's analysis channel), gemma4 (its thought channel) or none (default: the "
             "model's config.json, else its family's: Qwen3 -> qwen3, gpt-oss -> harmony, Gemma 4 -> gemma4)")
    add("--chat-template", metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the tokenizer's")
    add("--max-top-logprobs", type=int, metavar="N",
        help="most alternatives a request may ask for per token (top_logprobs, logprobs; default 20)")
    add("--disable-log-requests", action="store_true",
        help="vLLM's: each request's log line at DEBUG instead of INFO")
    add("--disable-log-stats", action="store_true",
        help="vLLM's, accepted: no periodic stats are logged (see --decode-progress-interval-s)")
    add("--generation-config", choices=list(GENERATION_CONFIG_CHOICES),
        help="auto (default): requests that leave temperature, top_p, top_k, min_p or "
             "repetition_penalty unset get the model's generation_config.json values; vllm: not")
    add("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    add("--decode-progress-interval-s", type=float, metavar="S",
        help="log decode throughput every S seconds (default 0: off)")
    add("--routing", choices=["load", "prefix-aware"],
        help="replica choice: by load (default), or to the replica likely to hold the prompt's "
             "prefix in its cache, falling back to load when that replica is busy")
    add("--stream-interval", type=int, metavar="N",
        help="stream every N tokens (vLLM's and SGLang's option; the first token always at once; "
             "default 1)")
    add("--stream-flush-ms", type=float, metavar="MS",
        help="under load a stream gathers tokens for at most MS ms before sending them "
             "(default 50)")
    add("--stream-chunks-per-s", type=float, metavar="N",
        help="below that cap, gather just enough that a replica sends about N chunks/s in all "
             "(0: no gathering by time; default 100)")
    add("--shutdown-timeout", type=float, metavar="S",
        help="on SIGTERM/Ctrl-C (and for Serve's graceful shutdown): stop admitting, let requests "
             "in flight finish for up to S seconds, then end the rest with an error (default 30)")
    parser.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                        help="options as a YAML mapping (command line and SHOAL_* win over it); "
                             "or a Ray Serve config (serve_configs/*.yaml), run as `serve run` "
                             "would, with the graceful drain on SIGTERM / Ctrl-C")
    parser.add_argument("--print-config", action="store_true",
                        help="print the merged options as YAML and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="load the model (and its shards) and generate one token; no HTTP")


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    add = _adder(parser.add_argument_group("Ray layout"))
    add("--world-size", type=int, help="total shard ranks; replicas = world / (tp x pp) (default: one replica)")
    add("--num-replicas", type=int, help="fixed number of model replicas (instead of --world-size)")
    add("--min-replicas", type=int, help="autoscaling lower bound (default 1)")
    add("--max-replicas", type=int, help="autoscale between --min-replicas and this")
    add("--target-ongoing-requests", type=float,
        help="autoscaling target per replica (default 64)")
    add("--upscale-delay-s", type=float,
        help="autoscaling: seconds above the target before replicas are added (Serve's default 30)")
    add("--downscale-delay-s", type=float,
        help="autoscaling: seconds below the target before replicas are removed (Serve's default 600)")
    add("--look-back-period-s", type=float,
        help="autoscaling: seconds over which the load is averaged (Serve's default 30; Serve "
             "warns at or below its 10 s metrics interval)")
    add("--max-ongoing-requests", type=int,
        help="requests each model replica (and each split-layout ingress replica) takes "
             "before Serve queues (default 1024)")
    add("--replica-cpus", type=float, help="CPUs of each replica process (default 0.1)")
    add("--serve-layout", choices=["merged", "split"],
        help="merged: every model replica is also an HTTP ingress (one process hop fewer per "
             "request and stream chunk); split: a separate Ingress deployment in front of the "
             "LLMServer pool (default: split for --routing prefix-aware or --ingress-replicas > 1, "
             "else merged)")
    add("--direct-ingress", action=argparse.BooleanOptionalAction,
        help="the model replica answers HTTP on --host:--port itself, without Ray Serve's proxy "
             "(~10 ms less per request; one replica only). Default: on when shoal serve starts "
             "a local Ray for one merged replica")
    add("--ingress-replicas", type=int, help="split layout: replicas of the HTTP ingress (default 1)")
    add("--ingress-cpus", type=float, help="split layout: CPUs of each ingress replica (default 0.1)")
    add("--address", help="Ray cluster address to join (default: $RAY_ADDRESS, else start a "
                          "local Ray)")
    add("--app-name", help="Serve application name (default shoal)")


# --------------------------------------------------------------------------- command

def serve_command(args: argparse.Namespace) -> int:
    options = {k: v for k, v in vars(args).items() if k not in ACTIONS}
    if "config" in options and is_serve_config(options["config"]):
        return serve_config_command(args, options)
    try:
        config = load_config(options)
        if not args.print_config:
            check_model_path(config)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"shoal serve: error: {exc}")
    if args.print_config:
        return print_config(config)
    setup_logging(config.deploy.log_level)
    if args.dry_run:
        return dry_run(config)
    return run_in_own_session(lambda: run_server(config))


def serve_config_command(args: argparse.Namespace, options: dict) -> int:
    """`--config` names a Ray Serve config (serve_configs/*.yaml): run it as `serve run` does,
    with the drain (app/cli/serve_config.py). Its options live in the file's `args:`."""
    extra = sorted(set(options) - {"config", "address"})
    if extra or args.print_config or args.dry_run:
        given = "--" + (extra[0].replace("_", "-") if extra else "print-config" if args.print_config else "dry-run")
        sys.exit(f"shoal serve: error: {options['config']} is a Ray Serve config: set options under its "
                 f"applications' args: (only --address goes with it; got {given})")
    setup_logging()
    return run_in_own_session(lambda: run_serve_config(options["config"], options.get("address")))


def print_config(config: ShoalConfig) -> int:
    import yaml
    print(yaml.safe_dump(config.flat(), sort_keys=False), end="")
    return 0


def dry_run(config: ShoalConfig) -> int:
    """Load the model in this process and generate one token: the checkpoint is servable."""
    from actors.engine.llm_engine import LLMEngine
    from actors.request import EngineRequest
    from actors.sampling_params import SamplingParams

    start = time.perf_counter()
    try:
        engine = LLMEngine(config.engine)
    except ValueError as exc:  # settings the checkpoint can't honour
        sys.exit(f"shoal serve: error: {exc}")
    loaded = time.perf_counter() - start
    request = EngineRequest("dry-run", engine.tokenizer.encode("Hello") or [0],
                            SamplingParams(temperature=0, max_tokens=1))
    engine.check(request)
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    engine.shutdown()  # shard actors of a tp x pp layout
    print(f"dry run ok: {engine.model_path} loaded in {loaded:.1f} s; max_model_len "
          f"{engine.max_model_len}, {engine.blocks.num_blocks} KV blocks of {engine.spec.block_size} "
          f"tokens; would serve {replica_count(config)} replica(s) on "
          f"http://{config.deploy.host}:{config.deploy.port}")
    return 0


def run_server(config: ShoalConfig) -> int:
    """Start (or join) Ray, run the app with the HTTP proxy on host:port, block until a signal."""
    import ray
    from ray import serve

    from actors.executor.placement import PlacementError
    from app.serving.builder import application, check_placement
    from app.serving.direct_http import ListeningSocket
    from app.serving.drain import drain

    d = config.deploy
    address = d.address or os.environ.get("RAY_ADDRESS") or "local"
    if d.direct_ingress is None:  # a cluster joined may run Serve's proxy on this port already
        d.direct_ingress = address == "local" and single_model_server(config)
    resources, listener = {}, None
    try:
        if d.direct_ingress and address != "local":
            raise ConfigError("--direct-ingress lends this process's socket to the replica: it "
                              "needs the local Ray that shoal serve starts, not --address")
        if address == "local":  # this machine is the whole cluster: check before Ray starts
            resources = local_resources(config)
            check_placement(config, [{"CPU": resources["num_cpus"], "GPU": local_gpus()}])
        if d.direct_ingress:  # bound before Ray starts: a port in use fails at once
            listener = ListeningSocket(d.host, d.port)
    except (PlacementError, ConfigError, OSError) as exc:
        print(f"shoal serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    ray_settings_for_serving()
    phases = [("start", time.perf_counter())]  # start-up phases, in the ready line
    ray.init(address=address, logging_level=logging.WARNING, **resources)
    phases.append(("Ray", time.perf_counter()))
    stop, failure = StopSignal(), None
    try:
        try:
            app = application(config, listener and listener.path)
        except PlacementError as exc:
            print(f"shoal serve: error: {exc}", file=sys.stderr, flush=True)
            return 1
        if d.direct_ingress:  # the replica listens on host:port; no proxy
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": d.host, "port": d.port})
        phases.append(("Serve", time.perf_counter()))
        poll_serve_status_often()
        try:
            serve.run(app, name=d.app_name, route_prefix="/", blocking=False)
        except RuntimeError:  # a replica that could not start, after Serve's retries
            from app.cli.serve_config import deploy_failure
            failure = deploy_failure(d.app_name)
            return 1
        phases.append(("replicas", time.perf_counter()))
        print(f"shoal: serving {config.server.served_model_name} at http://{d.host}:{d.port}/v1 "
              f"(Ray at {address}); ready in {describe_phases(phases)}; Ctrl-C or SIGTERM stops", flush=True)
        stop.wait()
        print(f"shoal: draining (up to {d.shutdown_timeout:g} s)", flush=True)
        seconds, aborted = drain(d.app_name, d.shutdown_timeout)
        print(f"shoal: drained in {seconds:.1f} s, {aborted} request(s) ended unfinished", flush=True)
        time.sleep(1.0)  # the last chunks cross the replica, the ingress and the proxy
    finally:
        shut_down(d.app_name, joined=address != "local")
        if listener is not None:
            listener.close()
        if failure:  # (after Ray's shutdown: its forwarded log lines can't run into it)
            print(f"shoal serve: error: {failure}", file=sys.stderr, flush=True)
    return 0


def poll_serve_status_often() -> None:
    """serve.run asks the controller whether the application runs once a second: ~0.5 s of every
    start on average, up to 1 s. Twenty times a second costs the controller nothing that matters
    while it starts replicas. (A private constant of Ray Serve's client: if it moves, serve.run
    keeps its own pace.)"""
    from ray.serve._private import client

    if hasattr(client, "CLIENT_POLLING_INTERVAL_S"):
        client.CLIENT_POLLING_INTERVAL_S = 0.05


def describe_phases(marks: list[tuple[str, float]]) -> str:
    """'25.2 s (before Ray 2.0 s, Ray 9.6 s, Serve 1.1 s, replicas 12.5 s)' from the process's
    start and (name, time a phase ended) marks; the first mark ends what came before Ray."""
    import psutil  # Ray's dependency

    began = time.perf_counter() - (time.time() - psutil.Process().create_time())
    names = ["before Ray"] + [name for name, _ in marks[1:]]
    ends = [t for _, t in marks]
    parts = [f"{name} {end - start:.1f} s" for name, start, end in zip(names, [began] + ends, ends)]
    return f"{ends[-1] - began:.1f} s ({', '.join(parts)})"


def run_serve_config(path: str, address: str | None) -> int:
    """Deploy the file as `serve run` does, block until SIGTERM / Ctrl-C, drain, stop."""
    from app.cli.serve_config import load_serve_config, wait_for_stop

    try:
        schema, timeouts = load_serve_config(path)
    except ConfigError as exc:
        print(f"shoal serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    import ray
    from ray.serve._private.api import serve_start
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.config import gRPCOptions

    from app.serving.drain import drain

    names = [app.name for app in schema.applications]
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    ray_settings_for_serving()
    ray.init(address=address, namespace=SERVE_NAMESPACE)  # the dashboard too, as `serve run`
    stop = StopSignal()  # after ray.init, whose SIGTERM handler would exit at once
    code, ours, failure = 0, names, None  # (ours: the applications to delete at the end on a joined cluster)
    try:
        client = serve_start(http_options=schema.http_options.model_dump(),
                             proxy_location=schema.proxy_location,
                             grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
                             controller_options=getattr(schema, "controller_options", None))
        client.deploy_apps(schema, _blocking=False)
        http = schema.http_options
        print(f"shoal: deployed {path} ({', '.join(names)}) at http://{http.host}:{http.port} "
              f"(Ray at {address}); Ctrl-C or SIGTERM drains and stops", flush=True)
        outcome, failure = wait_for_stop(stop, names)
        if outcome == "gone":
            print("shoal: Serve was shut down from outside (serve shutdown); stopping", flush=True)
            ours = []
            return 0
        if outcome == "failed":
            code = 1
        elif timeouts:
            timeout = max(timeouts.values())
            print(f"shoal: draining {', '.join(timeouts)} (up to {timeout:g} s)", flush=True)
            seconds, aborted = drain(list(timeouts), timeout)
            print(f"shoal: drained in {seconds:.1f} s, {aborted} request(s) ended unfinished", flush=True)
            time.sleep(1.0)  # the last chunks cross the replica, the ingress and the proxy
    finally:
        shut_down(ours, joined=address != "local")
        if failure:  # (after Ray's shutdown: its forwarded log lines can't run into it)
            print(f"shoal serve: error: {failure}", file=sys.stderr, flush=True)
    return code


def ray_settings_for_serving() -> None:
    """Settings a Ray that this process starts passes on to its processes (set here unless
    the caller's environment sets them):
    - Workers at this process's priority. Ray's default is nice 15, so that workers never
      starve the raylet; but the engine (the scheduler and shard actors) is what an inference
      server must not starve: at nice 15 it loses its cores to any ordinary process (a client
      on the same machine, llama-server beside it) and measured 0.81 of the in-process
      engine's throughput where nice 0 gave 0.91.
    - Serve's controller checks its deployments once a second, not ten times. Its loop is the
      busiest of Ray's own processes on an idle server (~5% of a core, ~330 wake-ups a
      second), and every wake-up on a core the engine's threads share stalls both at their
      next barrier: the llama.cpp comparison's throughput rose ~8% with it, averaged over
      three A/B runs (one of them went the other way). Ten times a second while it starts
      (app/serving/controller_pace.py).
    (docs/benchmarks.md.) Joining a cluster changes nothing: `ray start` decides there
    (docs/multinode.md)."""
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1")
    os.environ.setdefault("RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH", "app.serving.controller_pace.start_fast")


def local_resources(config: ShoalConfig) -> dict:
    """The Ray this command starts gets logical CPUs for every bundle of the layout, so any
    layout the user asks for runs here (slowly, when ranks outnumber the cores)."""
    d, e = config.deploy, config.engine
    replicas = replica_count(config) if d.max_replicas is None else d.max_replicas
    ranks = replicas * e.tp_size * e.pp_size
    ingress = d.ingress_replicas * d.ingress_cpus if split_layout(config) else 0
    need = replicas * (d.replica_cpus + e.tp_size * e.pp_size * e.shard_cpus) + ingress
    cores = os.cpu_count() or 1
    if ranks > cores:
        log.warning("%d shard ranks share %d CPU cores: outputs are exact, but expect it to be slow", ranks, cores)
    return {"num_cpus": max(cores, math.ceil(need))}


def local_gpus() -> int:
    """The GPUs Ray will find on this machine: CUDA_VISIBLE_DEVICES, else the NVIDIA devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def shut_down(app_names: str | list[str], joined: bool) -> None:
    """A local Ray goes away entirely; on a shared cluster only our application(s) do."""
    import ray
    from ray import serve

    print("shoal: shutting down", flush=True)
    try:
        if joined:
            for name in [app_names] if isinstance(app_names, str) else app_names:
                serve.delete(name)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
