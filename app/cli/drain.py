"""`shoal drain`: the graceful drain for deployments that Ray's own commands stop.

`serve run FILE` (Ctrl-C) and `serve shutdown` kill Serve's HTTP proxy before the replicas
drain, so every stream in flight is cut (docs/operations.md). Run `shoal drain` first, from
any shell that reaches the cluster (or a KubeRay preStop hook): every shoal replica stops
admitting (503 shutting_down, /readyz and /health 503), the requests in flight finish for up
to --timeout, the rest end with an error event; then Ray's command stops an idle Serve.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def add_drain_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "drain", allow_abbrev=False, help="stop admitting and finish requests in flight "
                                          "(run before `serve shutdown` / Ctrl-C on `serve run`)",
        description="Drain the shoal applications of a running Ray Serve: new requests get "
                    "503, requests in flight finish (up to --timeout), the rest end with an "
                    "error event. Serve keeps running, idle, until it is shut down.")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (default: $RAY_ADDRESS, else 'auto': the "
                             "cluster on this machine)")
    parser.add_argument("--app", action="append", dest="apps", metavar="NAME",
                        help="application to drain (repeatable; default: all of them)")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="seconds requests in flight may take to finish (default 30, "
                             "as --shutdown-timeout)")
    parser.set_defaults(handler=drain_command)


def drain_command(args: argparse.Namespace) -> int:
    if args.timeout < 0:
        sys.exit(f"shoal drain: error: --timeout must be >= 0, got {args.timeout:g}")
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.exceptions import RayServeException

    from app.cli.ray_probe import port_open
    from app.serving.drain import drain
    from app.serving.schedulers import scheduler_actors

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    if address != "auto" and not port_open(address):  # ray.init would retry it for minutes
        sys.exit(f"shoal drain: error: no Ray cluster at {address}: {address} does not answer")
    try:
        ray.init(address=address, namespace=SERVE_NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False)
    except ConnectionError as exc:
        sys.exit(f"shoal drain: error: no Ray cluster at {address}: {str(exc).splitlines()[0]}")
    try:
        try:
            names = args.apps or list(serve.status().applications)
        except RayServeException as exc:
            print(f"shoal drain: error: {str(exc).splitlines()[0]} (Ray at {address})",
                  file=sys.stderr, flush=True)
            return 1
        replicas = sum(len(scheduler_actors(name)) for name in names)
        if not replicas:
            print(f"shoal drain: error: no shoal replicas in {', '.join(names) or 'Serve'} "
                  f"(Ray at {address})", file=sys.stderr, flush=True)
            return 1
        print(f"shoal: draining {replicas} replica(s) of {', '.join(names)} "
              f"(up to {args.timeout:g} s)", flush=True)
        seconds, aborted = drain(names, args.timeout)
        print(f"shoal: drained in {seconds:.1f} s, {aborted} request(s) ended unfinished; "
              "new requests get 503 until Serve is shut down (`serve shutdown -y`, or Ctrl-C "
              "on `serve run`)", flush=True)
        return 0
    finally:
        ray.shutdown()
