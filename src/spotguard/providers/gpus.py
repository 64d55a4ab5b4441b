"""One table that names GPU models the same way everywhere.

NVML, the AWS catalog and the GCP catalog each spell the same GPU differently::

    NVML (what an image records)      AWS GpuInfo Name   GCP accelerator type     canonical
    "NVIDIA H100 80GB HBM3"           "H100"             "nvidia-h100-80gb"       "h100"
    "NVIDIA A100-SXM4-40GB"           "A100" (40 GiB)    "nvidia-tesla-a100"      "a100-40gb"
    "NVIDIA A100-SXM4-80GB"           "A100" (80 GiB)    "nvidia-a100-80gb"       "a100-80gb"
    "NVIDIA A10G"                     "A10G"             —                        "a10g"
    "NVIDIA L4"                       "L4"               "nvidia-l4"              "l4"

Matching compares canonical names only; :func:`canonical_gpu` is the one place that maps a
spelling to one. An unknown spelling maps to a lowercased, normalised form of itself so that
two identical unknown names still match each other.
"""

from __future__ import annotations

import re

#: (pattern on the normalised name, canonical model). First match wins; order matters where
#: one name contains another (h100 before h10, a100-80gb before a100).
_TABLE: tuple[tuple[str, str], ...] = (
    (r"\bgb200\b", "gb200"),
    (r"\bb200\b", "b200"),
    (r"\bgh200\b", "gh200"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b", "h100"),
    (r"\ba100\b.*\b80gb\b", "a100-80gb"),
    (r"\ba100\b.*\b40gb\b", "a100-40gb"),
    (r"\ba100\b", "a100"),  # memory decides (40 GiB when unknown): see canonical_gpu
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bt4g\b", "t4g"),
    (r"\bt4\b", "t4"),
    (r"\bv100\b", "v100"),
    (r"\bp100\b", "p100"),
    (r"\bp4\b", "p4"),
    (r"\bk80\b", "k80"),
    (r"\bm60\b", "m60"),
)

_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "rtx")


def _normalise(name: str) -> str:
    s = name.lower().replace("_", "-")
    s = re.sub(r"[^a-z0-9]+", " ", s)
    words = [w for w in s.split() if w not in _VENDOR_WORDS]
    return " ".join(words)


def canonical_gpu(name: str | None, memory_mib: int | None = None) -> str | None:
    """The canonical model for any spelling of a GPU name (NVML, AWS, GCP).

    ``memory_mib`` (per GPU) disambiguates names that omit the memory size, such as AWS's
    ``"A100"`` (40 GiB on p4d, 80 GiB on p4de). ``None`` in, ``None`` out.
    """
    if not name:
        return None
    s = _normalise(name)
    # "a100 sxm4 80gb" and "a100 80gb" both become words; "80gb" may be glued ("80gb" kept).
    for pattern, model in _TABLE:
        if re.search(pattern, s):
            if model == "a100":
                return "a100-80gb" if (memory_mib or 0) > 60 * 1024 else "a100-40gb"
            return model
    return s.replace(" ", "-") or None
