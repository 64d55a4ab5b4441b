"""Park to and unpark from a store URL through the same checkpoint/restore composition the
agent uses (streamed or staged, chunked, verified), so a parked image is an ordinary image:
the controller can relaunch it anywhere."""

from __future__ import annotations

from spotguard import operations
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image.settings import ImageSettings

from .core import OwnedElsewhere, StorePath


def store_path(
    settings: CheckpointSettings,
    image: ImageSettings,
    engine: Engine,
    owned_elsewhere: OwnedElsewhere | None = None,
) -> StorePath:
    """A :class:`StorePath` over :mod:`spotguard.operations` with these settings;
    ``owned_elsewhere`` is asked before a store park is restored (the controller's word)."""

    async def checkpoint(job: JobInfo, url: str) -> tuple[str, int]:
        res = await operations.checkpoint(
            job,
            url,
            mode=Mode.EXIT,
            settings=settings,
            engine=engine,
            image_settings=image,
            meta={"parked": True},
        )
        return res.image_url, res.bytes

    async def restore(url: str) -> int:
        res = await operations.restore(url, settings=settings, engine=engine, image_settings=image)
        return res.pid

    return StorePath(checkpoint, restore, owned_elsewhere)
