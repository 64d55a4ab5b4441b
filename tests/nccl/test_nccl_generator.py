"""The shim's wrapper generator and the job environment of ``spotguard run --nccl release``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import HEADER, ROOT, Built
from spotguard.checkpoint import nccl
from spotguard.checkpoint.ncclctl import ENV_CTL
from spotguard.errors import PreflightError


def _gen() -> ModuleType:
    path = ROOT / "packaging" / "nccl-shim" / "gen_wrappers.py"
    spec = importlib.util.spec_from_file_location("gen_wrappers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_wrappers"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_function_that_takes_a_communicator_is_wrapped(tmp_path: Path) -> None:
    gen = _gen()
    protos = gen.parse(HEADER.read_text())
    takes = {p.name for p in protos if any("ncclComm_t" in q.norm for q in p.params)}
    assert {"ncclAllReduce", "ncclSend", "ncclCommRevoke", "ncclCommSplit"} <= takes
    assert not any(p.name.startswith("pnccl") for p in protos)
    wrapped = set(gen.generate(HEADER, tmp_path))
    assert takes <= wrapped, takes - wrapped
    assert "ncclGetUniqueId" not in wrapped  # nothing to translate: NCCL's own


def test_a_new_function_that_makes_communicators_stops_the_build(tmp_path: Path) -> None:
    header = tmp_path / "nccl.h"
    header.write_text(
        HEADER.read_text().replace(
            "#ifdef __cplusplus\n}",
            "ncclResult_t ncclCommGrow(ncclComm_t comm, int n, ncclComm_t* newcomm);\n"
            "#ifdef __cplusplus\n}",
        )
    )
    out = subprocess.run([sys.executable, str(ROOT / "packaging/nccl-shim/gen_wrappers.py"),
                          str(header), str(tmp_path / "out")], capture_output=True, text=True,
                         check=False)  # fmt: skip
    assert out.returncode == 1
    assert "ncclCommGrow hands back communicators" in out.stderr


def test_release_env_preloads_the_shim_and_sets_no_transport_switch() -> None:
    env = nccl.release_env(
        {"LD_PRELOAD": "/x/other.so", "NCCL_NVLS_ENABLE": "0"}, Path("/s/shim.so"), Path("/c")
    )
    assert env["LD_PRELOAD"] == "/s/shim.so /x/other.so"
    assert env[ENV_CTL] == "/c"
    assert env["NCCL_NVLS_ENABLE"] == "0"  # the machine's own setting stays
    assert not set(nccl.CHECKPOINTABLE) - {"NCCL_NVLS_ENABLE"} & set(env)
    assert env["NCCL_SOCKET_IFNAME"] == "lo"


USER = """
import ctypes, mmap, sys, time
libs = [open(p, "rb") for p in sys.argv[1:]]
maps = [mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ) for f in libs]
print("ready", flush=True)
time.sleep(60)
"""


def test_the_environment_rule_skips_processes_with_the_shim(built: Built, tmp_path: Path) -> None:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0" * 4096)
    env = {"WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}  # NCCL's defaults: refused without it
    procs = [
        subprocess.Popen([sys.executable, "-c", USER, *paths], stdout=subprocess.PIPE, env=env)
        for paths in ([str(lib)], [str(lib), str(built.shim)])
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()
        with pytest.raises(PreflightError, match=f"pid {procs[0].pid} "):
            nccl.refuse_uncheckpointable("j", [procs[0].pid])
        nccl.refuse_uncheckpointable("j", [procs[1].pid])  # the shim releases it instead
    finally:
        for p in procs:
            p.kill()
            p.wait()
