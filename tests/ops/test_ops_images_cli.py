"""Issue 28.5, ``spotguard images``: the store of ``[agent] store`` is used when no store URL
is given (list, verify, gc); ``list`` prints a header; ``gc`` says why chunks were kept;
``verify`` names a corrupt chunk once in full, not four times. Real ``spotguard`` processes
and a real file store."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from ops_helpers import clean_env

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def conf(tmp_path: Path, store: Path) -> Path:
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(f'[agent]\nstore = "{store.as_uri()}"\n')
    return cfg


def sgc(conf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["spotguard", *args],
        capture_output=True,
        text=True,
        env=clean_env(SPOTGUARD_CONFIG=str(conf)),
        timeout=60,
    )


def push(conf: Path, tmp_path: Path, store: Path, job: str, data: bytes) -> dict[str, str]:
    src = tmp_path / f"src-{job}-{len(data)}-{data[:4].hex()}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(data)
    res = sgc(conf, "images", "push", str(src), str(store), "--job", job, "--json")
    assert res.returncode == 0, res.stderr
    out: dict[str, str] = json.loads(res.stdout)
    return out


def test_list_verify_gc_use_the_agent_store_and_list_has_a_header(
    conf: Path, tmp_path: Path, store: Path
) -> None:
    first = push(conf, tmp_path, store, "train", os.urandom(400_000))
    second = push(conf, tmp_path, store, "train", os.urandom(400_000))
    other = push(conf, tmp_path, store, "notebook", os.urandom(100_000))

    listed = sgc(conf, "images", "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["JOB", "IMAGE", "SEQ", "SIZE", "STATE"], listed.stdout
    rows = [ln.split()[:2] for ln in lines[1:]]  # per job (by name), oldest first
    assert rows == [["notebook", other["image_id"]], ["train", first["image_id"]],
                    ["train", second["image_id"]]]  # fmt: skip
    assert all(ln == ln.rstrip() for ln in lines), listed.stdout  # no trailing spaces
    assert json.loads(sgc(conf, "images", "list", "--json").stdout)[0]["job"] == "notebook"
    assert sgc(conf, "images", "list", "--job", "train").stdout.count("train") == 2

    one = sgc(conf, "images", "verify", "train")  # a job name: its latest image in the store
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith(f"ok: {second['image']}:"), one.stdout
    every = sgc(conf, "images", "verify")  # no argument: every job's latest image
    assert every.returncode == 0, every.stderr
    assert [ln.split()[1].rstrip(":") for ln in every.stdout.splitlines()] == [
        other["image"],
        second["image"],
    ]

    gc = sgc(conf, "images", "gc", "--keep", "1", "--trust-store")
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.splitlines()[0].startswith("deleted 1 image(s), 0 chunk(s)"), gc.stdout
    # the first image's own chunks are unreferenced but younger than the grace: said so
    assert "unused but younger than gc_grace_s (3600 s" in gc.stdout, gc.stdout
    assert "used by the 2 kept image(s)" in gc.stdout, gc.stdout
    swept = sgc(conf, "images", "gc", "--keep", "1", "--trust-store", "--gc-grace-s", "0")
    assert swept.returncode == 0, swept.stderr
    assert re.match(r"deleted 0 image\(s\), [1-9]\d* chunk\(s\)", swept.stdout), swept.stdout
    assert "younger than" not in swept.stdout


def test_verify_names_a_corrupt_chunk_once(conf: Path, tmp_path: Path, store: Path) -> None:
    img = push(conf, tmp_path, store, "train", os.urandom(300_000))
    manifest = json.loads((store / "train" / "images" / img["image_id"] / "manifest.json")
                          .read_text())  # fmt: skip
    sha = manifest["files"][0]["chunks"][0]["digest"]
    chunk = next(p for p in store.rglob(sha + "*") if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:-3] + b"xyz")
    bad = sgc(conf, "images", "verify", "train")
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    *logged, named, verdict = bad.stderr.splitlines()
    assert verdict == f"spotguard: error: image {img['image']} has 1 corrupt chunk(s), first {sha}"
    assert named == f"corrupt chunk {sha[:12]} in pages-1.img: fails its hash check"
    # the one warning line (the chunk was fetched a second time) names it short: the whole
    # 64-hex digest is on stderr once, in the verdict
    assert [HEX64.findall(line) for line in logged] == [[]], bad.stderr
    assert sha[:12] in logged[0] and bad.stderr.count(sha) == 1, bad.stderr
    assert bad.stdout == ""
