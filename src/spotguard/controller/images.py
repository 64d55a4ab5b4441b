"""Which image a relaunch restores, and what it needs: the store's newest complete image when
no report named one, the newest *older* complete image when one could not be restored (its
fault: ``ImageCorrupt``, a missing image), and the launch spec read from the manifest.

:class:`ImageChoice` is a collaborator the :class:`~spotguard.controller.reconcile.Reconciler`
holds: it gets the settings it reads and one narrow way to write, a :class:`Persist` (the
reconciler's ``set``: one transaction, only while the job is still where it was, a history
line saying why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from spotguard.controller.imagefacts import image_spec
from spotguard.controller.ownership import relaunch
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import Change, JobRecord, JobState
from spotguard.errors import SpotguardError
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import LaunchSpec

log = logging.getLogger(__name__)

Mutate = Callable[[JobRecord], Change | None]


def store_of(rec: JobRecord, default: str | None) -> str | None:
    """The job's store: reported, else configured, else read off the image URL."""
    if rec.store:
        return rec.store
    if default:
        return default
    if rec.image_url and f"/{rec.name}/images/" in rec.image_url:
        return rec.image_url.rsplit(f"/{rec.name}/images/", 1)[0]
    return None


class Persist(Protocol):
    """Persist ``mutate(record)`` if the job is still in ``expect`` (default: the state
    ``rec`` is in) and in the same launch round; the record after it, or None."""

    async def __call__(
        self, rec: JobRecord, mutate: Mutate, *, expect: JobState | None = None
    ) -> JobRecord | None: ...


def failed(reason: str) -> Mutate:
    """A change to FAILED saying ``reason`` (logged)."""

    def mutate(r: JobRecord) -> Change:
        r.state = JobState.FAILED
        r.reason = reason
        log.error("job failed", extra={"job": r.name, "reason": reason})
        return Change(r, reason)

    return mutate


class ImageChoice:
    """Image choices of the reconcile loop (see the module doc): what it reads (the
    controller's settings, the controller host's image settings) and how it writes
    (``persist``) are given, nothing else."""

    def __init__(
        self, settings: ControllerSettings, image_settings: ImageSettings, persist: Persist
    ) -> None:
        self.settings = settings
        self.image_settings = image_settings
        self.persist = persist

    async def images(self, rec: JobRecord) -> tuple[list[str], str]:
        """URLs of the job's complete (and, with keys, authenticated) images in its store,
        oldest sequence first — and, when there are none, why (no store known, store
        unreadable, nothing there)."""
        store_url = store_of(rec, self.settings.default_store)
        if store_url is None:
            return [], "no store is known for the job"
        from spotguard.image.history import genuine_images
        from spotguard.image.keys import ImageKeys
        from spotguard.image.manifest import ImageRef
        from spotguard.image.writer import store_for

        try:
            store = store_for(store_url, self.image_settings)
            try:
                # by authenticated sequence: only images this host's keys accept
                keys = ImageKeys.from_settings(self.image_settings)
                ids = [g.image_id for g in await genuine_images(store, rec.name, keys)]
                urls = [ImageRef(store.url, rec.name, i).url for i in ids]
            finally:
                await store.aclose()
        except SpotguardError as exc:
            return [], f"store {store_url}: {exc}"
        return urls, f"store {store_url} holds no complete image of {rec.name}"

    async def fallback(self, rec: JobRecord) -> None:
        """No durable image reported after a notice that ended the VM: relaunch from the
        store's newest complete image, or FAIL saying why there is none."""
        urls, why = await self.images(rec)
        url = urls[-1] if urls else None
        if url is None:
            await self.persist(rec, failed(f"no durable image after the notice and {why}"))
            return
        chosen = url

        def mutate(r: JobRecord) -> Change:
            r.image_url = chosen
            r.data.fallback_now = False
            return relaunch(
                r,
                f"no durable image reported; relaunching from the newest image {chosen}",
                drain=False,
                terminate_old=self.settings.terminate_old,
            )

        await self.persist(rec, mutate)

    async def spec_from_image(self, rec: JobRecord) -> JobRecord:
        """Before a round: the launch spec from the image's manifest, once per image.

        The manifest's GPU facts describe what restoring that image needs, so they win over
        what reports said (or did not say: a fall-back without a DURABLE report, or a report
        without GPU facts). An unreadable manifest keeps the recorded spec and says why.
        """
        url = rec.image_url
        if not url or rec.data.spec_image == url:
            return rec
        recorded = LaunchSpec.from_json(rec.spec)
        try:
            spec = await image_spec(url, recorded, self.image_settings)
        except SpotguardError as exc:
            msg = f"cannot read the manifest of {url} ({exc}); launching for the reported facts"
            log.warning("image manifest unreadable", extra={"job": rec.name, "error": str(exc)})

            def keep(r: JobRecord) -> Change:
                r.data.spec_image = url
                return Change(r, msg, note=True)

            return await self.persist(rec, keep) or rec

        def adopt(r: JobRecord) -> Change:
            r.data.spec_image = url
            if spec is None:
                msg = f"the manifest of {url} holds no GPU facts; keeping the reported spec"
                return Change(r, msg, note=True)
            r.spec = spec.to_json()
            where = spec.instance_type or "any type"
            return Change(
                r,
                f"launch spec from the image's manifest: {spec.describe_gpus()}, ran on {where} "
                f"(reports said {recorded.describe_gpus()})",
                {"spec": r.spec},
                note=True,
            )

        return await self.persist(rec, adopt) or rec

    async def older_image(self, rec: JobRecord) -> JobRecord | None:
        """After a restore failed for the image's fault: the newest complete image older
        than every image known bad becomes the one to restore, or the job FAILS saying
        there is none (never a round for an image that can never restore)."""
        bad = rec.data.bad_images
        urls, why = await self.images(rec)  # oldest authenticated sequence first
        # "older" by the store's sequence, never by ids (wall clocks of possibly skewed VMs);
        # a bad image the store does not list (missing) cuts nothing
        cut = min((urls.index(u) for u in bad if u in urls), default=len(urls))
        older = [u for u in urls[:cut] if u not in bad]
        if not older:
            reason = (
                f"image {rec.image_url} cannot be restored and no older complete image exists "
                f"({why if not urls else f'{len(urls)} complete, none older'})"
            )
            await self.persist(rec, failed(reason))
            return None
        chosen = older[-1]

        def adopt(r: JobRecord) -> Change:
            was = r.image_url
            r.image_url = chosen
            r.data.older_image = False
            r.reason = f"falling back to the older image {chosen} ({was} cannot be restored)"
            log.warning("older image", extra={"job": r.name, "image": chosen, "reason": r.reason})
            return Change(
                r, r.reason, {"image_url": chosen, "bad_images": r.data.bad_images}, note=True
            )

        return await self.persist(rec, adopt)
