"""Headless Chromium driven over the Chrome DevTools Protocol (a websocket: aiohttp's client),
for the web page tests: navigate, type, click, read the DOM, take screenshots, and record what
went wrong in the page (script exceptions, console errors, Content-Security-Policy
violations) and every request the page made (URL and headers)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

#: where Chromium is looked for when SPOTGUARD_CHROMIUM does not say
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome", "chrome-headless-shell")


def find_chromium() -> str | None:
    """A Chromium to drive: ``$SPOTGUARD_CHROMIUM``, else the first of :data:`CANDIDATES` on
    PATH (scripts/install-chromium installs Debian's ``chromium``)."""
    given = os.environ.get("SPOTGUARD_CHROMIUM")
    if given:
        return given if os.access(given, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Request:
    url: str
    method: str
    headers: dict[str, str]


@dataclass
class Page:
    """One tab, with the problems and requests seen in it."""

    ws: aiohttp.ClientWebSocketResponse
    problems: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    _next: int = 0
    _waiting: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _loaded: asyncio.Event = field(default_factory=asyncio.Event)
    _reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._waiting.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                self._event(data["method"], data.get("params", {}))
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the browser closed the connection"))

    def _event(self, method: str, p: dict[str, Any]) -> None:
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.problems.append(
                f"exception: {d.get('exception', {}).get('description') or d.get('text')}"
            )
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description", "")) for a in p.get("args", [])]
            self.problems.append("console: " + " ".join(map(str, args)))
        elif method == "Log.entryAdded":
            e = p.get("entry", {})
            if e.get("level") == "error":
                self.problems.append(f"log ({e.get('source')}): {e.get('text')}")
        elif method == "Network.requestWillBeSent":
            r = p.get("request", {})
            self.requests.append(
                Request(r.get("url", ""), r.get("method", ""), r.get("headers", {}))
            )

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next] = fut
        await self.ws.send_str(json.dumps({"id": self._next, "method": method, "params": params}))
        answer = await asyncio.wait_for(fut, 30)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def navigate(self, url: str) -> None:
        self._loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self._loaded.wait(), 30)

    async def eval(self, expression: str) -> Any:
        """The value of ``expression`` in the page (a promise is awaited)."""
        r = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    async def wait_for(self, expression: str, what: str, limit: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy (for at most ``limit`` seconds); its value."""
        loop = asyncio.get_running_loop()
        end = loop.time() + limit
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if loop.time() > end:
                text = await self.eval("document.body.innerText")
                raise AssertionError(f"timed out waiting for {what}; the page shows:\n{text}")
            await asyncio.sleep(0.1)

    async def type_text(self, selector: str, text: str) -> None:
        """Focus ``selector`` and type ``text`` as keyboard input."""
        await self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)

    async def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.send(
                "Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                windowsVirtualKeyCode=13, text="\r" if kind == "keyDown" else "",
            )  # fmt: skip

    async def click(self, selector: str) -> None:
        """A real mouse click at the middle of ``selector``'s box."""
        box = await self.eval(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left",
                clickCount=1,
            )  # fmt: skip

    async def screenshot(self, path: Path) -> bytes:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        data = base64.b64decode(shot["data"])
        await asyncio.to_thread(path.write_bytes, data)
        return data


class Browser:
    """``async with Browser(exe, profile_dir) as page:`` one headless Chromium and its tab."""

    def __init__(self, exe: str, profile: Path) -> None:
        self.exe, self.profile = exe, profile
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp = tempfile.mkdtemp(prefix="sg-chromium-")
        self.session: aiohttp.ClientSession | None = None
        self.page: Page | None = None

    async def __aenter__(self) -> Page:
        self.profile.mkdir(parents=True, exist_ok=True)
        args = [
            self.exe, "--headless=new", "--disable-gpu", "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-background-networking", "--disable-sync",
            "--disable-dev-shm-usage", "--window-size=1400,1000", "--hide-scrollbars",
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        log = (self.profile / "chromium.log").open("wb")
        self.proc = await asyncio.to_thread(
            subprocess.Popen,
            [*args, "about:blank"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # its temp dirs (org.chromium.Chromium.*) in one of ours, removed on exit: killed
            # with SIGKILL below, it never removes them (/tmp kept two per UI test run); short,
            # for the socket path inside it
            env={**os.environ, "TMPDIR": self.tmp},
        )
        log.close()
        port_file = self.profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip():
                break
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"chromium exited with {self.proc.returncode}: "
                    + (self.profile / "chromium.log").read_text()[-2000:]
                )
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("chromium did not open its DevTools port in 30 s")
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            targets = await r.json()
        target = next(t for t in targets if t.get("type") == "page")
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        self.page = Page(ws)
        self.page.start()
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self.page.send(f"{domain}.enable")
        return self.page

    async def __aexit__(self, *exc: object) -> None:
        if self.page is not None:
            await self.page.ws.close()
            if self.page._reader is not None:
                self.page._reader.cancel()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)
