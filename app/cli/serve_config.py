"""Ray Serve config files (serve_configs/*.yaml) for `shoal serve --config FILE.yaml`
(app/cli/serve.py `run_serve_config`): what `serve run FILE` does, with the graceful drain that
Ray's `serve run` does not have.

Ray Serve 2.60's `serve run` cannot drain (docs/operations.md):
- SIGTERM: the driver's SIGTERM handler (installed by `ray.init`) exits at once and the local
  cluster is torn down under the streams (exit status 15, sometimes an abort);
- Ctrl-C, and `serve shutdown` from anywhere, run `serve.shutdown()`: the controller's first
  shutdown step kills the HTTP proxy (its `shutdown()` is a no-op before `ray.kill`) while the
  replicas only begin their graceful_shutdown_timeout_s, so every stream in flight is cut.
None of that runs our code, so it is fixed here, around it: this command deploys the file the
way `serve run` does (Ray's own schema, `serve_start`, `deploy_apps`), and on SIGTERM or Ctrl-C
drains shoal's applications through their scheduler actors first (app/serving/drain.py:
new requests get 503 shutting_down, /readyz and /health 503, requests in flight finish for up
to the app's shutdown_timeout, the rest end with an error event), then shuts Serve down, stops
the Ray it started, and exits 0.
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import yaml

from app.cli.stop_signal import StopSignal
from app.config import ConfigError
from app.serving.ray_llm_config import load_configs

log = logging.getLogger("shoal.serve")

SHOAL_BUILDER = "app.serving.builder:build_app"
STATUS_PERIOD_S = 2.0  # how often the deployment's status is read while serving


def is_serve_config(path: str) -> bool:
    """A Ray Serve config file (a mapping with `applications:`), not a file of shoal options."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # load_config says what is wrong with it
    return isinstance(data, dict) and "applications" in data


def load_serve_config(path: str):
    """(Ray's ServeDeploySchema of the file, {shoal application: its shutdown_timeout}). Each
    shoal application's `args` are checked here, before Ray starts (one line on an error)."""
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load(Path(path).read_text())
    try:
        schema = ServeDeploySchema.model_validate(data)
    except Exception as exc:  # pydantic's ValidationError: many lines, the first says enough
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise ConfigError(f"{path} is not a valid Ray Serve config: {' '.join(lines[:3])}") from None
    timeouts = {}
    for app in schema.applications:
        if app.import_path == SHOAL_BUILDER:
            try:
                configs = load_configs(app.args or {})
            except ConfigError as exc:
                raise ConfigError(f"{path}: application {app.name!r}: {exc}") from None
            timeouts[app.name] = max(c.deploy.shutdown_timeout for c in configs)
    return schema, timeouts


def wait_for_stop(stop: StopSignal, names: list[str]) -> tuple[str, str | None]:
    """("signal", None) (SIGTERM / Ctrl-C), ("gone", None) (Serve or every application was
    deleted from outside) or ("failed", its one-line reason) (an application failed to deploy;
    the caller prints it once Ray is down, so no forwarded log line runs into it)."""
    from ray import serve

    while not stop.wait(STATUS_PERIOD_S):
        try:
            apps = serve.status().applications
        except Exception:  # the controller is gone: `serve shutdown` finished
            return "gone", None
        if not any(name in apps for name in names):
            return "gone", None
        failed = [name for name in names if name in apps and apps[name].status == "DEPLOY_FAILED"]
        if failed:
            return "failed", deploy_failure(failed[0], apps)
    return "signal", None


def deploy_failure(name: str, apps=None) -> str:
    """One line for an application that failed to deploy: the error its replicas raised (a
    model that did not load, say), the last line of Serve's messages about it."""
    from ray import serve

    lines = []
    try:
        apps = apps if apps is not None else serve.status().applications
        if name in apps:
            app = apps[name]
            for message in [d.message for d in app.deployments.values()] + [app.message]:
                lines += (message or "").strip().splitlines()
    except Exception:  # the controller is gone
        pass
    errors = [line for line in lines if re.match(r"\w+(Error|Exception): ", line)]
    reason = (errors or lines or ["see the Serve logs above"])[-1]
    return f"application {name!r} failed to deploy: {reason}"
