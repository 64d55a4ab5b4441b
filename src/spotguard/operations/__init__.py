"""Checkpoint a job to a store URL and restore an image URL: the one composition of the engine,
the two ways to a store and the kept images. Used by the agent and by
``spotguard checkpoint PID --to URL`` / ``spotguard restore URL``.

Where each step lives:

=====================  ==================================================================
module                 what it owns
=====================  ==================================================================
``checkpoint.py``      the checkpoint chain, in order: choose paths → plan → prepare → run
                       (→ next path when the declared rule says so) → learn
``paths.py``           the path protocol, :class:`StreamedPath`, :class:`StagedPath`, the
                       fallback rule (``FALLBACK``) and :class:`ImageKept`
``kept.py``            staged images not durable yet: their records (written before an exit
                       upload starts, removed once the manifest is durable), adoption of
                       orphaned staging dirs, :func:`push_kept`
``results.py``         the one :class:`CheckpointResult` (built only by ``CheckpointResult.of``)
``restore.py``         restore (open → verify → source → engine) and recover
=====================  ==================================================================

The engine (:mod:`spotguard.checkpoint.engine`) stays the only place that orders freeze and
restore steps; its ``operation.json`` marker is the one crash marker.
"""

from __future__ import annotations

from spotguard.store import URL_SCHEMES

from .checkpoint import (
    StreamChoice,
    checkpoint,
    choose_paths,
    engine_for,
    exit_fits,
    is_url,
    kept_images_of,
    stream_supported,
)
from .kept import KeptImage, KeptImages, push_kept
from .paths import FALLBACK, CheckpointPath, ImageKept, OnFrozen, StagedPath, StreamedPath
from .restore import recover, restore
from .results import CheckpointResult, Frozen, Landed, RestoreResult

__all__ = [
    "FALLBACK",
    "URL_SCHEMES",
    "CheckpointPath",
    "CheckpointResult",
    "Frozen",
    "ImageKept",
    "KeptImage",
    "KeptImages",
    "Landed",
    "OnFrozen",
    "RestoreResult",
    "StagedPath",
    "StreamChoice",
    "StreamedPath",
    "checkpoint",
    "choose_paths",
    "engine_for",
    "exit_fits",
    "is_url",
    "kept_images_of",
    "push_kept",
    "recover",
    "restore",
    "stream_supported",
]
