"""``spotguard images``: list, verify, garbage-collect, push and pull checkpoint images, and
make the fleet's signing key (``keygen``).

Every subcommand prints a human summary, or with ``--json`` nothing but one JSON document on
stdout. ``list``, ``verify`` and ``gc`` work on the agent's store (``[agent] store``,
``SPOTGUARD_STORE``) when no store URL is given, and ``verify`` takes a job name for that
job's latest image there. Transfers show a progress bar (bytes, rate, ETA) when stderr is a
terminal. Sizes are binary units, and an image's size is its manifest's
(:mod:`spotguard.progress`): ``list``, ``verify`` and ``pull`` print the same figure for the
same image.

Exit status: 0; 1 a failure (a missing store or image, a corrupt chunk: one line on stderr);
2 bad usage or configuration (a store whose extra is not installed included).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import click

from spotguard import cli, config
from spotguard.cli import verbose_option
from spotguard.commands.common import job_name
from spotguard.errors import ImageCorrupt, StoreError
from spotguard.image import (
    ImageSettings,
    gc,
    list_images,
    pull_image,
    push_dir,
    verify_image,
)
from spotguard.image.reader import ImageReader
from spotguard.names import check_job_name
from spotguard.progress import fmt_bytes, fmt_image_size, fmt_rate, transfer_bar
from spotguard.store import check_url

_TRANSFER_FIELDS = ("encryption_key", "signing_key")  # secrets never come from flags
_GC_EXCLUDE = tuple(n for n in ImageSettings.model_fields if n not in ("gc_grace_s",))
_TRUST_FIELDS = ("encryption_key_file", "verify_key_file", "verify_key", "allow_rollback")
_VERIFY_EXCLUDE = tuple(
    n
    for n in ImageSettings.model_fields
    if n not in (*_TRUST_FIELDS, "workers", "io_workers", "max_inflight_mb", "retries")
)


def _settings(flags: dict[str, Any]) -> ImageSettings:
    return config.load(ImageSettings, flags, config_file=cli.config(click.get_current_context()))


def _store(store_url: str | None) -> str:
    """STORE_URL, else the store this node's agent writes to (``[agent] store``)."""
    if store_url:
        return store_url
    from spotguard.agent.settings import AgentSettings

    ctx = click.get_current_context()
    return config.load(AgentSettings, {}, config_file=cli.config(ctx)).store


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _progress(label: str, quiet: bool) -> Any:
    """A progress bar on an interactive stderr (binary units, logs routed above it)."""
    return transfer_bar(label, quiet)


def _existing(store_url: str) -> None:
    """A ``file://`` store (or plain path) that does not exist is an error, not "no images";
    a malformed URL is refused as the store would refuse it (``file://host/dir``: not /dir)."""
    scheme, where, _ = check_url(store_url)
    if scheme != "file":
        return
    path = Path(where)
    if not path.is_dir():
        raise StoreError(
            f"store {store_url}: no directory {path} (check the URL; a file store is "
            "file:///absolute/dir or a path)"
        )


def _not_empty(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A directory argument that is not ``''`` (which would be the working directory)."""
    if not value.strip():
        raise click.BadParameter("is empty: give a directory", ctx=ctx, param=param)
    return value


async def _totals(image_url: str, settings: ImageSettings) -> tuple[int, int]:
    """An image's size as its manifest states it: (file bytes, stored bytes)."""
    async with ImageReader(image_url, settings=settings) as reader:
        totals = reader.manifest.totals
    return totals.bytes, totals.stored_bytes


@click.group("images")
def images() -> None:
    """List, verify and garbage-collect checkpoint images in a store."""


@images.command("list")
@verbose_option
@click.argument("store_url", required=False)
@click.option("--job", help="Only this job's images.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def list_cmd(store_url: str | None, job: str | None, as_json: bool) -> None:
    """List the images in STORE_URL (default: [agent] store), oldest first per job."""
    settings = _settings({})
    store_url = _store(store_url)
    _existing(store_url)
    infos = asyncio.run(list_images(store_url, job, settings=settings))
    if as_json:
        _emit([i.to_json() for i in infos])
        return
    if not infos:
        click.echo(f"no images in {store_url}")
        return
    click.echo(f"{'JOB':20} {'IMAGE':32} {'SEQ':5} {'SIZE':32} STATE")
    for i in infos:
        state = "complete" if i.complete else "INCOMPLETE (being written or abandoned)"
        size = fmt_image_size(i.bytes, i.stored_bytes) if i.complete else ""
        lock = " encrypted" if i.encrypted else ""
        seq = str(i.sequence) if i.complete else "-"
        click.echo(f"{i.job:20} {i.image_id:32} {seq:5} {size:32} {state}{lock}")


def _to_verify(image: str | None, settings: ImageSettings) -> list[str]:
    """The image URLs ``verify IMAGE`` means: IMAGE itself, a job's latest image in the
    agent's store, or (no IMAGE) every job's latest image there."""
    if image and "/" in image:  # a URL or a path (job names have no slash)
        return [image]
    store = _store(None).rstrip("/")
    if image:
        try:
            return [f"{store}/{check_job_name(image)}/images/latest"]
        except ValueError as exc:
            raise click.BadParameter(
                f"{exc}; give an image URL (…/JOB/images/ID) or a job of {store}",
                param_hint="IMAGE",
            ) from exc
    _existing(store)
    infos = asyncio.run(list_images(store, settings=settings))
    jobs = dict.fromkeys(i.job for i in infos if i.complete)
    if not jobs:
        raise StoreError(f"no complete image in {store} ([agent] store) to verify")
    return [f"{store}/{j}/images/latest" for j in jobs]


def _reason(bad: dict[str, Any]) -> str:
    """Why a chunk is corrupt, without the chunk's and image's names the error repeats."""
    error = str(bad["error"])
    return error.rsplit(" is corrupt: ", 1)[-1]


@images.command("verify")
@verbose_option
@click.argument("image", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
@config.options(ImageSettings, exclude=_VERIFY_EXCLUDE)
def verify_cmd(image: str | None, as_json: bool, **flags: Any) -> None:
    """Fetch and check every chunk of IMAGE: a URL (…/JOB/images/ID or …/images/latest), a
    job name (its latest image in [agent] store), or nothing (every job's latest there)."""
    settings = _settings(flags)
    reports = []
    for url in _to_verify(image, settings):
        with _progress("verify", as_json) as progress:
            reports.append(
                asyncio.run(
                    verify_image(url, settings=settings, progress=progress, raise_on_error=False)
                )
            )
    if as_json:
        _emit(reports[0].to_json() if image else [r.to_json() for r in reports])
    for report in reports:
        if report.ok and not as_json:
            size = fmt_image_size(*asyncio.run(_totals(report.image_url, settings)))
            by = f"; authenticated by {report.authenticated}" if report.authenticated else ""
            click.echo(
                f"ok: {report.image_url}: {size}; {report.chunks} distinct chunks "
                f"({fmt_bytes(report.bytes)}) verified{by}"
            )
        for bad in report.bad:
            where = ", ".join(bad["files"]) if isinstance(bad["files"], list) else bad["files"]
            click.echo(f"corrupt chunk {bad['chunk'][:12]} in {where}: {_reason(bad)}", err=True)
    failed = [r for r in reports if not r.ok]
    if failed:
        report = failed[0]
        raise ImageCorrupt(
            f"image {report.image_url} has {len(report.bad)} corrupt chunk(s), "
            f"first {report.bad[0]['chunk']}",
            chunk=report.bad[0]["chunk"],
        )


@images.command("gc")
@verbose_option
@click.argument("store_url", required=False)
@click.option("--keep", type=click.IntRange(min=1), required=True, help="Complete images to keep.")
@click.option("--job", help="Only this job (default: every job in the store).")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option(
    "--trust-store",
    is_flag=True,
    help="On a host without image keys: delete by sequence anyway (only where no one else can "
    "write the store; without keys gc otherwise deletes nothing).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
@config.options(ImageSettings, exclude=_GC_EXCLUDE)
def gc_cmd(
    store_url: str | None,
    keep: int,
    job: str | None,
    dry_run: bool,
    trust_store: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Delete all but the newest KEEP complete images per job in STORE_URL (default: [agent]
    store) and the chunks no kept image uses."""
    settings = _settings(flags)
    store_url = _store(store_url)
    _existing(store_url)
    result = asyncio.run(
        gc(store_url, job, keep, dry_run=dry_run, settings=settings, trust_store=trust_store)
    )
    if as_json:
        _emit(result.to_json())
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(
        f"{verb} {len(result.images_deleted)} image(s), {result.chunks_deleted} chunk(s) "
        f"({fmt_bytes(result.bytes_freed)}); kept {len(result.images_kept)} image(s)"
        f"{_chunks_kept(result, settings)}"
    )
    for j in result.skipped_chunks_writer_active:
        click.echo(f"job {j}: a checkpoint is being written; its chunks were left alone")
    for url in result.images_unauthenticated:
        click.echo(f"left alone, does not authenticate under this host's keys: {url}")


def _chunks_kept(result: Any, settings: ImageSettings) -> str:
    """Why chunks stayed: used by a kept image, or unused but younger than the grace."""
    why = []
    if result.chunks_kept_referenced:
        why.append(
            f"{result.chunks_kept_referenced} used by the {len(result.images_kept)} kept image(s)"
        )
    if result.chunks_kept_young:
        why.append(
            f"{result.chunks_kept_young} unused but younger than gc_grace_s "
            f"({settings.gc_grace_s:.0f} s; --gc-grace-s 0 deletes them)"
        )
    kept = result.chunks_kept_referenced + result.chunks_kept_young
    return f" and {kept} chunk(s): {', '.join(why)}" if why else ""


@images.command("push")
@verbose_option
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.argument("store_url")
@click.option("--job", required=True, callback=job_name, help="Job name the image belongs to.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
@config.options(ImageSettings, exclude=(*_TRANSFER_FIELDS, "gc_grace_s"))
def push_cmd(directory: str, store_url: str, job: str, as_json: bool, **flags: Any) -> None:
    """Write DIRECTORY (e.g. a CRIU image directory) as a new image of JOB in STORE_URL."""
    settings = _settings(flags)
    with _progress("upload", as_json) as progress:
        result = asyncio.run(
            push_dir(directory, store_url, job, settings=settings, progress=progress)
        )
    if as_json:
        _emit(result.to_json())
        return
    st, totals = result.stats, result.manifest.totals
    click.echo(
        f"{result.image_url}: {fmt_image_size(totals.bytes, totals.stored_bytes)} in "
        f"{st.seconds:.1f} s ({fmt_rate(st.rate)}); sent {fmt_bytes(st.stored_bytes)}, "
        f"{fmt_bytes(st.bytes_skipped)} already in the store"
    )


@images.command("pull")
@verbose_option
@click.argument("image_url")
@click.argument("dest_dir", type=click.Path(file_okay=False), callback=_not_empty)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
@config.options(ImageSettings, exclude=(*_TRANSFER_FIELDS, "gc_grace_s"))
def pull_cmd(image_url: str, dest_dir: str, as_json: bool, **flags: Any) -> None:
    """Download, verify and unpack IMAGE_URL into DEST_DIR (which must not hold its files)."""
    settings = _settings(flags)
    with _progress("download", as_json) as progress:
        result = asyncio.run(pull_image(image_url, dest_dir, settings=settings, progress=progress))
    if as_json:
        _emit(result.to_json())
        return
    st, totals = result.stats, result.manifest.totals
    click.echo(
        f"{result.image_url} → {dest_dir}: {fmt_image_size(totals.bytes, totals.stored_bytes)}"
        f", verified in {st.seconds:.1f} s ({fmt_rate(st.rate)})"
    )


@images.command("keygen")
@click.argument("private_key", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Overwrite an existing key file.")
def keygen_cmd(private_key: str, force: bool) -> None:
    """Write a new Ed25519 signing key to PRIVATE_KEY (mode 0600) and its public key to
    PRIVATE_KEY.pub. Agents sign with the private key (signing_key_file); restoring hosts
    trust the public one (verify_key_file). See docs/security.md."""
    from spotguard.errors import ConfigError
    from spotguard.image import generate_signing_key

    path = Path(private_key)
    pub = path.with_name(path.name + ".pub")
    if not force and (path.exists() or pub.exists()):
        raise ConfigError(f"{path} or {pub} exists; pass --force to replace them")
    private, public = generate_signing_key()
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(private)
        pub.write_bytes(public)
    except OSError as exc:
        raise ConfigError(f"cannot write the key to {path}: {exc}") from exc
    click.echo(f"signing key: {path} (keep it secret)\npublic key:  {pub}")
