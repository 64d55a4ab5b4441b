"""How the demo names the broken link when the controller gives up: by the state the job
left, unless the run had already got past that link (the controller gives up at the start
of its next launch round, so a restore that failed twice ends in a row from ``launching``).
CI saw ``demo --fault restore`` say "FAILED at relaunch" once, on a loaded machine."""

from __future__ import annotations

from typing import Any

import pytest

from spotguard.demo.watch import Follower
from spotguard.errors import DemoError


class _Ui:
    def event(self, text: str) -> None:
        pass

    def waiting(self, text: str) -> None:
        pass


def _gave_up(frm: str) -> dict[str, Any]:
    return {"from": frm, "to": "failed", "reason": "max restarts (2) reached", "detail": {}}


@pytest.mark.parametrize(
    ("frm", "step", "named"),
    [
        ("launching", "restore", "restore"),  # VM 2 was restoring: the restore link broke
        ("launching", "relaunch", "relaunch"),  # never got a VM restoring: the launch broke
        ("restoring", "relaunch", "restore"),
        ("interrupting", "freeze", "freeze"),
    ],
)
def test_a_give_up_names_the_furthest_link_the_run_reached(frm: str, step: str, named: str) -> None:
    follower = Follower(None, "train", _Ui(), {})  # type: ignore[arg-type]
    with pytest.raises(DemoError) as err:
        follower._failed(_gave_up(frm), step)
    assert err.value.step == named
    assert "the controller gave up on the job: max restarts (2) reached" in str(err.value)
