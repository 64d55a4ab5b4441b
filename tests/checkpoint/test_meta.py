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
