"""Logging: structured JSON lines (for daemons and machines) or short text (for humans).

Modules log with the standard library (``logging.getLogger(__name__)``) and put structured
fields in ``extra=``; :func:`setup` picks the format. One line per step, never a traceback for
an expected failure (those are :class:`~spotguard.errors.SpotguardError`).

The field names are a vocabulary, kept here in :data:`FIELDS` (one name per meaning: a
notice's id is always ``notice``, an image's URL always ``image``), so a query over the logs
of every part finds what it looks for. The line's own keys (:data:`RESERVED`: ``ts``,
``level``, ``logger``, ``msg`` ...) are never extra fields: a test checks every ``extra=``
in the sources against both lists, and the formatters never let an extra field overwrite one
of them (it is written as ``extra_<name>`` instead).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

#: the levels ``--log-level`` accepts
LEVELS = ("debug", "info", "warning", "error", "critical")

#: commands that run as services (systemd units, the demo's log file, the wake listener):
#: they log INFO by default; every other command is interactive and logs warnings only, so
#: its result line is all an operator sees unless ``--verbose`` or ``--log-level`` asks
SERVICES = frozenset({"agent", "controller", "metadata-sim", "notices", "park-wake", "demo"})


def default_level(command: str | None, *, verbose: bool = False) -> str:
    """The log level of ``spotguard COMMAND`` when ``--log-level`` is not given: ``info`` for
    a service or with ``--verbose``, else ``warning``."""
    return "info" if verbose or command in SERVICES else "warning"


def verbose() -> None:
    """``--verbose`` after a command: INFO lines too (a level already lower, such as
    ``--log-level debug``, is kept)."""
    root = logging.getLogger()
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)


#: keys every JSON line has (or may have) of its own; no extra field may use them
RESERVED = frozenset({"ts", "time", "level", "logger", "msg", "message", "exception"})

#: every extra field a spotguard log line may carry, and what it means
FIELDS: dict[str, str] = {
    # what the line is about
    "step": "the step of an operation (detect, protect, notice, freeze, upload, ...)",
    "job": "a protected job's name",
    "pid": "a process id",
    "pids": "process ids (of one job)",
    "container": "a container job's container (podman:NAME)",
    "notice": "a notice's id",
    "kind": "a notice's or event's kind (preempt, rebalance, maintenance, drain, ...)",
    "action": "a notice's action in the cloud's words, or the agent's decision",
    "deadline": "a notice's deadline (ISO 8601, UTC)",
    "cancelled": "whether a notice was withdrawn",
    "source": "a notice source's name",
    "cloud": "the cloud (aws, gcp, azure, manual, fleet)",
    "image": "an image's URL",
    "store": "a store URL",
    "key": "an object key in a store",
    "chunk": "a chunk's digest",
    "dir": "a directory",
    "mountpoint": "where a mount sits in a job's mount namespace",
    "file": "a file",
    "key_id": "the id of an image signing or verify key (16 hex digits, never key material)",
    "key_source": "where the fleet's image keys are fetched from (aws-secretsmanager:ARN ...)",
    "path": "a URL path or a file path within an image",
    "url": "a URL served or called",
    "mode": "a checkpoint mode (resume, exit) or an image path (stream, stage)",
    "stream": "whether the image was streamed",
    "state": "a job's state at the controller",
    "event": "an agent event's kind",
    "event_id": "an agent event's id",
    "message_id": "a queue message's id",
    "instance": "an instance's name or facts",
    "instance_id": "a cloud instance id",
    "provider": "a cloud provider's name",
    "strategy": "a relaunch strategy's name",
    "offer": "an instance offer (type, zone, price)",
    "client_token": "an idempotent launch token",
    "vm": "a local VM's name",
    "id": "a cloud operation's id",
    "clouds": "the clouds a metadata emulator serves",
    "controller": "the controller's URL",
    "listen": "an address listened on",
    "peer": "a connecting peer",
    "ports": "TCP ports (a job's listening ports)",
    "task": "an asyncio task's name",
    "op": "a store operation (get, put, head, ...)",
    "argv": "a command line run",
    "what": "what a demo step checks",
    # outcomes and figures
    "error": "why something failed (one line)",
    "removed": "how many left-overs a clean-up removed (work directories of killed operations)",
    "reason": "why a decision was made",
    "fields": "names of fields (of an agent report that this controller does not know)",
    "decision": "what the agent decided about a notice",
    "status": "an HTTP status",
    "attempt": "the attempt number of a retried call",
    "failures": "consecutive failures",
    "retry_in": "seconds until the next attempt",
    "seconds": "how long a step took, in seconds",
    "previous": "a setting's value before spotguard changed it",
    "seconds_left": "seconds left until a deadline",
    "seconds_kept": "how long a kept image has waited, in seconds",
    "pause_s": "how long the job was paused, in seconds",
    "freeze_seconds": "seconds from the freeze to the state in host memory",
    "start_at": "when a deferred checkpoint starts (ISO 8601, UTC)",
    "bytes": "bytes written or read",
    "stored_bytes": "bytes stored (after compression and dedup)",
    "skipped_bytes": "bytes already in the store (dedup)",
    "need_bytes": "bytes a staging place needs",
    "hold_bytes": (
        "the most bytes of a leave-running image it may keep in host memory while the job "
        "goes on (what it held: peak_buffered)"
    ),
    "peak_buffered": "most bytes held in memory at once",
    "pipe_bytes": "the size of the pipes a stream got from the kernel",
    "step_seconds": "seconds per step of the chunk pipeline, summed over its chunks",
    "chunk_size": "an image's chunk size in bytes",
    "zstd_level": "the zstd compression level",
    "plan": "the deadline planner's predicted seconds per stage",
    "predicted": "the planner's predicted seconds per stage (beside the actual)",
    "actual": "measured seconds per stage",
    "deadline_s": "seconds left until the deadline when planned",
    "image_bytes": "estimated bytes of an image (host and GPU memory)",
    "gpu_bytes": "estimated bytes of GPU memory",
    "gpu_driver": "whether the GPU driver's checkpoint API is loaded",
    "nvml": "whether NVML (the GPU inventory) is loaded",
    "fits": "whether the plan fits before the deadline",
    "met": "whether the deadline was met",
    "thp": "the host's transparent huge page setting",
    "record": "a kept-image record",
    "ranges": "how many ranges of a process's memory (the GPU memory carried beside CRIU)",
    "prefault_ranges": "ranges the driver mapped for a checkpoint, faulted in beside it",
    "prefault_bytes": "bytes of those ranges faulted in beside the driver's checkpoint",
    "prefault_first_s": "seconds from a checkpoint's start until the driver's range was seen",
    "prefault_capped": "whether the driver's ranges held more than the prefault's budget",
    "criu": "the CRIU binary and version",
    "gpus": "GPUs an image needs",
    "gpu_pids": "processes holding a GPU",
    "communicators": "NCCL communicators released or rebuilt",
    "images_dir": "an image directory",
    "staging": "a staging directory",
    "before_freeze": "whether a failure came before the freeze",
    "thawed": "whether a frozen job was thawed",
    "interrupted": "whether an operation was interrupted",
    # parking (park/)
    "place": "where a parked job's memory is kept (host memory, disk, store)",
    "location": "the path or URL of a parked job's image",
    "clients": "clients that connected to a parked job",
    "free_bytes": "free GPU memory in bytes",
    "target": "where a job is moved or unparked to (a region, an instance type)",
    # garbage collection (``images gc``: the result's own fields)
    "jobs": "jobs looked at",
    "images_kept": "complete images kept",
    "images_deleted": "images deleted",
    "stale_markers_deleted": "stale writer markers deleted",
    "chunks_deferred": "chunks of a held leave-running image kept raw until the job resumed",
    "buffers_made": "chunk buffers an image's writer made (fresh memory) over the image",
    "chunks_deleted": "chunks deleted",
    "bytes_freed": "bytes freed",
    "chunks_kept_young": "unreferenced chunks kept for being younger than the grace",
    "chunks_kept_referenced": "chunks kept because a kept image uses them",
    "chunk_gc_skipped_writer_active": "chunk collection skipped while a writer was active",
    "dry_run": "whether nothing was deleted",
    "pending": "how many deliveries were still pending (webhooks dropped at shutdown)",
    "group": "an NCCL group's name (spotguard run --nccl-group: one run's jobs on several VMs)",
    "generation": "an NCCL group's freeze generation",
    "opened_by": "the job whose agent opened an NCCL group's freeze",
    "given": "the communicators (keys) whose fresh NCCL id this agent gave its group",
}

_STD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a record (one that would overwrite a key of the line itself,
    see :data:`RESERVED`, is given as ``extra_<name>``)."""
    return {
        (f"extra_{k}" if k in RESERVED else k): v
        for k, v in record.__dict__.items()
        if k not in _STD
    }


def unknown_fields(names: set[str]) -> set[str]:
    """The names that are not in the vocabulary, are reserved, or are attributes of the
    standard library's LogRecord (which refuses them at run time) — for tests and reviews."""
    return {n for n in names if n not in FIELDS or n in RESERVED or n in _STD}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and every extra field."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = fields(record)
        out.update(
            ts=datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            level=record.levelname.lower(),
            logger=record.name,
            msg=record.getMessage(),
        )
        if record.exc_info and record.exc_info[0] is not None:
            out["exception"] = f"{record.exc_info[0].__name__}: {record.exc_info[1]}"
        head = {k: out.pop(k) for k in ("ts", "level", "logger", "msg")}
        return json.dumps({**head, **out}, default=str)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS level logger: msg key=value ...`` — for terminals."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        extra = " ".join(f"{k}={v}" for k, v in fields(record).items())
        line = f"{ts} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[0] is not None:
            line += f" ({record.exc_info[0].__name__}: {record.exc_info[1]})"
        return f"{line} {extra}".rstrip()


def setup(fmt: Literal["json", "text"] = "text", level: str = "info") -> None:
    """Configure the root logger once for the process (stderr). ``level`` is one of
    :data:`LEVELS` (any case); anything else is a ValueError naming them."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "aiohttp.access", "google", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a request line or header over 8190 bytes,
    bytes that are not HTTP) at ERROR with a traceback, though it answered the peer 400 and
    nothing here failed: any client can send one. Such a record becomes one warning line with
    the ``peer`` and the ``error``; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        code = getattr(exc, "code", None)
        if type(exc).__module__ != "aiohttp.http_exceptions" or not isinstance(code, int):
            return True
        if 400 <= code < 500:
            record.peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
            record.error = " ".join(str(getattr(exc, "message", "") or type(exc).__name__).split())
            record.msg, record.args = "malformed HTTP request refused", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_malformed_requests() -> None:
    """Install :class:`MalformedRequests` on aiohttp's server logger (once; the controller's
    and the agent's HTTP servers call this when they build their application)."""
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server.filters):
        server.addFilter(MalformedRequests())
