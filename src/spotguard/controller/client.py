"""A small client of the controller API, for the CLI (``jobs``, ``migrate``)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import aiohttp

from spotguard.errors import AuthError, ControllerError, JobNotFound, without_type


class ControllerClient:
    """``GET``/``POST`` JSON to the controller with the bearer token; errors are typed."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout_s: float = 30.0,
        ca_file: Path | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ssl: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                self.ssl = ssl.create_default_context(cafile=str(ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise ControllerError(f"CA file {ca_file} unusable: {exc}") from exc

    async def get(self, path: str) -> dict[str, Any]:
        return await self._call("GET", path, None)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", path, body)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as s,
                s.request(method, self.url + path, json=body, headers=headers, ssl=self.ssl) as r,
            ):
                try:
                    data: dict[str, Any] = await r.json(content_type=None)
                except ValueError:
                    data = {"error": (await r.text())[:200]}
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControllerError(f"controller at {self.url} unreachable: {exc!r}") from exc
        error = without_type(str(data.get("error")))  # read by people: no type name
        if status in (401, 403):
            raise AuthError(f"controller refused the token: {error}")
        if status == 404:
            raise JobNotFound(error)
        if status in (400, 409):
            raise ControllerError(f"the controller refused: {error}")
        if status >= 400:
            raise ControllerError(f"the controller failed (HTTP {status}): {error}")
        return data
