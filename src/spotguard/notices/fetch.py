"""HTTP for the metadata sources: one keep-alive session per source, and the one place where
transport failures become :class:`~spotguard.errors.NoticeError` subclasses.

A source asks :meth:`MetadataHttp.request` for a URL and gets a :class:`Reply` for every answer
below 500 (it decides what 401 or 404 mean); refused connections, timeouts, resets and 5xx
answers raise :class:`~spotguard.errors.MetadataUnavailable`, bodies that are not text or not
JSON raise :class:`~spotguard.errors.MetadataMalformed`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from spotguard.errors import MetadataMalformed, MetadataUnavailable

#: largest metadata answer read; anything bigger is not what a metadata service sends
MAX_BODY = 1 << 20


@dataclass(frozen=True)
class Reply:
    """A metadata answer below 500."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    url: str = ""

    def text(self) -> str:
        """The body as UTF-8 text (garbage bytes are a malformed answer)."""
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MetadataMalformed(f"{self.url}: answer is not UTF-8 text") from exc

    def json(self) -> Any:
        """The body parsed as JSON (anything else is a malformed answer)."""
        try:
            return json.loads(self.text())
        except ValueError as exc:
            snippet = self.body[:60].decode("utf-8", "replace")
            raise MetadataMalformed(f"{self.url}: answer is not JSON: {snippet!r}") from exc


class MetadataHttp:
    """A lazily opened :class:`aiohttp.ClientSession` that keeps its connections alive between
    polls, with a per-request time limit."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No proxy from the environment: metadata services are link-local by definition.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=8, force_close=False), trust_env=False
            )
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        limit_s: float | None = None,
    ) -> Reply:
        """One request; a :class:`Reply` for answers below 500, typed errors otherwise."""
        session = self._open()
        limit = aiohttp.ClientTimeout(total=limit_s if limit_s is not None else self.timeout)
        try:
            async with session.request(
                method, url, headers=headers, params=params, json=json_body, timeout=limit
            ) as resp:
                body = await resp.content.read(MAX_BODY)
                reply = Reply(resp.status, body, dict(resp.headers), str(resp.url))
        except TimeoutError as exc:
            raise MetadataUnavailable(f"{method} {url}: no answer within {limit.total} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
            raise MetadataUnavailable(f"{method} {url}: {reason}") from exc
        if reply.status >= 500:
            raise MetadataUnavailable(f"{method} {url}: HTTP {reply.status}")
        return reply

    async def aclose(self) -> None:
        """Close the session and its connections (safe to call twice)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
            # let the connector's transports finish closing before the loop may stop
            await asyncio.sleep(0)
        self._session = None
