"""Drive headless Chromium over the DevTools protocol (a websocket), for the chat-page test.

Starts `chromium --headless` with a fresh profile and an ephemeral debugging port, opens a URL, and
evaluates JavaScript in the page. Every wait is bounded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class HeadlessChromium:
    def __init__(self, start_timeout_s: float = 30.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed (make browser)")
        self.profile = Path(tempfile.mkdtemp(prefix="rd-chromium-"))
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + start_timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        self.port = int(port_file.read_text().split()[0])
        self._ws: Any = None
        self._id = 0

    def open(self, url: str, timeout_s: float = 30.0) -> None:
        from websockets.sync.client import connect

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=timeout_s) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        self._ws = connect(pages[0]["webSocketDebuggerUrl"], open_timeout=timeout_s, max_size=2**24)
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout_s)

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, poll_s: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page condition not met within {timeout_s:g}s: {expression}")
            time.sleep(poll_s)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chat_in_page(base_url: str, api_key: str | None, message: str, timeout_s: float) -> dict[str, Any]:
    """Open the chat page, send one message, wait for the streamed answer; returns what the page shows."""
    with HeadlessChromium() as browser:
        browser.open(base_url + "/", timeout_s=timeout_s)
        if api_key:
            browser.eval(f"const k = document.getElementById('key'); k.value = {json.dumps(api_key)};"
                         "k.dispatchEvent(new Event('change')); true")
        browser.wait_for("!document.getElementById('model').textContent.includes('…')", timeout_s)
        browser.eval(f"document.getElementById('input').value = {json.dumps(message)};"
                     "document.getElementById('form').requestSubmit(); true")
        browser.wait_for("(() => { const m = document.querySelectorAll('.msg.assistant');"
                         " return m.length > 0 && m[m.length - 1].dataset.done === 'true'; })()", timeout_s)
        return browser.eval("""(() => {
            const m = document.querySelectorAll('.msg.assistant'); const last = m[m.length - 1];
            return {answer: last.textContent, error: last.classList.contains('error'),
                    user: document.querySelector('.msg.user').textContent,
                    model: document.getElementById('model').textContent,
                    stats: document.getElementById('stats').textContent};
        })()""")
