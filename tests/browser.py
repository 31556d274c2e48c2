"""A real headless Chromium driven over the DevTools protocol, for tests of HTML pages.

Chromium comes from the Debian package (``make test`` installs it: ``apt-get install chromium``);
``INFMEM_CHROMIUM`` names another binary. A missing browser is an error, never a skip: the page
tests are the only check that the viewer works. The client speaks the protocol over aiohttp's
WebSocket (already a dependency): start the browser on a free port with a fresh profile, open a
page target, send commands and collect the console errors and exceptions the page reports.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
)  # fmt: skip


def chromium_path() -> str:
    """The Chromium binary; a clear error when it is not installed."""
    path = os.environ.get("INFMEM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        raise RuntimeError(
            f"chromium not found (looked for {path}): the viewer's browser tests need it; "
            "`make test` installs it (apt-get install -y chromium), or set INFMEM_CHROMIUM"
        )
    return path


class Browser:
    """One Chromium process with one page; use as ``async with Browser(width, height) as page``."""

    def __init__(self, width: int = 1400, height: int = 1000):
        self.width, self.height = width, height
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._events: dict[str, list[asyncio.Future]] = {}

    async def __aenter__(self) -> Browser:
        self.profile = tempfile.mkdtemp(prefix="infmem-chromium-")
        self.process = subprocess.Popen(
            [chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = await self._port()
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1, mobile=False)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._reader.cancel()
        await self.ws.close()
        await self.session.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    async def _port(self, timeout: float = 30.0) -> int:
        """The DevTools port Chromium chose, from the ``DevToolsActivePort`` file of its profile."""
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.process.returncode} before opening DevTools")
            if marker.is_file():
                lines = marker.read_text().split()
                if lines:
                    return int(lines[0])
            await asyncio.sleep(0.1)
        raise RuntimeError(f"chromium did not open its DevTools port within {timeout:.0f} s")

    async def _read(self) -> None:
        async for message in self.ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            self._note(data["method"], data.get("params", {}))
            for future in self._events.pop(data["method"], []):
                if not future.done():
                    future.set_result(data.get("params", {}))

    def _note(self, method: str, params: dict) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append("log: " + params["entry"].get("text", ""))

    async def send(self, method: str, **params: Any) -> dict:
        number = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[number] = future
        await self.ws.send_str(json.dumps({"id": number, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def open(self, path: Path) -> None:
        """Load ``path`` from disk and wait for its load event."""
        loaded = asyncio.get_running_loop().create_future()
        self._events.setdefault("Page.loadEventFired", []).append(loaded)
        await self.send("Page.navigate", url=path.resolve().as_uri())
        await asyncio.wait_for(loaded, 60)

    async def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (exceptions raise)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait(self, selector: str, timeout: float = 10.0) -> None:
        """Wait until ``selector`` matches an element (events such as ``toggle`` fire asynchronously)."""
        deadline = time.monotonic() + timeout
        while not await self.eval(f"!!document.querySelector({json.dumps(selector)})"):
            if time.monotonic() > deadline:
                raise AssertionError(f"no element matched {selector!r} within {timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the centre of the first element ``selector`` matches."""
        box = await self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        if box is None:
            raise AssertionError(f"no element matches {selector!r}")
        for kind in ("mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    async def set_value(self, selector: str, value: str) -> None:
        """Set a form control's value as a person choosing it would: the value, then its input and change events."""
        await self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.value = {json.dumps(value)};"
            " e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change')); })()"
        )

    async def click_and_wait(self, selector: str, appears: str) -> None:
        """Click ``selector``, then wait for ``appears`` (what the click makes)."""
        await self.click(selector)
        await self.wait(appears)

    async def type(self, selector: str, text: str) -> None:
        """Focus ``selector`` and type ``text`` as keyboard input."""
        await self.click(selector)
        await self.send("Input.insertText", text=text)

    async def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])
        path.write_bytes(png)
        return png
