"""End to end on every store: checkpoint a real job with CRIU, push the image, pull it back,
restore it, and check that the job continued exactly (same memory, counter past the dump)."""

from __future__ import annotations

import shutil
from pathlib import Path

from spotguard.image import ImageSettings, latest_image, pull_image, push_dir, verify_image

S = ImageSettings(chunk_size=1 << 20, workers=2, max_inflight_mb=16)


async def test_checkpoint_push_pull_restore_continues(
    counter_job,  # type: ignore[no-untyped-def]
    store_url: str,
    tmp_path: Path,
) -> None:
    counter_job.start()
    images = tmp_path / "dump"
    token, n, crc_now, crc0 = counter_job.dump(images)
    assert crc_now == crc0

    pushed = await push_dir(images, store_url, "counter", {"dumped_at": n}, settings=S)
    assert pushed.manifest.totals.bytes > 1 << 20  # the job's memory is in there
    assert await latest_image(store_url, "counter", settings=S) == pushed.image_url
    report = await verify_image(pushed.image_url, settings=S)
    assert report.ok and report.bytes > 0
    shutil.rmtree(images)  # the VM is gone: only the store has the image

    restored = tmp_path / "restored"
    pulled = await pull_image(f"{store_url}/counter/images/latest", restored, settings=S)
    assert pulled.manifest.meta == {"dumped_at": n}
    counter_job.restore(restored)
    t2, n2, crc2, crc02 = counter_job.wait_for(lambda s: s[1] > n + 5)
    assert t2 == token  # the same process memory, not a fresh start
    assert (crc2, crc02) == (crc0, crc0)  # 2 MiB of random memory came back bit-exact
    assert n2 > n
