"""The restore's read scheduling: every file's first chunk before anyone's read-ahead."""

from __future__ import annotations

import asyncio

import pytest

from spotguard.image.buffers import PrioritySlots


async def test_waiters_get_slots_lowest_priority_first_then_in_arrival_order() -> None:
    slots = PrioritySlots(1)
    await slots.acquire(5)  # held
    order: list[str] = []

    async def take(name: str, priority: int) -> None:
        await slots.acquire(priority)
        order.append(name)
        slots.release()

    tasks = [
        asyncio.create_task(take(n, p))
        for n, p in (("big-3", 3), ("big-4", 4), ("small-0", 0), ("other-0", 0), ("big-1", 1))
    ]
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*tasks)
    assert order == ["small-0", "other-0", "big-1", "big-3", "big-4"]


async def test_a_cancelled_waiter_never_keeps_a_slot() -> None:
    slots = PrioritySlots(1)
    await slots.acquire(0)
    waiter = asyncio.create_task(slots.acquire(0))
    late = asyncio.create_task(slots.acquire(1))
    await asyncio.sleep(0)
    waiter.cancel()
    slots.release()  # skips the cancelled waiter, goes to the next
    await asyncio.wait_for(late, 1)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # handed a slot and cancelled before it ran: the slot is passed on, not lost
    third = asyncio.create_task(slots.acquire(0))
    await asyncio.sleep(0)
    slots.release()
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third
    await asyncio.wait_for(slots.acquire(0), 1)


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrioritySlots(0)
