"""Logging: structured JSON lines (for daemons and machines) or short text (for humans).

Modules log with the standard library (``logging.getLogger(__name__)``) and put structured
fields in ``extra=``; :func:`setup` picks the format. One line per step, never a traceback for
an expected failure (those are :class:`~spotguard.errors.SpotguardError`).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

_STD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a record."""
    return {k: v for k, v in record.__dict__.items() if k not in _STD}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and every extra field."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(fields(record))
        if record.exc_info and record.exc_info[0] is not None:
            out["error"] = f"{record.exc_info[0].__name__}: {record.exc_info[1]}"
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS level logger: msg key=value ...`` — for terminals."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        extra = " ".join(f"{k}={v}" for k, v in fields(record).items())
        line = f"{ts} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[0] is not None:
            line += f" ({record.exc_info[0].__name__}: {record.exc_info[1]})"
        return f"{line} {extra}".rstrip()


def setup(fmt: Literal["json", "text"] = "text", level: str = "INFO") -> None:
    """Configure the root logger once for the process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "aiohttp.access", "google", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
