"""Which GPUs a parked job comes back onto: its own when they have room, else another of the
same model (the driver remaps UUIDs), every GPU it saw paired; a clear refusal when none has
room. (The choice is pure; the GPU run exercises the driver's remap on one GPU.)"""

from __future__ import annotations

import pytest

from spotguard.errors import ParkError
from spotguard.park.core import place_gpus
from spotguard.park.gpu import Device, choose
from spotguard.park.record import ParkRecord

GIB = 2**30
H = "NVIDIA H200"


def _img(*uuids: str, model: str = H) -> list[Device]:
    return [Device(u, model, 0) for u in uuids]


def test_own_gpu_with_room_is_kept() -> None:
    host = [Device("G0", H, 50 * GIB), Device("G1", H, 80 * GIB)]
    assert choose(_img("G0", "G1"), {"G0": 40 * GIB}, host) == ["G0", "G1"]


def test_taken_gpu_moves_to_another_of_the_same_model_and_the_rest_pairs_up() -> None:
    host = [Device("G0", H, 10 * GIB), Device("G1", H, 80 * GIB)]
    assert choose(_img("G0", "G1"), {"G0": 40 * GIB}, host) == ["G1", "G0"]


def test_another_model_is_never_chosen() -> None:
    host = [Device("G0", H, 1 * GIB), Device("A0", "NVIDIA A100", 80 * GIB)]
    assert choose(_img("G0", "A0x"), {"G0": 40 * GIB}, host) is None


def test_two_users_each_get_a_gpu_with_room() -> None:
    host = [Device("G0", H, 30 * GIB), Device("G1", H, 70 * GIB), Device("G2", H, 45 * GIB)]
    got = choose(_img("G0", "G1", "G2"), {"G0": 40 * GIB, "G1": 60 * GIB}, host)
    assert got is not None and got[1] == "G1" and got[0] == "G2" and got[2] == "G0"


def test_place_gpus_refuses_with_one_line_and_keeps_the_state() -> None:
    rec = ParkRecord(job="nb", place="memory", location="in place", gpus=(("G0", H),),
                     gpu_use={"G0": 40 * GIB})  # fmt: skip
    with pytest.raises(ParkError, match=r"needs 40960 MiB on a NVIDIA H200 GPU .* state is kept"):
        place_gpus(rec, lambda: [Device("G0", H, 1 * GIB)])
    assert place_gpus(rec, lambda: [Device("G0", H, 50 * GIB)]) == ["G0"]
    assert place_gpus(rec, list) is None  # no NVML here: the driver decides
    cpu = ParkRecord(job="cpu", place="memory", location="in place")
    assert place_gpus(cpu, lambda: [Device("G0", H, 0)]) is None
