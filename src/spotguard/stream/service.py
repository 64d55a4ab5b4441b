"""What the capture and serve sides share: one CRIU streamer socket in the images directory,
served by a background task, used as an async context manager that aborts a service still
running on exit (CRIU then sees its pipes close) and removes the socket."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self


class SocketService(ABC):
    """Base of :class:`~spotguard.stream.capture.Capture` and
    :class:`~spotguard.stream.serve.Serve`; subclasses set ``SOCKET`` and implement
    ``start`` (listen, then run ``_task``) and ``abort``."""

    SOCKET: ClassVar[str]
    images_dir: Path
    _task: asyncio.Task[None] | None = None

    @property
    def socket_path(self) -> Path:
        return self.images_dir / self.SOCKET

    @abstractmethod
    async def start(self) -> None:
        """Listen on :attr:`socket_path`, then serve in ``_task``."""

    @abstractmethod
    async def abort(self) -> None:
        """Stop a service still running (CRIU then sees its pipes close)."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None and not self._task.done():
            await self.abort()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
