"""The image choice is a collaborator of the reconcile loop, built on its own: the settings it
reads and one way to write (``persist``), nothing else. Driven here directly against a real
SQLite state file and a real ``file://`` store holding real pushed images — no controller,
no loop, no provider."""

from __future__ import annotations

from pathlib import Path

from spotguard.controller.images import ImageChoice, Mutate
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import Change, JobRecord, JobState, StateDB
from spotguard.image import ImageSettings, push_dir


async def _image(tmp_path: Path, job: str, n: int) -> str:
    src = tmp_path / f"img-{n}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(bytes([n]) * 4096)
    pushed = await push_dir(src, f"file://{tmp_path}/store", job, {}, settings=ImageSettings())
    return pushed.image_url


async def _choice(tmp_path: Path) -> tuple[ImageChoice, StateDB, list[str]]:
    """An ImageChoice whose writes go through the state DB (as the reconciler's do), and the
    reasons of the changes it made."""
    db = await StateDB.open(tmp_path / "c.db")
    made: list[str] = []

    async def persist(
        rec: JobRecord, mutate: Mutate, *, expect: JobState | None = None
    ) -> JobRecord | None:
        want = expect or rec.state

        def fn(r: JobRecord | None) -> Change | None:
            if r is None or r.state is not want:
                return None
            out = mutate(r)
            if out is not None:
                made.append(out.reason)
            return out

        return (await db.change(rec.name, fn))[0]

    settings = ControllerSettings(default_store=f"file://{tmp_path}/store")
    return ImageChoice(settings, ImageSettings(), persist), db, made


async def _job(db: StateDB, name: str, image_url: str | None = None, **data: object) -> JobRecord:
    def create(r: JobRecord | None) -> Change:
        rec = JobRecord(name=name, state=JobState.LAUNCHING, image_url=image_url)
        for k, v in data.items():
            setattr(rec.data, k, v)
        return Change(rec, "created")

    rec, _ = await db.change(name, create)
    assert rec is not None
    return rec


async def test_the_older_image_is_chosen_and_persisted_through_the_given_writer(
    tmp_path: Path,
) -> None:
    choice, db, made = await _choice(tmp_path)
    first = await _image(tmp_path, "j", 1)
    second = await _image(tmp_path, "j", 2)
    rec = await _job(db, "j", second, bad_images=[second], older_image=True)
    assert (await choice.images(rec))[0] == [first, second]  # oldest sequence first
    got = await choice.older_image(rec)
    assert got is not None and got.image_url == first
    stored = await db.get("j")
    assert stored is not None and stored.image_url == first and not stored.data.older_image
    assert made == [f"falling back to the older image {first} ({second} cannot be restored)"]
    await db.close()


async def test_no_older_image_fails_the_job_saying_why(tmp_path: Path) -> None:
    choice, db, made = await _choice(tmp_path)
    only = await _image(tmp_path, "k", 1)
    rec = await _job(db, "k", only, bad_images=[only], older_image=True)
    assert await choice.older_image(rec) is None
    stored = await db.get("k")
    assert stored is not None and stored.state is JobState.FAILED
    assert "no older complete image exists (1 complete, none older)" in (stored.reason or "")
    assert len(made) == 1
    await db.close()
