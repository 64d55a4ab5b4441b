"""Stream checkpoint images between CRIU and the image store, with no staging copy.

* :class:`Capture` / :class:`Serve` — CRIU's image-streamer protocol (``--stream``), the
  capture side (dump → sink) and the serve side (source → restore);
* :class:`StreamTarget` / :class:`StreamSource` — the engine's ``DumpTarget`` /
  ``RestoreSource`` backed by :class:`~spotguard.image.ImageWriter` / ``ImageReader``;
* :class:`DirSink` / :class:`DirSource` — a plain directory on either side.
"""

from spotguard.stream.capture import Capture, CaptureSink, CaptureStats, FileOut
from spotguard.stream.direct import ImageSink, StreamTarget
from spotguard.stream.local import DirSink, DirSource
from spotguard.stream.serve import Serve, ServeSource, ServeStats
from spotguard.stream.source import StreamSource

__all__ = [
    "Capture",
    "CaptureSink",
    "CaptureStats",
    "DirSink",
    "DirSource",
    "FileOut",
    "ImageSink",
    "Serve",
    "ServeSource",
    "ServeStats",
    "StreamSource",
    "StreamTarget",
]
