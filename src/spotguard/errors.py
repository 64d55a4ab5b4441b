"""One exception tree for all of spotguard.

Every error spotguard raises on purpose derives from :class:`SpotguardError`. Low-level errors
(OSError, botocore, aiohttp, CRIU exit codes, driver return codes) are mapped to one of these
in the module that talks to the low-level thing, re-raised ``from`` the original, so callers
decide on the *kind* of failure — retry, fail over, or give up — never on a library's class.
The CLI turns any ``SpotguardError`` into one clear line and a non-zero exit, never a traceback.

::

    SpotguardError
    ├── ConfigError                 bad setting, file or flag (exit 2)
    │   └── MissingExtra            a store/provider needs an optional extra not installed
    ├── NoticeError                 a notice source could not be read
    │   ├── MetadataUnavailable     connection refused, timeout, 5xx (transient: retry)
    │   ├── MetadataMalformed       an answer that is not what the cloud documents
    │   └── SimulatorError          metadata-sim refused a control request or is unreachable
    ├── JobError                    the job to protect
    │   ├── JobNotFound             no such pid / name / cgroup
    │   └── ParkError               park/unpark refused (already parked, port taken, no room)
    ├── CheckpointError             freezing or restoring a process tree
    │   ├── CriuError               CRIU failed; carries the command, exit code and log tail
    │   ├── GpuError                the driver checkpoint API or NVML failed
    │   ├── StepTimeout             a step ran past its time limit
    │   ├── StreamError             streaming image files between CRIU and spotguard failed
    │   └── PreflightError          freeze or restore refused before touching anything
    │       ├── MismatchError       image and host differ (names both sides)
    │       └── UndumpableError     the job holds what CRIU cannot dump (names pid, resource, fix)
    ├── ImageError                  checkpoint image format and content
    │   ├── ImageNotFound           no complete image (no manifest) at that place
    │   ├── ImageCorrupt            a chunk failed verification (names the chunk)
    │   └── DecryptionError         missing or wrong encryption key
    ├── StoreError                  object storage
    │   ├── StoreUnavailable        unreachable, 5xx, throttled (transient: retry)
    │   ├── ObjectNotFound          no such key
    │   └── PreconditionFailed      write refused: object exists / changed
    ├── ProviderError               a cloud provider's verbs
    │   ├── PrecheckError           request can never succeed (bad spec, auth): don't retry
    │   ├── CapacityError           no capacity / price too low here: fail over
    │   ├── UnknownInstanceType     not in the catalog
    │   └── NoMatchingOffer         nothing anywhere can restore this image
    ├── AgentNotRunning             nothing answers on the local agent's API (exit 3)
    ├── AgentTaskDied               one of the agent's tasks raised: the agent stops (exit 1)
    ├── ControllerError             the controller API or its state
    │   ├── AuthError               missing or wrong token
    │   └── StateError              the state file is unreadable or inconsistent
    └── DemoError                   ``spotguard demo``: a link of the chain did not hold (names it)
"""

from __future__ import annotations

from collections.abc import Sequence


class SpotguardError(Exception):
    """Base of every error spotguard raises on purpose."""

    exit_code = 1


class ConfigError(SpotguardError):
    """A setting, config file or flag is invalid."""

    exit_code = 2


class MissingExtra(ConfigError):
    """A store, provider or feature needs an optional extra (``spotguard[aws]``, ...) that is
    not installed; ``extra`` names it."""

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


class AgentNotRunning(SpotguardError):
    """Nothing answers on the local agent's API: it is stopped, crashed or never started.
    Exit status 3, as ``systemctl status`` uses for a unit that is not running."""

    exit_code = 3


class AgentTaskDied(SpotguardError):
    """A task of the agent (protecting a job, watching notices, ...) raised: the agent stops
    with this error instead of running on blind."""


class NoticeError(SpotguardError):
    """A notice source could not be read."""


class MetadataUnavailable(NoticeError):
    """The metadata service did not answer usefully (refused, timeout, 5xx). Transient."""


class MetadataMalformed(NoticeError):
    """The metadata service answered with something the cloud does not document."""


class SimulatorError(NoticeError):
    """The metadata emulator refused a control request or could not be reached."""


class JobError(SpotguardError):
    """The job spotguard should protect is not usable."""


class JobNotFound(JobError):
    """No process, job name or cgroup matches."""


class ParkError(JobError):
    """Park or unpark was refused before anything was done; the job's state stays where it is."""


class CheckpointError(SpotguardError):
    """Freezing or restoring a process tree failed."""


class CriuError(CheckpointError):
    """CRIU failed. Carries what ran, its exit code and the tail of its log."""

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        log_path: str | None = None,
        log_tail: str = "",
    ) -> None:
        detail = message
        if returncode is not None:
            detail += f" (criu exit {returncode})"
        if log_tail:
            detail += f"\n--- criu log ({log_path}) ---\n{log_tail}"
        super().__init__(detail)
        self.argv = list(argv)
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail


class GpuError(CheckpointError):
    """The NVIDIA driver checkpoint API or NVML failed."""


class StepTimeout(CheckpointError):
    """A checkpoint or restore step ran past its time limit."""


class StreamError(CheckpointError):
    """Streaming image files between CRIU and spotguard (``--stream``) failed."""


class PreflightError(CheckpointError):
    """Freeze or restore refused before touching anything (missing CRIU, PIDs taken, ...)."""


class MismatchError(PreflightError):
    """The image and this host differ in something restore depends on."""

    def __init__(self, what: str, image_side: object, host_side: object) -> None:
        super().__init__(f"{what} mismatch: image has {image_side!r}, this host has {host_side!r}")
        self.what = what
        self.image_side = image_side
        self.host_side = host_side


class UndumpableError(PreflightError):
    """The job's tree holds something CRIU cannot dump; refused before any lock or dump.

    Not retryable: the same tree fails the same way until the job changes. ``findings``
    are the objects the freeze preflight produced (each names the pid, the process, the
    resource and what to do); the message lists them on one line.
    """

    retryable = False

    def __init__(self, job: str, findings: Sequence[object]) -> None:
        self.job = job
        self.findings = list(findings)
        listed = "; ".join(str(f) for f in self.findings)
        super().__init__(f"cannot checkpoint job {job!r}: {listed} (the job keeps running)")


class ImageError(SpotguardError):
    """A checkpoint image is missing, malformed or fails verification."""


class ImageNotFound(ImageError):
    """No complete image (no manifest) at that place."""


class ImageCorrupt(ImageError):
    """A chunk failed verification; ``chunk`` names it."""

    def __init__(self, message: str, *, chunk: str | None = None) -> None:
        super().__init__(message)
        self.chunk = chunk


class DecryptionError(ImageError):
    """The image is encrypted and the key is missing or wrong."""


class StoreError(SpotguardError):
    """Object storage failed."""


class StoreUnavailable(StoreError):
    """The store is unreachable, answered 5xx or throttled. Transient: retry."""


class ObjectNotFound(StoreError):
    """No object at that key."""


class PreconditionFailed(StoreError):
    """A conditional write was refused (the object exists or changed)."""


class ProviderError(SpotguardError):
    """A cloud provider operation failed."""


class PrecheckError(ProviderError):
    """The request can never succeed as asked (bad spec, permissions). Do not retry."""


class CapacityError(ProviderError):
    """No capacity (or spot price too low) in this zone/region. Fail over elsewhere."""


class UnknownInstanceType(ProviderError):
    """The instance or machine type is not in the provider's catalog."""


class NoMatchingOffer(ProviderError):
    """No offer anywhere the strategy may look can restore this image."""


class ControllerError(SpotguardError):
    """The controller API or its state failed."""


class AuthError(ControllerError):
    """Missing or wrong bearer token."""


class StateError(ControllerError):
    """The controller's state file is unreadable or inconsistent."""


class DemoError(SpotguardError):
    """``spotguard demo``: one link of the end-to-end chain did not hold; ``step`` names it."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.reason = message
