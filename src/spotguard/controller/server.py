"""Run a controller: state file + provider + strategy + HTTP(S) API, as one async context.

Settings are loaded by the caller (the ``spotguard controller`` command) and passed in; the
provider is opened there too (:func:`spotguard.providers.open_provider`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable
from types import TracebackType

from aiohttp import web

from spotguard.controller.api import make_app
from spotguard.controller.core import Controller
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import StateDB
from spotguard.controller.strategies import get_strategy
from spotguard.errors import ConfigError
from spotguard.image.settings import ImageSettings
from spotguard.log import quiet_malformed_requests
from spotguard.notices.base import NoticeSource
from spotguard.notify import Notifier
from spotguard.providers.base import CloudProvider

log = logging.getLogger(__name__)


class ControllerServer:
    """``async with ControllerServer(settings, provider=p) as srv:`` serves until the block
    ends (HTTPS when ``settings`` names a certificate)."""

    def __init__(
        self,
        settings: ControllerSettings,
        *,
        provider: CloudProvider,
        image: ImageSettings,
        sources: Iterable[NoticeSource] = (),
        notifier: Notifier | None = None,
    ) -> None:
        self.settings = settings
        self.notifier = notifier
        self._provider = provider
        self._image = image
        self._sources = list(sources)
        self.port = 0

    async def __aenter__(self) -> ControllerServer:
        s = self.settings
        keys = s.token_keys()
        tls = s.tls()
        self.scheme = "https" if tls is not None else "http"
        strategy = get_strategy(s.strategy)
        host, port = s.host_port()
        self.db = await StateDB.open(
            s.state_path(), init=s.init_state, retention=s.event_retention()
        )
        if self.notifier is not None:
            self.db.on_transition = self.notifier.controller_transition
        try:
            provider = self._provider
            self.controller = Controller(
                s,
                self.db,
                provider,
                image=self._image,
                keys=keys,
                strategy=strategy,
                sources=self._sources,
            )
            quiet_malformed_requests()  # a request aiohttp cannot parse: a warning, no traceback
            self._runner = web.AppRunner(make_app(self.controller), access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port, ssl_context=tls)
            try:
                await site.start()
            except OSError as exc:
                raise ConfigError(f"cannot listen on {s.listen}: {exc}") from exc
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            self.port = sockets[0].getsockname()[1] if sockets else port
            if not s.advertise_url:
                self.controller.public_url = self.url
            await self.controller.start()
        except BaseException:
            await self.db.close()
            raise
        log.info(
            "controller listening",
            extra={"url": self.url, "provider": provider.name, "strategy": strategy.name},
        )
        return self

    @property
    def url(self) -> str:
        host, _ = self.settings.host_port()
        return f"{self.scheme}://{host}:{self.port}"

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.controller.stop()
        await self._runner.cleanup()
        await self.controller.provider.aclose()
        await self.db.close()
        if self.notifier is not None:
            await self.notifier.aclose()


async def serve_forever(
    settings: ControllerSettings,
    provider: CloudProvider,
    *,
    image: ImageSettings,
    sources: Iterable[NoticeSource] = (),
    notifier: Notifier | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (the ``spotguard controller`` command); ``sources`` are
    notice sources seen outside the VMs (the fleet queue)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sources = list(sources)
    for src in sources:
        log.info("watching fleet notices", extra={"source": src.name})
    async with ControllerServer(
        settings, provider=provider, image=image, sources=sources, notifier=notifier
    ):
        await stop.wait()
