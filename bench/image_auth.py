"""What authenticated images and raw frames cost or save: two tables.

1. **Authentication** (issue 15): the same image directory pushed (checkpoint side: hash,
   compress, upload, manifest) and pulled (restore side: manifest check, fetch, verify,
   decompress, write) through a ``file://`` store, without keys and with the fleet's Ed25519
   key (agent signs; the restoring host verifies the signature, scans the job's other
   manifests for rollback, then reads). Throughput = image bytes / wall seconds, median of
   ``--repeat`` runs; every push writes a fresh image with dedup off, so each run does the
   whole work. The store holds ``--history`` earlier images of the job (a real store holds a
   few: gc keeps them), which the signed paths read for the sequence and the rollback check.
2. **Raw frames** (issue 19): one chunk of random bytes, bf16-like weights and zero pages
   through the codec's ``pack`` (sample → raw frame or zstd), one thread, with raw frames on
   (``raw_saving`` 0.03, the default) and off (0), and the decode of what was stored.

Run: ``python -m bench.image_auth --size-mb 512 --repeat 3`` (prints both tables).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from spotguard.image import ImageSettings, generate_signing_key, pull_image, push_dir
from spotguard.image.codec import ChunkCodec, compress_bound

MIB = 1 << 20


def bf16_like(n: int) -> bytes:
    """Half-precision-looking weights: random mantissas, a narrow band of exponents (zstd
    level 1 gets about 1.3x on it, as on real bf16 checkpoints)."""
    rnd = bytearray(os.urandom(n))
    rnd[1::2] = bytes(0x3C + (b & 0x03) for b in rnd[1::2])
    return bytes(rnd)


def make_dir(root: Path, size: int) -> None:
    """A page file like a GPU job's: 60 % bf16-like, 30 % random, 10 % zero pages."""
    root.mkdir(parents=True)
    with (root / "pages-1.img").open("wb") as f:
        left = size
        for kind in ("bf16", "random", "zero"):
            n = {"bf16": size * 6 // 10, "random": size * 3 // 10}.get(kind, left)
            left -= n
            while n > 0:
                step = min(n, 16 * MIB)
                f.write(bf16_like(step) if kind == "bf16" else
                        os.urandom(step) if kind == "random" else bytes(step))  # fmt: skip
                n -= step
    for i in range(20):
        (root / f"core-{i}.img").write_bytes(os.urandom(4096))


async def _auth_case(src: Path, store: str, s_push: ImageSettings, s_pull: ImageSettings,
                     work: Path) -> tuple[float, float]:  # fmt: skip
    t0 = time.perf_counter()
    res = await push_dir(src, store, "bench", settings=s_push)
    t1 = time.perf_counter()
    dest = work / f"pull-{time.monotonic_ns()}"
    dest.mkdir()
    await pull_image(res.image_url, dest, settings=s_pull)
    t2 = time.perf_counter()
    shutil.rmtree(dest)
    return t1 - t0, t2 - t1


async def auth_table(size_mb: int, repeat: int, history: int, root: Path) -> list[str]:
    src = root / "src"
    make_dir(src, size_mb * MIB)
    private, public = generate_signing_key()
    (root / "k").write_bytes(private)
    (root / "k.pub").write_bytes(public)
    base = {"dedup": False}
    cases = {
        "no keys": (ImageSettings(**base), ImageSettings(**base)),
        "Ed25519 signed + verified": (
            ImageSettings(signing_key_file=root / "k", **base),
            ImageSettings(verify_key_file=root / "k.pub", **base),
        ),
    }
    rows = []
    times: dict[str, tuple[float, float]] = {}
    for name, (s_push, s_pull) in cases.items():
        store = (root / f"store-{len(times)}").as_uri()
        for _ in range(history):  # earlier images of the job in the store
            await push_dir(src, store, "bench", settings=s_push)
        runs = [await _auth_case(src, store, s_push, s_pull, root) for _ in range(repeat)]
        push = statistics.median(r[0] for r in runs)
        pull = statistics.median(r[1] for r in runs)
        times[name] = (push, pull)
        rows.append(
            f"| {name} | {push:.2f} s | {size_mb / push:.0f} MiB/s | {pull:.2f} s "
            f"| {size_mb / pull:.0f} MiB/s |"
        )
    (p0, q0), (p1, q1) = times.values()
    rows.append(f"| difference (wall time, noisy) | {100 * (p1 / p0 - 1):+.1f} % | | "
                f"{100 * (q1 / q0 - 1):+.1f} % | |")  # fmt: skip
    # The authentication work itself, timed alone: what the signed paths add to each image.
    s_push, s_pull = cases["Ed25519 signed + verified"]
    store_url = (root / "store-1").as_uri()
    sign_s, check_s = await _auth_work(store_url, s_push, s_pull)
    rows += [
        "",
        "| authentication work per image | seconds | share of the no-key time |",
        "| --- | --- | --- |",
        f"| checkpoint: sequence scan + sign | {sign_s * 1e3:.1f} ms | {100 * sign_s / p0:.2f} % |",
        f"| restore: verify + rollback scan | {check_s * 1e3:.1f} ms | "
        f"{100 * check_s / q0:.2f} % |",
    ]
    head = [
        f"Image of {size_mb} MiB (60 % bf16-like, 30 % random, 10 % zero), file store on "
        f"{root}, {history} earlier images of the job, median of {repeat}:",
        "",
        "| case | checkpoint (push) | MiB/s | restore (pull) | MiB/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    return head + rows


async def _auth_work(
    store_url: str, s_push: ImageSettings, s_pull: ImageSettings
) -> tuple[float, float]:
    """Median seconds of (next_sequence + sign) and of (authenticate + refuse_rollback) on the
    job's newest manifest in the store, as the writer and the reader do them."""
    from spotguard.image.history import genuine_images, next_sequence, refuse_rollback
    from spotguard.image.keys import ImageKeys
    from spotguard.image.manifest import Manifest
    from spotguard.image.writer import store_for

    signer, host = ImageKeys.from_settings(s_push), ImageKeys.from_settings(s_pull)
    store = store_for(store_url, s_pull)
    try:
        newest = (await genuine_images(store, "bench", host))[-1].image_id
        data = await store.get(f"bench/images/{newest}/manifest.json")
        m, _ = Manifest.parse(data, newest)
        sign, check = [], []
        for _ in range(20):
            t0 = time.perf_counter()
            await next_sequence(store, "bench", signer)
            signer.sign(m.unsigned(), encrypted=False)
            t1 = time.perf_counter()
            m2, raw2 = Manifest.parse(data, newest)
            host.authenticate(raw2, m2, newest)
            await refuse_rollback(store, m2, host, newest)
            t2 = time.perf_counter()
            sign.append(t1 - t0)
            check.append(t2 - t1)
        return statistics.median(sign), statistics.median(check)
    finally:
        await store.aclose()


def raw_table(chunk_mb: int, repeat: int) -> list[str]:
    n = chunk_mb * MIB
    data = {"random": os.urandom(n), "bf16-like": bf16_like(n), "zero pages": bytes(n)}
    out = bytearray(compress_bound(n))
    plain = bytearray(n)
    rows = [
        f"One {chunk_mb} MiB chunk, zstd level 1, one thread, median of {repeat}:",
        "",
        "| data | raw frames | stored / plain | pack MiB/s | decode MiB/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, buf in data.items():
        for label, saving in (("on", 0.03), ("off", 0.0)):
            codec = ChunkCodec(1, raw_saving=saving)
            addr = codec.address(buf)
            pack_t, dec_t, stored, raw = [], [], 0, False
            for _ in range(repeat):
                t0 = time.perf_counter()
                frame, raw = codec.pack(buf, addr, memoryview(out))
                t1 = time.perf_counter()
                stored = len(frame)
                codec.decode_into(frame, addr, n, plain)
                t2 = time.perf_counter()
                pack_t.append(t1 - t0)
                dec_t.append(t2 - t1)
            kind = "raw" if raw else "zstd"
            rows.append(
                f"| {name} | {label} ({kind}) | {stored / n:.3f} | "
                f"{chunk_mb / statistics.median(pack_t):.0f} | "
                f"{chunk_mb / statistics.median(dec_t):.0f} |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--history", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = ap.parse_args()
    print(f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    print("\n".join(raw_table(args.chunk_mb, args.repeat)) + "\n")
    root = Path(tempfile.mkdtemp(prefix="sg-bench-auth-", dir=args.dir))
    try:
        print("\n".join(asyncio.run(auth_table(args.size_mb, args.repeat, args.history, root))))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
