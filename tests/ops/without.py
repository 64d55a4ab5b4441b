"""``python without.py MOD[,MOD...] ARGS...``: run the spotguard CLI as an install that lacks
the extras providing those top-level modules (importing them fails as if not installed)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


class Without(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, Without(set(sys.argv[1].split(","))))
    from spotguard.cli import main

    main(args=sys.argv[2:], prog_name="spotguard")
