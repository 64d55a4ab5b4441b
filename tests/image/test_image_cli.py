"""``spotguard images …`` as a user runs it: real processes, JSON on stdout, one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sgtest import sg
from spotguard.contracts import chunk_key


def test_push_list_verify_pull_gc_and_errors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "out").mkdir(parents=True)
    (src / "pages-1.img").write_bytes(os.urandom(600_000))
    (src / "out" / "stdout").write_text("hello\n")
    store = tmp_path / "store"

    pushes = []
    for _ in range(2):
        r = sg(
            "images",
            "push",
            str(src),
            str(store),
            "--job",
            "cli",
            "--chunk-size",
            str(256 << 10),
            "--json",
        )
        assert r.returncode == 0, r.stderr
        pushes.append(json.loads(r.stdout))
    assert pushes[1]["bytes_skipped"] == pushes[1]["bytes"] == pushes[0]["bytes"]

    listed = json.loads(sg("images", "list", str(store), "--json").stdout)
    assert [i["image_id"] for i in listed] == [p["image_id"] for p in pushes]
    assert all(i["complete"] and i["job"] == "cli" for i in listed)
    assert "cli" in sg("images", "list", store.as_uri()).stdout

    url = pushes[1]["image"]
    ok = sg("images", "verify", url, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True

    pulled = sg("images", "pull", url, str(tmp_path / "dest"), "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "dest" / "out" / "stdout").read_text() == "hello\n"

    gcd = json.loads(
        sg("images", "gc", str(store), "--keep", "1", "--trust-store", "--json").stdout
    )
    assert len(gcd["images_deleted"]) == 1 and gcd["images_kept"] == [url]

    # one corrupt chunk: verify names it, exits non-zero, and prints no traceback
    manifest = json.loads(
        (store / "cli" / "images" / pushes[1]["image_id"] / "manifest.json").read_text()
    )
    sha = manifest["files"][1]["chunks"][0]["digest"]
    path = store / chunk_key("cli", sha)
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    bad = sg("images", "verify", url, "--json")
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["bad"][0]["chunk"] == sha
    assert f"spotguard: error: image {url} has 1 corrupt chunk(s), first {sha}" in bad.stderr
    assert "Traceback" not in bad.stderr

    wrong = sg("images", "verify", str(store / "cli"))
    assert wrong.returncode == 2 and "not an image URL" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    nokeep = sg("images", "gc", str(store), "--keep", "0")
    assert nokeep.returncode == 2


def test_keygen_signed_push_and_refusals_as_one_line_errors(tmp_path: Path) -> None:
    """The fleet key from ``images keygen``; a signed push verifies and pulls where the public
    key is trusted; an unsigned image and an altered manifest are refused with one line."""
    key = tmp_path / "fleet.key"
    made = sg("images", "keygen", str(key))
    assert made.returncode == 0, made.stderr
    assert (key.stat().st_mode & 0o777) == 0o600 and b"PRIVATE KEY" in key.read_bytes()
    again = sg("images", "keygen", str(key))
    assert again.returncode == 2 and "--force" in again.stderr
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(300_000))
    store = tmp_path / "store"
    signed = sg("images", "push", str(src), str(store), "--job", "cli", "--json",
                "--signing-key-file", str(key))  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    url = json.loads(signed.stdout)["image"]
    trust = ("--verify-key-file", f"{key}.pub")
    ok = sg("images", "verify", url, *trust)
    assert ok.returncode == 0 and "authenticated by ed25519:" in ok.stdout, ok.stderr
    assert sg("images", "pull", url, str(tmp_path / "d1"), *trust).returncode == 0

    unsigned = sg("images", "push", str(src), str(store), "--job", "cli", "--json")
    plain_url = json.loads(unsigned.stdout)["image"]
    refused = sg("images", "verify", plain_url, *trust)
    assert refused.returncode == 1 and "is not signed" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    listed = json.loads(sg("images", "list", str(store), "--json").stdout)
    assert [i["sequence"] for i in listed] == [1, 2]

    mpath = store / "cli" / "images" / json.loads(signed.stdout)["image_id"] / "manifest.json"
    m = json.loads(mpath.read_text())
    m["meta"]["gpu"] = {"count": 8}
    mpath.write_text(json.dumps(m))
    pulled = sg("images", "pull", url, str(tmp_path / "d2"), *trust)
    assert pulled.returncode == 1 and "does not match its manifest" in pulled.stderr
    assert not (tmp_path / "d2").exists() or not any((tmp_path / "d2").iterdir())


def test_push_of_a_file_the_image_cannot_name_is_one_line(tmp_path: Path) -> None:
    """A directory holding a name that is not UTF-8 (what another program may leave): the
    push fails in one line naming it, not a validation error's several lines, and writes no
    image."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"x" * 1000)
    with open(os.path.join(os.fsencode(src), b"\xffname"), "wb") as f:
        f.write(b"y")
    store = tmp_path / "store"
    r = sg("images", "push", str(src), str(store), "--job", "cli")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("spotguard: error: ") and "unexpected" not in last, r.stderr
    assert "\\udcffname" in last and "not Unicode" in last, r.stderr
    assert "validation error" not in r.stderr and "pydantic" not in r.stderr, r.stderr
    listed = sg("images", "list", str(store), "--json")
    assert listed.returncode != 0 or not any(i["complete"] for i in json.loads(listed.stdout))
