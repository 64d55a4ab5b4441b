"""An image's metadata (``spotguard-image.json``) carries its mode as a :class:`Mode`; images
written before it was typed hold the same strings and read as the same modes. A mode this
version does not know makes the metadata unreadable (one :class:`ImageError`, no traceback).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotguard.checkpoint.meta import META_NAME, ImageMeta
from spotguard.errors import ImageError
from spotguard.modes import Mode

#: the metadata of an image written by an earlier version (schema 2, ``mode`` a string)
OLD = {
    "schema": 2, "job": {"name": "train", "pid": 4410}, "mode": "exit", "criu_version": "4.2.1",
    "host": {"arch": "x86_64", "kernel": "6.1", "memory_total": 1 << 30},
    "gpu_processes": [], "root_ns_pid": 1, "pids": [1], "staging": {}, "timeline": [],
}  # fmt: skip


@pytest.mark.parametrize(("text", "mode"), [("exit", Mode.EXIT), ("resume", Mode.RESUME)])
def test_an_older_image_reads_its_mode_as_a_mode(tmp_path: Path, text: str, mode: Mode) -> None:
    (tmp_path / META_NAME).write_text(json.dumps({**OLD, "mode": text}))
    meta = ImageMeta.read(tmp_path)
    assert meta.mode is mode
    meta.write(tmp_path)  # written back: the same string in the file
    assert json.loads((tmp_path / META_NAME).read_text())["mode"] == text
    assert ImageMeta.read(tmp_path).mode is mode


def test_an_unknown_mode_makes_the_metadata_unreadable(tmp_path: Path) -> None:
    (tmp_path / META_NAME).write_text(json.dumps({**OLD, "mode": "pause"}))
    with pytest.raises(ImageError, match="unreadable"):
        ImageMeta.read(tmp_path)


def test_listening_ports_round_trip_and_older_images_have_none(tmp_path: Path) -> None:
    (tmp_path / META_NAME).write_text(json.dumps(OLD))
    meta = ImageMeta.read(tmp_path)
    assert meta.listen_ports == []
    meta.listen_ports = [8700, 29500]
    meta.write(tmp_path)
    assert ImageMeta.read(tmp_path).listen_ports == [8700, 29500]


@pytest.mark.parametrize("port", [0, 70000, "29500", True, -1])
def test_a_listening_port_that_is_no_port_makes_the_metadata_unreadable(
    tmp_path: Path, port: object
) -> None:
    (tmp_path / META_NAME).write_text(json.dumps({**OLD, "listen_ports": [port]}))
    with pytest.raises(ImageError, match="listen_ports"):
        ImageMeta.read(tmp_path)


def _range(ns_pid: int, start: int, prefix: str) -> dict[str, object]:
    size = 256 << 20
    part = {"name": f"{prefix}-{ns_pid}-{start:x}-0", "offset": 0, "size": size}
    return {"ns_pid": ns_pid, "start": start, "end": start + size, "parts": [part]}


def test_the_jobs_own_memory_beside_criu_round_trips_as_schema_5_and_none_as_4(
    tmp_path: Path,
) -> None:
    """An image carrying ``cpu_pages`` is written as schema 5, which an older spotguard
    refuses (it would restore the job without that memory); one without stays 4."""
    base = {**OLD, "schema": 4, "pids": [1, 2]}
    (tmp_path / META_NAME).write_text(json.dumps(base))
    meta = ImageMeta.read(tmp_path)
    meta.write(tmp_path)
    assert json.loads((tmp_path / META_NAME).read_text())["schema"] == 4
    (tmp_path / META_NAME).write_text(
        json.dumps({**base, "cpu_pages": [_range(2, 0x7F0000000000, "cpupages")]})
    )
    meta = ImageMeta.read(tmp_path)
    [carried] = meta.cpu_pages
    assert (carried.ns_pid, carried.prefix) == (2, "cpupages")
    meta.write(tmp_path)
    assert json.loads((tmp_path / META_NAME).read_text())["schema"] == 5
    assert ImageMeta.read(tmp_path).cpu_pages == [carried]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"cpu_pages": [_range(7, 0x7F0000000000, "cpupages")]}, "not a process of the image"),
        ({"cpu_pages": [_range(2, 0x7F0000000000, "gpupages")]}, "part name"),
        (
            {"gpu_processes": [2], "gpu_pages": [_range(2, 0x7F0000000000, "cpupages")]},
            "part name",
        ),
        (
            {
                "gpu_processes": [2],
                "gpu_pages": [_range(2, 0x7F0000000000, "gpupages")],
                "cpu_pages": [_range(2, 0x7F0008000000, "cpupages")],
            },
            "overlaps its gpu_pages",
        ),
        (
            {
                "cpu_pages": [
                    _range(2, 0x7F0000000000, "cpupages"),
                    _range(2, 0x7F0008000000, "cpupages"),
                ]
            },
            "overlap",
        ),
    ],
    ids=["not-in-the-tree", "gpu-named-part", "cpu-part-as-gpu", "over-gpu-range", "overlap"],
)
def test_a_tampered_cpu_pages_entry_makes_the_metadata_unreadable(
    tmp_path: Path, extra: dict[str, object], why: str
) -> None:
    """Restore writes these ranges into the restored processes: one that names a process
    not restored, a part of the other kind, or memory another range covers is refused before
    anything is written (one ImageError)."""
    (tmp_path / META_NAME).write_text(json.dumps({**OLD, "schema": 5, "pids": [1, 2], **extra}))
    with pytest.raises(ImageError, match=why):
        ImageMeta.read(tmp_path)
