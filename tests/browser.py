"""Headless Chromium driven over the DevTools protocol: just enough to use a web page.

No browser download and no driver: Debian's `chromium` binary, started with
--remote-debugging-port=0 (it writes the port it took to DevToolsActivePort), and a
WebSocket (the `websockets` package) to one page target. Everything on 127.0.0.1.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0"]


def find_chromium() -> str | None:
    """$SHOAL_CHROMIUM, else the first Chromium-like binary on PATH; None if there is none."""
    given = os.environ.get("SHOAL_CHROMIUM")
    names = [given] if given else CANDIDATES
    return next(filter(None, map(shutil.which, names)), None)


class Page:
    """One tab: `call` a CDP method, `js` to evaluate, `wait_for` a JS condition."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect
        self.stack = contextlib.ExitStack()  # newer websockets wants connect() as a context
        self.ws = self.stack.enter_context(connect(ws_url, max_size=None, open_timeout=30))
        self.ids = itertools.count(1)

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:  # skip events and late answers: only our id answers this call
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30, what: str = ""):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"waited {timeout}s for {what or expression}")

    def type_into(self, selector: str, text: str) -> None:
        """Focus an element and type like a user would (input events fire)."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'",
                      what=f"{url} to load")

    def close(self) -> None:
        self.stack.close()


def debugging_port(profile: str, proc: subprocess.Popen, timeout: float = 60) -> int:
    path = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                return int(f.readline())
        time.sleep(0.1)
    raise TimeoutError("chromium did not open its debugging port")


def page_target(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
        targets = json.load(resp)
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


@contextlib.contextmanager
def chromium_page(binary: str):
    """A fresh headless Chromium (own throwaway profile) and its first tab."""
    with tempfile.TemporaryDirectory(prefix="shoal-chromium-") as profile:
        # Its own process group: the renderer and helper processes go down with the browser.
        proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        page = None
        try:
            page = Page(page_target(debugging_port(profile, proc)))
            yield page
        finally:
            if page is not None:
                page.close()
            stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
