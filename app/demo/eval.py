"""Evaluate the bundled demo model through the real server: `make demo-eval`.

Starts `shoal serve` on a free loopback port (or, with `--inproc` or when the serve command
does not come up, the same FastAPI app in this process over a LocalEngineClient), sends
held-out problems from app/demo/data.py with the `openai` client, greedy, and prints
exact-match rates as a markdown table:

    python -m app.demo.eval [--model-path DIR] [--n 100] [--inproc] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from app.demo.yielding import mark_test_run

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
NUM = re.compile(r"-?\d+")

# row: (label, target rate or None)
ROWS = {
    "add": ("addition below 100, no thinking", 0.95),
    "add_think": ("addition below 100, thinking", 0.95),
    "mul21": ("2-digit x 1-digit, no thinking", 0.90),
    "mul21_think": ("2-digit x 1-digit, thinking", 0.90),
    "mul22_think": ("2-digit x 2-digit, thinking", 0.60),
    "tool_call": ("correct tool call when one is needed", 0.90),
    "no_tool": ("no tool call when none is needed", 0.95),
}


# --------------------------------------------------------------------------- scoring

def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Qwen-style calls out of raw text: (the text without them, [{name, arguments}])."""
    calls = []
    for body in CALL.findall(text):
        try:
            obj = json.loads(body)
            calls.append({"name": obj.get("name"), "arguments": obj.get("arguments")})
        except (json.JSONDecodeError, AttributeError):
            calls.append({"name": None, "arguments": body})
    return CALL.sub("", text).strip(), calls


def answer_number(text: str) -> int | None:
    """The final answer: the last integer after any think block."""
    nums = NUM.findall(text.split("</think>")[-1])
    return int(nums[-1]) if nums else None


def message_calls(message) -> list[dict]:
    """Tool calls the server parsed, else the ones in the raw content."""
    if message.tool_calls:
        out = []
        for c in message.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = c.function.arguments
            out.append({"name": c.function.name, "arguments": args})
        return out
    return parse_tool_calls(message.content or "")[1]


def restated(sample: dict, message) -> bool:
    """Diagnostic: the reply ends with the problem copied right (`47 * 36 = ...`)."""
    q = re.search(r"\d+ [+*] \d+", sample["messages"][-1]["content"]).group(0)
    return (message.content or "").split("</think>")[-1].strip().startswith(q + " = ")


def args_only(sample: dict, message) -> bool:
    """Diagnostic: one call whose arguments are right, whatever its function name."""
    calls = message_calls(message)
    return len(calls) == 1 and calls[0]["arguments"] == sample["expect"]["arguments"]


def passed(kind: str, sample: dict, message) -> bool:
    calls = message_calls(message)
    if kind == "tool_call":
        return calls == [sample["expect"]]
    if kind == "no_tool":
        return not calls
    return answer_number(message.content or "") == sample["expect"]


# --------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc=None) -> bool:
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            # /readyz, not /v1/models: the route answers before the model has loaded.
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


@contextlib.contextmanager
def shoal_serve(model_path: str | None, timeout: float, log_path: str):
    """`shoal serve` as a subprocess on loopback; yields its base URL or None if it never
    answered (the caller then falls back to the in-process server)."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    if model_path:
        cmd += ["--model-path", model_path]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url if wait_healthy(url, timeout, proc) else None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # serve's own clean shutdown stops its Ray
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def inproc_server(model_path: str | None):
    """The same HTTP API in this process: uvicorn in a thread over a LocalEngineClient."""
    from actors.config import EngineConfig
    from app.api.app import ApiHost
    from app.api.embedded import serve_in_thread
    from app.api.engine_client import LocalEngineClient
    from app.api.settings import ServerSettings

    client = LocalEngineClient(EngineConfig(model_path=model_path))
    settings = ServerSettings(model_path=model_path, tool_call_parser="hermes",
                              reasoning_parser="qwen3")
    app = ApiHost(settings).attach(client)
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        client.shutdown()


# --------------------------------------------------------------------------- run

def ask(client, model: str, sample: dict):
    extra = {} if sample["thinking"] else {"chat_template_kwargs": {"enable_thinking": False}}
    kwargs = dict(model=model, messages=sample["messages"], temperature=0,
                  max_tokens=200 if sample["thinking"] else 80, extra_body=extra)
    if sample["tools"]:
        kwargs["tools"] = sample["tools"]
    return client.chat.completions.create(**kwargs).choices[0].message


def evaluate(url: str, n: int, workers: int, show: int) -> dict[str, dict]:
    import openai

    from app.demo import data
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=600)
    model = client.models.list().data[0].id
    results = {}
    for kind, samples in data.eval_set(n).items():
        start = time.time()
        with ThreadPoolExecutor(workers) as pool:
            messages = list(pool.map(lambda s: ask(client, model, s), samples))
        ok = [passed(kind, s, m) for s, m in zip(samples, messages)]
        results[kind] = dict(correct=sum(ok), total=len(ok), rate=sum(ok) / len(ok))
        diag = ([restated(s, m) for s, m in zip(samples, messages)] if kind in ARITH else
                [args_only(s, m) for s, m in zip(samples, messages)] if kind == "tool_call" else [])
        if diag:
            results[kind]["diagnostic"] = sum(diag) / len(diag)
        print(f"{kind}: {sum(ok)}/{len(ok)}" + (f", diagnostic {sum(diag)}/{len(diag)}" if diag else "")
              + f" ({time.time() - start:.0f} s)", flush=True)
        for s, m, good in list(zip(samples, messages, ok))[:show]:
            thought = getattr(m, "reasoning_content", None) or ""
            calls = [c.function.name + c.function.arguments for c in m.tool_calls or []]
            print(f"  {'ok ' if good else 'BAD'} {s['messages'][-1]['content']!r} -> "
                  f"think {thought!r} content {m.content!r} calls {calls}")
    return results


ARITH = ("add", "add_think", "mul21", "mul21_think", "mul22_think")


def table(results: dict[str, dict]) -> str:
    """Exact match per row, plus a diagnostic column: for arithmetic the share of replies
    that restate the problem right (`a op b = `), for tool calls the share with the right
    arguments whatever the function name."""
    lines = ["| task (held-out, greedy) | exact match | target | diagnostic |",
             "| --- | --- | --- | --- |"]
    for kind, (label, target) in ROWS.items():
        r = results[kind]
        mark = "" if r["rate"] >= target else " (below target)"
        diag = r.get("diagnostic")
        note = "" if diag is None else (f"problem restated: {diag:.0%}" if kind in ARITH
                                        else f"arguments right: {diag:.0%}")
        lines.append(f"| {label} | {r['rate']:.0%} ({r['correct']}/{r['total']}) | "
                     f"{target:.0%}{mark} | {note} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the bundled actors/demo_model")
    p.add_argument("--n", type=int, default=100, help="problems per row")
    p.add_argument("--workers", type=int, default=16, help="concurrent requests")
    p.add_argument("--inproc", action="store_true",
                   help="skip `shoal serve`: the HTTP API in this process")
    p.add_argument("--startup-timeout", type=float, default=240)
    p.add_argument("--show", type=int, default=2, help="examples printed per row")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    how = "shoal serve (Ray Serve, HTTP on 127.0.0.1)"
    with contextlib.ExitStack() as stack:
        # A training run (make demo-model) gives the cores back while this runs.
        stack.callback(mark_test_run().unlink, missing_ok=True)
        url = None
        if not args.inproc:
            url = stack.enter_context(shoal_serve(args.model_path, args.startup_timeout,
                                                  "build/demo_eval_serve.log"))
            if url is None:
                print("`shoal serve` did not come up (see build/demo_eval_serve.log); "
                      "falling back to the in-process HTTP API", flush=True)
        if url is None:
            how = "in-process HTTP API (app.api.app + LocalEngineClient under uvicorn)"
            url = stack.enter_context(inproc_server(args.model_path))
        print(f"evaluating through {how} at {url}", flush=True)
        start = time.time()
        results = evaluate(url, args.n, args.workers, args.show)
    print(f"\nserver: {how}; {time.time() - start:.0f} s\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": how, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
