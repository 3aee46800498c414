"""Headless Chromium (Debian's ``chromium``) driven through the Chrome DevTools Protocol over its websocket: open a
page, run JavaScript in it, collect its console errors and uncaught exceptions, take a screenshot."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with one page (``close()`` ends it).

    Args:
        profile: an empty folder for the browser's profile (it writes the DevTools port there).
    """

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        import websocket  # websocket-client (the test extras)

        assert CHROMIUM is not None, "chromium is not installed"
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"],
            # the browser gets no preloaded BLAS (CI's second pass preloads OpenBLAS into every process it starts)
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._port(profile / "DevToolsActivePort")
        target = self._page_target(port)
        self.ws = websocket.create_connection(target, timeout=30, suppress_origin=True)
        self._next = 0
        self.errors: list[str] = []  # console.error calls and uncaught exceptions, as text
        self.call("Runtime.enable")
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _port(self, path: Path, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    @staticmethod
    def _page_target(port: int) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        return pages[0]["webSocketDebuggerUrl"]

    def call(self, method: str, **params: Any) -> dict:
        """Send one DevTools command and wait for its result (events meanwhile are recorded)."""
        self._next += 1
        ident = self._next
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Wait until ``expression`` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout}s for {expression!r}; errors: {self.errors}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(png)
        return png

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
