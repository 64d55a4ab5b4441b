"""The launch spec from an image's own manifest.

An image's manifest (``spotguard.image``, docs/image-format.md) is written unencrypted and its
``meta`` carries the engine's facts: ``gpu`` (a :class:`~spotguard.facts.GpuInventory`),
``host`` (architecture, kernel, CRIU) and ``instance`` (provider, type, region, zone). They
describe exactly what a restore of that image needs, so the controller reads them

* when it falls back to the store's newest image (no DURABLE report: the agent died), and
* when the DURABLE report it has lacks GPU facts,

instead of treating the job as CPU-only. Only the manifest is read — no chunk, no key.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from spotguard.errors import ImageError
from spotguard.facts import GpuDevice, GpuInventory, InstanceFacts
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import LaunchSpec

log = logging.getLogger(__name__)

_INSTANCE_FIELDS = ("provider", "instance_type", "region", "zone", "instance_id", "spot")


async def read_meta(image_url: str, settings: ImageSettings) -> dict[str, Any]:
    """The ``meta`` of the image's manifest (``…/images/latest`` resolves to the newest).

    Raises :class:`~spotguard.errors.ImageNotFound` without a manifest, other
    :class:`~spotguard.errors.ImageError` / :class:`~spotguard.errors.StoreError` /
    :class:`~spotguard.errors.ConfigError` for a malformed URL, manifest or store.
    """
    from spotguard.image.reader import ImageReader

    # The reader authenticates the manifest with this host's image keys (a store attacker
    # must not choose the GPU type and count): docs/security.md.
    async with ImageReader(image_url, settings=settings) as reader:
        return dict(reader.manifest.meta)


def _inventory(gpu: dict[str, Any]) -> GpuInventory:
    """The GPU inventory in ``meta["gpu"]``; a bare ``{"model", "count"}`` is accepted too."""
    try:
        inv = GpuInventory.from_json(gpu)
    except (TypeError, ValueError, KeyError) as exc:
        raise ImageError(f"manifest meta.gpu is malformed: {exc}") from exc
    count = gpu.get("count")
    if inv.count == 0 and isinstance(count, int) and count > 0:
        model = str(gpu.get("model") or "")
        devs = tuple(GpuDevice(i, "", model, 0) for i in range(count))
        inv = GpuInventory(devs, gpu.get("driver"))
    return inv


def spec_from_meta(meta: dict[str, Any], recorded: LaunchSpec) -> LaunchSpec | None:
    """The launch spec the image's facts call for (``None`` when ``meta`` has no ``gpu``).

    GPU model and count, driver major and architecture come from the image; where the job
    ran (type, region, zone — preferences for the strategies) comes from the image's instance
    facts, else from the ``recorded`` spec, which also keeps its memory minimum.
    """
    gpu = meta.get("gpu")
    if not isinstance(gpu, dict):
        return None
    inv = _inventory(gpu)
    found = meta.get("instance")
    raw_inst: dict[str, Any] = found if isinstance(found, dict) else {}
    inst = InstanceFacts(**{k: raw_inst[k] for k in _INSTANCE_FIELDS if k in raw_inst})
    host = meta.get("host") if isinstance(meta.get("host"), dict) else None
    spec = LaunchSpec.from_facts(inv, inst, host, recorded.min_memory_mib)
    return replace(
        spec,
        arch=spec.arch or recorded.arch,
        instance_type=spec.instance_type or recorded.instance_type,
        region=spec.region or recorded.region,
        zone=spec.zone or recorded.zone,
    )


async def image_spec(
    image_url: str, recorded: LaunchSpec, settings: ImageSettings
) -> LaunchSpec | None:
    """:func:`spec_from_meta` of the image at ``image_url`` (reads its manifest)."""
    meta = await read_meta(image_url, settings)
    spec = spec_from_meta(meta, recorded)
    log.info(
        "launch spec from image manifest",
        extra={
            "image": image_url,
            "gpus": spec.describe_gpus() if spec is not None else "no gpu facts",
        },
    )
    return spec
