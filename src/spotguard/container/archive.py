"""podman's checkpoint archive, where spotguard has to touch it: its storage paths.

``podman container checkpoint --export`` records the container's podman config
(``config.dump``) and OCI spec (``spec.dump``) with absolute paths under the checkpointing
host's graph root and run root (conmon's pid file, the container's static dir, its shm, its log).
``podman container restore --import`` reuses them as they are, so on a host whose podman keeps
its storage elsewhere conmon fails (``Failed to write conmon pidfile``). Where the roots
differ, restore appends rewritten copies of the two files to the (uncompressed) tar — the
archive is not copied: podman extracts members in order, the last copy of a name wins.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from spotguard.errors import ImageError

#: the members whose paths are moved
DUMPS = ("config.dump", "spec.dump")
MAX_DUMP_BYTES = 16 << 20


def _moved(value: Any, moves: list[tuple[str, str]]) -> Any:
    """``value`` with every string under an old root moved under the new one."""
    if isinstance(value, str):
        for old, new in moves:
            if value == old or value.startswith(old + "/"):
                return new + value[len(old) :]
        return value
    if isinstance(value, list):
        return [_moved(v, moves) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, moves) for k, v in value.items()}
    return value


def relocate(archive: Path, moves: dict[str, str]) -> list[str]:
    """Append to ``archive`` copies of config.dump and spec.dump whose paths under each old
    root (key) are under the new root (value) instead; the names of the members rewritten."""
    pairs = [(old.rstrip("/"), new.rstrip("/")) for old, new in moves.items() if old and old != new]
    if not pairs:
        return []
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:") as tar:
            for member in tar:
                if member.name.lstrip("./") in DUMPS and member.isfile():
                    if member.size > MAX_DUMP_BYTES:
                        raise ImageError(f"{member.name} in {archive.name} is too large")
                    f = tar.extractfile(member)
                    if f is not None:
                        found[member.name.lstrip("./")] = f.read()
        rewritten: dict[str, bytes] = {}
        for name, data in found.items():
            new = _moved(json.loads(data), pairs)
            if new != json.loads(data):
                rewritten[name] = json.dumps(new).encode()
        if rewritten:
            with tarfile.open(archive, "a:") as tar:
                for name, data in rewritten.items():
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
                    tar.addfile(info, io.BytesIO(data))
    except (tarfile.TarError, OSError, ValueError) as exc:
        raise ImageError(f"{archive.name} is not a readable podman archive: {exc}") from exc
    return sorted(rewritten)
