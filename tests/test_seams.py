"""No class of src/spotguard stands in for a subclass with ``NotImplementedError`` stubs: a
base that needs its subclasses to implement methods declares them abstract, so a subclass that
forgets one cannot be built (instead of failing at the first call)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from spotguard.store.base import BlockingStore
from spotguard.stream.service import SocketService

SRC = Path(__file__).resolve().parents[1] / "src" / "spotguard"


def test_no_not_implemented_stubs_in_src() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            exc = node.exc if isinstance(node, ast.Raise) else None
            if isinstance(exc, ast.Call):
                exc = exc.func
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == [], f"NotImplementedError stubs: {found}"


def test_a_backend_missing_a_method_cannot_be_built() -> None:
    class Half(BlockingStore):
        def _get(self, key: str) -> bytes:
            return b""

    with pytest.raises(TypeError, match="abstract"):
        Half("file:///nowhere")  # type: ignore[abstract]

    class NoAbort(SocketService):
        async def start(self) -> None:
            return None

    with pytest.raises(TypeError, match="abstract"):
        NoAbort()  # type: ignore[abstract]
