"""Client of the local agent API, used by ``spotguard drain`` and ``spotguard status``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from spotguard.errors import AuthError, SpotguardError

from .settings import parse_listen


async def call(
    listen: str,
    token: str,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """One request to the local API; any failure becomes a :class:`SpotguardError`."""
    where = parse_listen(listen)
    connector: aiohttp.BaseConnector
    if isinstance(where, Path):
        connector = aiohttp.UnixConnector(path=str(where))
        base = "http://localhost"
    else:
        connector = aiohttp.TCPConnector()
        host, port = where
        base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    try:
        async with (
            aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as session,
            session.request(method, base + path, json=body, headers=headers) as resp,
        ):
            data = await resp.json(content_type=None)
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise SpotguardError(f"the local agent at {listen} did not answer: {exc}") from exc
    if status == 401:
        raise AuthError(f"the local agent at {listen} refused the API token")
    if status >= 400:
        err = data.get("error") if isinstance(data, dict) else data
        raise SpotguardError(f"the local agent answered {status}: {err}")
    if not isinstance(data, dict):
        raise SpotguardError(f"the local agent answered something unexpected: {data!r}")
    return data
