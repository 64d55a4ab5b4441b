#!/usr/bin/env python3
"""Generate the NCCL shim's wrappers from the nccl.h it is built against (stdlib only).

Why generated: every public function of nccl.h that takes a communicator must be wrapped, or
one of the shim's handles would reach NCCL itself; NCCL adds functions from release to
release, so the list comes from the header of the NCCL the job loads, not from a list kept by
hand. Functions that create, end or describe communicators (and a few others whose meaning
the shim must know) are written by hand in sg_shim.c: :data:`HAND`. Every other function with
a ``ncclComm_t`` parameter gets a wrapper that translates the handle, waits at the gate while
spotguard holds NCCL closed, and counts the call (an operation when it takes a CUDA stream;
``ncclSend``/``ncclRecv`` per peer). A function that hands back new communicators
(``ncclComm_t*``) and is not written by hand stops the build: the shim must learn it first.

Writes into OUT_DIR:

* ``sg_nccl_api.h``: the header with its CUDA includes replaced by the one type it uses
  (``cudaStream_t``), so the shim builds without the CUDA toolkit;
* ``sg_wrappers.c``: the generated wrappers;
* ``wrapped.txt``: every function the shim defines (generated and by hand), one per line.

    gen_wrappers.py NCCL_H OUT_DIR
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: written by hand in sg_shim.c (they create, end or describe communicators, or change the
#: gate's accounting)
HAND = frozenset(
    {
        "ncclCommInitRank",
        "ncclCommInitRankConfig",
        "ncclCommInitAll",
        "ncclCommInitRankScalable",
        "ncclCommSplit",
        "ncclCommShrink",
        "ncclCommFinalize",
        "ncclCommDestroy",
        "ncclCommAbort",
        "ncclCommGetAsyncError",
        "ncclCommCount",
        "ncclCommCuDevice",
        "ncclCommUserRank",
        "ncclGetLastError",
        "ncclCommRegister",
        "ncclCommDeregister",
        "ncclCommWindowRegister",
        "ncclCommWindowDeregister",
        "ncclRedOpCreatePreMulSum",
        "ncclRedOpDestroy",
        "ncclGroupStart",
        "ncclGroupEnd",
        "ncclGroupSimulateEnd",
        "ncclMemAlloc",
        "ncclMemFree",
    }
)
#: NCCL's device API (nccl_device.h, host side), wrapped by hand with ABI-equal types
DEVICE_API = (
    "ncclDevCommCreate",
    "ncclDevCommDestroy",
    "ncclTeamWorld",
    "ncclTeamLsa",
    "ncclTeamRail",
    "ncclTeamRankToWorld",
    "ncclTeamRankToLsa",
)
P2P = {"ncclSend": "SG_SEND", "ncclRecv": "SG_RECV"}
CUDA_TYPES = """\
/* nccl.h's CUDA includes, replaced by the one CUDA type it uses (spotguard gen_wrappers.py) */
#ifndef SG_CUDA_TYPES
#define SG_CUDA_TYPES
#include <stddef.h> /* size_t, NULL: cuda_runtime.h brings them */
typedef struct CUstream_st *cudaStream_t;
#endif
"""


class HeaderError(Exception):
    """The header cannot be wrapped safely (named function, reason)."""


@dataclass(frozen=True)
class Param:
    type: str
    name: str

    @property
    def norm(self) -> str:
        return re.sub(r"\s+", "", self.type.replace("const", ""))


@dataclass(frozen=True)
class Proto:
    ret: str
    name: str
    params: tuple[Param, ...]


def _strip_balanced(text: str, opener: str) -> str:
    """Remove every ``opener(...)`` (balanced parentheses) from ``text``."""
    out, i = [], 0
    while True:
        j = text.find(opener, i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.index("(", j)
        depth = 0
        while k < len(text):
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
            if depth == 0:
                break
        i = k


def _strip_braces(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _param(raw: str, index: int) -> Param:
    raw = " ".join(raw.split())
    m = re.match(r"^(.*?[\s\*])(\w+)$", raw)
    if m is None or m.group(1).strip() in ("", "const", "struct", "unsigned"):
        return Param(raw, f"a{index}")  # an unnamed parameter
    return Param(m.group(1).strip(), m.group(2))


def parse(text: str) -> list[Proto]:
    """Every ``nccl*`` function prototype of a header (``pnccl*`` profiling twins skipped)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    # C++-only blocks (extern "C" { ... }) first, then every preprocessor line
    text = re.sub(r"^\s*#\s*if(?:def)?\s+__cplusplus\b.*?^\s*#\s*endif[^\n]*", " ", text,
                  flags=re.M | re.S)  # fmt: skip
    text = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)
    text = _strip_balanced(text, "__attribute__")
    text = _strip_braces(text)
    out = []
    for stmt in text.split(";"):
        stmt = " ".join(stmt.split())
        m = re.match(r"^(?:extern\s+)?([\w\s\*]+?)\s*\b(nccl\w+)\s*\(([^()]*)\)$", stmt)
        if m is None or stmt.startswith("typedef"):
            continue
        args = m.group(3).strip()
        parts = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
        params = tuple(_param(a, i) for i, a in enumerate(parts))
        out.append(Proto(" ".join(m.group(1).split()), m.group(2), params))
    return out


def _decl(p: Param) -> str:
    return f"{p.type} {p.name}" if not p.type.endswith("*") else f"{p.type}{p.name}"


def wrapper(proto: Proto) -> str | None:
    """C source of the generic wrapper of ``proto``; None when it needs none."""
    comms = [i for i, p in enumerate(proto.params) if p.norm == "ncclComm_t"]
    makes = [p for p in proto.params if p.norm.startswith("ncclComm_t*")]
    if proto.name in HAND:
        return None
    if makes:
        raise HeaderError(
            f"{proto.name} hands back communicators ({_decl(makes[0])}): the shim must wrap it "
            "by hand (sg_shim.c) before it can be built against this nccl.h"
        )
    if not comms:
        return None
    if len(comms) > 1:
        raise HeaderError(f"{proto.name} takes {len(comms)} communicators: not supported")
    if proto.ret == "ncclResult_t":
        fail = "ncclInternalError"
    elif proto.ret == "const char*" or proto.ret == "const char *":
        fail = '""'
    else:
        raise HeaderError(f"{proto.name} returns {proto.ret}: not supported by the generator")
    stream = next((p.name for p in proto.params if p.norm == "cudaStream_t"), None)
    kind = P2P.get(proto.name, "SG_COLL" if stream else "SG_NONE")
    peer = "peer" if proto.name in P2P else "-1"
    ci = comms[0]
    args = ", ".join(
        f"({p.type.replace('const ', '')})call.real" if i == ci else p.name
        for i, p in enumerate(proto.params)
    )
    types = ", ".join(p.type for p in proto.params) or "void"
    decls = ", ".join(_decl(p) for p in proto.params) or "void"
    stream_arg = f"(const void *){stream}" if stream else "NULL"
    ret_err = "(ncclResult_t)err" if proto.ret == "ncclResult_t" else fail
    return f"""
{proto.ret} {proto.name}({decls}) {{
  typedef {proto.ret} (*fn_t)({types});
  static void *slot;
  fn_t fn = (fn_t)sg_resolve(&slot, "{proto.name}");
  sg_call call;
  int err;
  if (!fn)
    return {fail};
  err = sg_begin(&call, (void *){proto.params[ci].name}, {kind}, {peer}, {stream_arg});
  if (err)
    return {ret_err};
  {proto.ret} r = fn({args});
  sg_end(&call);
  return r;
}}
"""


def api_header(text: str) -> str:
    """The header with its CUDA includes replaced by :data:`CUDA_TYPES`."""
    lines = []
    done = False
    for line in text.splitlines():
        if re.match(r"^\s*#\s*include\s*[<\"]cuda", line):
            if not done:
                lines.append(CUDA_TYPES)
                done = True
            continue
        lines.append(line)
    if not done:
        lines.insert(0, CUDA_TYPES)
    return "\n".join(lines) + "\n"


def generate(header: Path, out: Path) -> list[str]:
    """Write the three outputs; return the names of the wrapped functions."""
    text = header.read_text()
    protos = parse(text)
    names = {p.name for p in protos}
    missing = {"ncclCommInitRank", "ncclAllReduce", "ncclCommDestroy"} - names
    if missing:
        raise HeaderError(f"{header} does not look like nccl.h (no {', '.join(sorted(missing))})")
    bodies = [b for p in protos if (b := wrapper(p)) is not None]
    generic = [p.name for p in protos if p.name not in HAND and wrapper(p) is not None]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sg_nccl_api.h").write_text(api_header(text))
    src = [
        f"/* generated by gen_wrappers.py from {header.name}: do not edit */",
        '#include "sg_shim.h"',
        *bodies,
    ]
    (out / "sg_wrappers.c").write_text("\n".join(src))
    wrapped = sorted({*generic, *HAND, *DEVICE_API})
    (out / "wrapped.txt").write_text("\n".join(wrapped) + "\n")
    return wrapped


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: gen_wrappers.py NCCL_H OUT_DIR\n")
        return 2
    try:
        wrapped = generate(Path(argv[0]), Path(argv[1]))
    except (OSError, HeaderError) as exc:
        sys.stderr.write(f"gen_wrappers: {exc}\n")
        return 1
    sys.stderr.write(f"gen_wrappers: {len(wrapped)} functions wrapped\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
