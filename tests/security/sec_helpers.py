"""Helpers shared by the attacker tests (imported by name; conftest modules are not)."""

from __future__ import annotations

import pwd
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Attacker:
    """An ordinary local user: a notebook's account, another member of the team."""

    name: str
    uid: int
    gid: int

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as this user (``runuser``: real uid, gid and groups of the user)."""
        res = subprocess.run(
            ["runuser", "-u", self.name, "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
        )
        if check:
            assert res.returncode == 0, f"{argv} as {self.name}: {res.stderr}"
        return res

    def python(self, code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Python snippet as this user (the system interpreter: no access to ours)."""
        return self.run(SYSTEM_PYTHON, "-c", code, *args, check=check)

    def popen(self, code: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["runuser", "-u", self.name, "--", SYSTEM_PYTHON, "-c", code, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )


@contextmanager
def new_user(prefix: str) -> Iterator[Attacker]:
    """A fresh ordinary user (no home, /bin/sh) for the block, removed after it."""
    name = f"{prefix}{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    try:
        pw = pwd.getpwnam(name)
        yield Attacker(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", "--force", name], check=False, capture_output=True)
