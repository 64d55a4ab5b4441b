"""A client for the emulator's control API (used by ``spotguard notice ...`` and tests).

Example::

    async with SimClient("http://127.0.0.1:1338") as sim:
        notice = await sim.send("aws", "preempt", action="terminate", in_seconds=120)
        await sim.cancel(notice["id"])
"""

from __future__ import annotations

import json
import os
from types import TracebackType
from typing import Any

import aiohttp

from spotguard.config import check_http_url
from spotguard.errors import SimulatorError

SIM_URL_ENV = "SPOTGUARD_SIM_URL"
DEFAULT_URL = "http://127.0.0.1:1338"


class SimClient:
    """Async client of one emulator; ``url`` defaults to ``$SPOTGUARD_SIM_URL``."""

    def __init__(self, url: str | None = None, *, timeout: float = 5.0) -> None:
        url = url or os.environ.get(SIM_URL_ENV) or DEFAULT_URL
        self.url = check_http_url(url, "metadata-sim URL").rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SimClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), trust_env=False
            )
        url = f"{self.url}/_sim/{path}"
        try:
            async with self._session.request(method, url, json=body) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise SimulatorError(f"metadata-sim at {self.url} is unreachable: {exc}") from exc
        try:
            data = json.loads(text) if text else None
        except ValueError as exc:
            raise SimulatorError(f"{method} {url}: answer is not JSON") from exc
        if status >= 400:
            reason = data.get("error") if isinstance(data, dict) else text[:200]
            raise SimulatorError(f"metadata-sim refused {method} {path}: {reason}")
        return data

    async def send(
        self,
        cloud: str,
        kind: str,
        *,
        action: str | None = None,
        in_seconds: float | None = None,
        notice_id: str | None = None,
    ) -> dict[str, Any]:
        """Inject a notice; returns it (with its ``id``)."""
        body: dict[str, Any] = {"cloud": cloud, "kind": kind}
        for key, value in (("action", action), ("in_seconds", in_seconds), ("id", notice_id)):
            if value is not None:
                body[key] = value
        result: dict[str, Any] = await self._call("POST", "notices", body)
        return result

    async def update(self, notice_id: str, **changes: Any) -> dict[str, Any]:
        """Change a notice's ``action``, ``in_seconds`` or ``state``."""
        result: dict[str, Any] = await self._call("PATCH", f"notices/{notice_id}", changes)
        return result

    async def cancel(self, notice_id: str) -> dict[str, Any]:
        """Withdraw a notice."""
        result: dict[str, Any] = await self._call("DELETE", f"notices/{notice_id}")
        return result

    async def notices(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._call("GET", "notices")
        return result

    async def fault(self, mode: str, **options: Any) -> dict[str, Any]:
        """Make matching metadata requests fail (see the control API for ``options``)."""
        result: dict[str, Any] = await self._call("POST", "faults", {"mode": mode, **options})
        return result

    async def clear_faults(self) -> None:
        await self._call("DELETE", "faults")

    async def instance(self, **changes: Any) -> dict[str, Any]:
        """Change instance facts (no arguments: read them)."""
        if not changes:
            result: dict[str, Any] = await self._call("GET", "instance")
        else:
            result = await self._call("POST", "instance", changes)
        return result

    async def configure(self, **options: Any) -> dict[str, Any]:
        """Set ``max_token_ttl`` and/or ``imdsv1``."""
        result: dict[str, Any] = await self._call("POST", "config", options)
        return result

    async def revoke_tokens(self) -> int:
        result = await self._call("DELETE", "tokens")
        return int(result["revoked"])

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "stats")
        return result

    async def reset(self) -> None:
        await self._call("POST", "reset")
