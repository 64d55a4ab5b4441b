"""The memory a leave-running image may be kept in while the job goes on (checkpoint/hold.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.checkpoint.hold import NO_HOLD, hold_for, spare
from spotguard.checkpoint.settings import CheckpointSettings

GiB = 1 << 30
MiB = 1 << 20


def _meminfo(tmp_path: Path, total: int, avail: int) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(
        f"MemTotal:       {total // 1024} kB\nMemFree:        1 kB\n"
        f"MemAvailable:   {avail // 1024} kB\nBuffers:        0 kB\n"
    )
    return p


def test_the_whole_image_is_held_where_the_host_can_spare_it(tmp_path: Path) -> None:
    info = _meminfo(tmp_path, 128 * GiB, 120 * GiB)
    hold = hold_for(-1, 8 * GiB, 20 * GiB, meminfo=info)
    assert hold.files >= 8 * GiB and hold.pages >= 20 * GiB
    # ceilings: the GPU memory with some slack (granted part by part), the rest of what the
    # host can spare beside the staging to CRIU's files, whose size shows only as they flow
    assert hold.pages <= 25 * GiB + 64 * MiB
    assert hold.memory == spare(info) - 20 * GiB
    assert hold.total == hold.files + hold.pages and hold.memory == hold.files + 2 * hold.pages


def test_gpu_memory_of_unknown_size_gets_a_ceiling_of_what_is_left(tmp_path: Path) -> None:
    info = _meminfo(tmp_path, 128 * GiB, 120 * GiB)
    hold = hold_for(-1, 8 * GiB, 0, meminfo=info)
    room = spare(info)
    assert hold.files >= 8 * GiB
    assert hold.pages == (room - 9 * GiB - 64 * MiB) // 2 and hold.memory <= room


def test_a_short_host_holds_what_fits_beside_the_staging_and_a_reserve(tmp_path: Path) -> None:
    # 40 GiB available; the driver stages 24 GiB of GPU memory; the reserve is 6.4 GiB
    info = _meminfo(tmp_path, 128 * GiB, 40 * GiB)
    hold = hold_for(-1, 8 * GiB, 24 * GiB, meminfo=info)
    room = 40 * GiB - 24 * GiB - 128 * GiB // 20
    assert room == spare(info) - 24 * GiB
    assert 0 < hold.memory <= room
    assert hold.memory > room * 0.99  # all of what can be spared is used
    # the same share of each side
    assert hold.files / (9 * GiB) == pytest.approx(hold.pages / (30 * GiB), rel=0.02)


def test_nothing_is_held_when_asked_or_when_nothing_can_be_spared(tmp_path: Path) -> None:
    plenty = _meminfo(tmp_path, 64 * GiB, 60 * GiB)
    assert hold_for(0, GiB, 0, meminfo=plenty) == NO_HOLD
    short = tmp_path / "short"
    short.mkdir()
    tight = _meminfo(short, 64 * GiB, 3 * GiB)  # under the 3.2 GiB reserve
    assert hold_for(-1, GiB, 0, meminfo=tight).total == 0
    assert hold_for(-1, GiB, 0, meminfo=tmp_path / "absent").total == 0


def test_a_set_budget_caps_the_hold(tmp_path: Path) -> None:
    info = _meminfo(tmp_path, 64 * GiB, 60 * GiB)
    hold = hold_for(512, 4 * GiB, GiB, meminfo=info)
    assert 0 < hold.memory <= 512 * MiB and hold.pages > 0
    small = hold_for(512, 100 * MiB, 0, meminfo=info)
    assert small.files >= 100 * MiB + 100 * MiB // 8 + 64 * MiB
    assert small.memory <= 512 * MiB


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTGUARD_RESUME_BUFFER_MB", "0")
    assert CheckpointSettings().resume_buffer_mb == 0
    assert CheckpointSettings.model_fields["resume_buffer_mb"].default == -1


def test_the_prefault_covers_the_gpu_memory_only_where_its_size_is_known(tmp_path: Path) -> None:
    """A held pause's room is faulted in before the freeze for the job's memory and, where
    the GPU memory in use is known, for its copy too (within each share); a short host's
    shares bound both."""
    info = _meminfo(tmp_path, 128 * GiB, 120 * GiB)
    hold = hold_for(-1, 8 * GiB, 20 * GiB, prefault=True, meminfo=info)
    assert (hold.prefault, hold.prefault_pages) == (8 * GiB, 20 * GiB)
    unknown = hold_for(-1, 8 * GiB, 0, prefault=True, meminfo=info)
    assert (unknown.prefault, unknown.prefault_pages) == (8 * GiB, 0)
    off = hold_for(-1, 8 * GiB, 20 * GiB, meminfo=info)
    assert (off.prefault, off.prefault_pages) == (0, 0)
    short = hold_for(
        -1, 8 * GiB, 24 * GiB, prefault=True, meminfo=_meminfo(tmp_path, 128 * GiB, 40 * GiB)
    )
    assert short.prefault <= short.files and 0 < short.prefault_pages <= short.pages < 24 * GiB
