"""The one GPU name table: NVML, AWS and GCP spellings meet on one canonical model."""

from __future__ import annotations

import pytest

from spotguard.providers.gpus import canonical_gpu


@pytest.mark.parametrize(
    ("spelling", "memory_mib", "canonical"),
    [
        # NVML names (what an image records)
        ("NVIDIA H100 80GB HBM3", None, "h100"),
        ("NVIDIA H200", None, "h200"),
        ("NVIDIA A100-SXM4-40GB", None, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", None, "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", None, "a100-80gb"),
        ("NVIDIA A10G", None, "a10g"),
        ("NVIDIA L4", None, "l4"),
        ("NVIDIA L40S", None, "l40s"),
        ("Tesla T4", None, "t4"),
        ("Tesla V100-SXM2-16GB", None, "v100"),
        # AWS GpuInfo names (memory tells the A100s apart)
        ("H100", 81920, "h100"),
        ("A100", 40960, "a100-40gb"),
        ("A100", 81920, "a100-80gb"),
        ("A10G", 22888, "a10g"),
        ("L4", 22888, "l4"),
        ("L40S", 45776, "l40s"),
        ("T4g", 16384, "t4g"),
        # GCP accelerator types
        ("nvidia-h100-80gb", None, "h100"),
        ("nvidia-h100-mega-80gb", None, "h100"),
        ("nvidia-tesla-a100", None, "a100-40gb"),
        ("nvidia-a100-80gb", None, "a100-80gb"),
        ("nvidia-l4", None, "l4"),
        ("nvidia-tesla-t4", None, "t4"),
        ("nvidia-tesla-v100", None, "v100"),
    ],
)
def test_every_spelling_maps_to_one_model(
    spelling: str, memory_mib: int | None, canonical: str
) -> None:
    assert canonical_gpu(spelling, memory_mib) == canonical


def test_unknown_names_still_match_themselves_and_none_stays_none() -> None:
    assert canonical_gpu("Acme Tensor X9") == canonical_gpu("ACME tensor-x9") == "acme-tensor-x9"
    assert canonical_gpu(None) is None
    assert canonical_gpu("") is None
    # L4 and L40S, A10 and A10G, T4 and T4g are different GPUs
    assert len({canonical_gpu(n) for n in ("L4", "L40S", "L40", "A10", "A10G", "T4", "T4g")}) == 7
