"""The driver's staging memory faulted in beside its checkpoint (checkpoint/stagefault.py).

The "driver" here is what the real one does to the job (docs/benchmarks.md): a thread of a
real process maps one anonymous range and writes every page of it in order, from one thread,
while :func:`stagefault.prefaulting` reads the range from outside with several threads. The
checks: every page holds what the process wrote (a read never changes memory), the range was
found and read, and the host's huge zero page is as it was afterwards — also when the
checkpoint fails. These change host-wide settings (THP mode, the huge zero page), so they run
alone (``serial``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.checkpoint import gpupages, procmem, stagefault
from spotguard.checkpoint.settings import CheckpointSettings

THP = Path("/sys/kernel/mm/transparent_hugepage")

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not (THP / "use_zero_page").exists(), reason="no transparent huge pages"),
]

MIB = 1 << 20

DRIVER = textwrap.dedent(
    r"""
    import ctypes, mmap, sys
    n = int(sys.argv[1])
    HUGE = 2 << 20
    print("ready", flush=True)
    state = {}
    for line in sys.stdin:
        if line.startswith("stage"):
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = ctypes.addressof(ctypes.c_char.from_buffer(m))
            for i, off in enumerate(range(0, n, 4096)):
                ctypes.memset(base + off, 1 + (off // HUGE + i) % 251, 4096)
            state["m"] = m
            print("staged", hex(base), flush=True)
        elif line.startswith("check"):
            m = state["m"]
            bad = sum(1 for i, off in enumerate(range(0, n, 4096))
                      if m[off] != 1 + (off // HUGE + i) % 251 or m[off + 4095] != m[off])
            print("check", bad, flush=True)
    """
)


@pytest.fixture
def thp_always() -> Iterator[None]:
    """THP ``always`` (what the agent sets) for the test; the host's mode put back after."""
    enabled = THP / "enabled"
    old = next(w[1:-1] for w in enabled.read_text().split() if w.startswith("["))
    try:
        enabled.write_text("always")
    except OSError as exc:
        pytest.skip(f"cannot set transparent huge pages here: {exc}")
    try:
        yield
    finally:
        enabled.write_text(old)


class Driver:
    """A real process standing in for the driver's checkpoint of itself."""

    def __init__(self, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask("") == ["ready"]

    def ask(self, line: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    async def checkpoint(self, pids: list[int]) -> None:
        assert pids == [self.proc.pid]
        reply = await asyncio.to_thread(self.ask, "stage")
        assert reply[0] == "staged"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def driver() -> Iterator[Driver]:
    d = Driver(256 * MIB)
    yield d
    d.close()


def settings(on: bool, workers: int = 0) -> CheckpointSettings:
    return CheckpointSettings(prefault_staging=on, gpu_page_workers=workers)


def _zero_page() -> str:
    return (THP / "use_zero_page").read_text().strip()


def test_the_driver_s_range_is_faulted_beside_it_and_holds_exactly_what_it_wrote(
    thp_always: None, driver: Driver
) -> None:
    before = _zero_page()
    pid = driver.proc.pid
    old = gpupages.writable_anon(pid)
    stats = asyncio.run(stagefault.checkpoint(driver, [pid], settings(True, 4)))
    assert stats.active
    assert stats.ranges == 1
    assert stats.first_seen_s is not None
    # every huge page of the new range was read (at least the 256 MiB the driver mapped)
    staged = gpupages.new_since(pid, old)
    assert sum(hi - lo for lo, hi in staged) >= 256 * MIB
    assert stats.bytes >= 254 * MIB
    assert driver.ask("check") == ["check", "0"]
    assert _zero_page() == before


def test_switched_off_nothing_is_read_and_the_host_is_untouched(
    thp_always: None, driver: Driver
) -> None:
    before = _zero_page()
    stats = asyncio.run(stagefault.checkpoint(driver, [driver.proc.pid], settings(False)))
    assert not stats.active and stats.bytes == 0 and stats.ranges == 0
    assert driver.ask("check") == ["check", "0"]
    assert _zero_page() == before


def test_without_thp_always_nothing_is_read(driver: Driver) -> None:
    enabled = THP / "enabled"
    old = next(w[1:-1] for w in enabled.read_text().split() if w.startswith("["))
    enabled.write_text("madvise")
    try:
        stats = asyncio.run(stagefault.checkpoint(driver, [driver.proc.pid], settings(True)))
    finally:
        enabled.write_text(old)
    assert not stats.active and stats.bytes == 0
    assert driver.ask("check") == ["check", "0"]


def test_a_failed_checkpoint_stops_the_threads_and_puts_the_zero_page_back(
    thp_always: None, driver: Driver
) -> None:
    before = _zero_page()

    class Failing:
        async def checkpoint(self, pids: list[int]) -> None:
            await driver.checkpoint(pids)
            raise RuntimeError("driver said no")

    with pytest.raises(RuntimeError, match="driver said no"):
        asyncio.run(stagefault.checkpoint(Failing(), [driver.proc.pid], settings(True, 2)))
    assert _zero_page() == before
    assert driver.ask("check") == ["check", "0"]
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("prefault")]


def test_the_zero_page_stays_off_until_the_last_overlapping_checkpoint_ends(
    thp_always: None,
) -> None:
    before = _zero_page()
    a, b = Driver(64 * MIB), Driver(64 * MIB)
    try:

        async def both() -> None:
            async with stagefault.prefaulting([a.proc.pid], True, 2):
                async with stagefault.prefaulting([b.proc.pid], True, 2):
                    assert _zero_page() == "0"
                assert _zero_page() == "0"  # a's checkpoint still runs

        asyncio.run(both())
    finally:
        a.close()
        b.close()
    assert _zero_page() == before


def test_reading_a_range_that_is_gone_reads_nothing_and_raises_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procmem.touch(proc.pid, [0x1000, 0x2000]) == 0
        assert procmem.touch(proc.pid, []) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_process_killed_while_the_zero_page_was_off_leaves_the_next_one_its_value(
    tmp_path: Path,
) -> None:
    """The setting's bookkeeping (a plain file stands in for sysfs here: a real kill of the
    process that turned it off would leave the host's setting changed for the other tests)."""
    knob, saved = tmp_path / "use_zero_page", tmp_path / "run" / "use_zero_page.saved"
    knob.write_text("1\n")
    first = stagefault._ZeroPage(knob, saved)
    assert first.acquire()
    assert knob.read_text() == "0" and saved.read_text() == "1"
    # the process dies here: nothing released; the next process finds the page off
    second = stagefault._ZeroPage(knob, saved)
    assert second.acquire() and second.acquire()
    second.release()
    assert knob.read_text() == "0"  # one checkpoint still runs
    second.release()
    assert knob.read_text() == "1" and not saved.exists()
    # a host whose setting was 0 before spotguard keeps 0
    knob.write_text("0")
    third = stagefault._ZeroPage(knob, saved)
    assert third.acquire()
    third.release()
    assert knob.read_text() == "0"


def test_no_more_is_read_than_the_gpu_memory_the_driver_will_stage(thp_always: None) -> None:
    """A range larger than the budget (a thread of the job mapping a big sparse region while
    the driver works would be one) is read only up to the budget; the rest is left alone."""
    d = Driver(768 * MIB)
    try:
        stats = asyncio.run(stagefault.checkpoint(d, [d.proc.pid], settings(True, 2), gpu_bytes=1))
        assert stats.active and stats.capped
        assert stats.bytes <= stagefault.budget(1) + stagefault.HUGE
        assert stats.to_json()["prefault_capped"] is True
        assert d.ask("check") == ["check", "0"]
    finally:
        d.close()


def test_the_budget_is_the_gpu_memory_with_a_margin_and_never_past_available_memory(
    tmp_path: Path,
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")  # 4 GiB available
    gib = 1 << 30
    assert stagefault.budget(gib, meminfo) == gib + gib // 4 + 512 * MIB
    assert stagefault.budget(0, meminfo) == 3 * gib  # unknown: available less 1 GiB
    assert stagefault.budget(10 * gib, meminfo) == 3 * gib
    meminfo.write_text("garbage")
    assert stagefault.budget(gib, meminfo) == 0


def test_doctor_says_whether_the_staging_can_be_faulted_beside_the_driver(tmp_path: Path) -> None:
    """``spotguard doctor``'s line (a directory stands in for the THP sysfs directory)."""
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "use_zero_page").write_text("1\n")
    ok, found, fix = stagefault.readiness(tmp_path)
    assert not ok and "not always" in found and "transparent_hugepages" in fix
    (tmp_path / "enabled").write_text("[always] madvise never\n")
    ok, found, fix = stagefault.readiness(tmp_path)
    assert ok and fix == "" and "faulted in beside" in found
    (tmp_path / "use_zero_page").unlink()
    ok, found, _ = stagefault.readiness(tmp_path)
    assert not ok and "not settable" in found


MAPPER = textwrap.dedent(
    r"""
    import ctypes, mmap, sys
    n = int(sys.argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        if line.startswith("map"):   # the driver's mapping, nothing written yet
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            print("mapped", flush=True)
        elif line.startswith("zero"):
            print("zero", sum(1 for off in range(0, n, 4096) if m[off] != 0), flush=True)
    """
)


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_the_reads_make_real_pages_before_the_driver_writes_any(thp_always: None) -> None:
    """What makes the driver faster: the reads alone leave the range resident (real zeroed
    pages, not the shared zero page), so the driver's writes find them present."""
    size = 256 * MIB
    proc = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().split() == ["ready"]
        rss_before = _rss_anon(proc.pid)

        def ask(line: str) -> list[str]:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            return proc.stdout.readline().split()

        async def run() -> tuple[stagefault.PrefaultStats, int]:
            async with stagefault.prefaulting([proc.pid], True, 2) as stats:
                assert await asyncio.to_thread(ask, "map") == ["mapped"]
                for _ in range(400):
                    if stats.bytes >= size - stagefault.HUGE:
                        break
                    await asyncio.sleep(0.05)
                grown = _rss_anon(proc.pid) - rss_before
            return stats, grown

        stats, grown = asyncio.run(run())
        assert stats.bytes >= size - stagefault.HUGE
        assert grown >= size - 2 * stagefault.HUGE, f"{grown >> 20} MiB resident after the reads"
        assert ask("zero") == ["zero", "0"]  # read, never written
    finally:
        proc.kill()
        proc.wait()
