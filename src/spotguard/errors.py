"""One exception tree for all of spotguard.

Every error spotguard raises on purpose derives from :class:`SpotguardError`. Low-level errors
(OSError, botocore, aiohttp, CRIU and driver codes) are mapped to one of these where they are
met, raised ``from`` the original: callers decide by the *kind* of failure, never a library's
class; the CLI prints one clear line and exits non-zero, never a traceback. Every class says
whether it is **retryable** (``[r]`` in the tree: tried again later or elsewhere, the same step
may succeed) and has a stable snake_case **code** (``ImageCorrupt`` → ``image_corrupt``);
errors cross machines as :class:`spotguard.contracts.WireError` carrying both.
``image_fault`` marks errors caused by the image itself (an older image may restore).

::

    SpotguardError
    ├── ConfigError                 bad setting, file or flag (exit 2)
    │   ├── MissingExtra            a store/provider needs an optional extra not installed
    │   └── KeyFetchError           the fleet's image keys cannot be fetched from their source
    ├── NoticeError             [r] a notice source could not be read
    │   ├── MetadataUnavailable [r] connection refused, timeout, 5xx (transient: retry)
    │   ├── MetadataMalformed       an answer that is not what the cloud documents
    │   └── SimulatorError          metadata-sim refused a control request or is unreachable
    ├── JobError                    the job to protect
    │   ├── JobNotFound             no such pid / name / cgroup
    │   ├── ParkError               park/unpark refused (already parked, port taken, no room)
    │   └── JobStateError           an agent's job state asked to move where it cannot go
    ├── CheckpointError         [r] freezing or restoring a process tree
    │   ├── CriuError           [r] CRIU failed; carries the command, exit code and log tail
    │   ├── GpuError            [r] the driver checkpoint API or NVML failed
    │   │   └── GpuUnsupportedError the driver refused (managed memory, CUDA IPC): not retryable
    │   ├── NcclError           [r] releasing or rebuilding a job's NCCL communicators failed
    │   ├── InjectError         [r] system calls could not be run inside a restored process
    │   ├── StepTimeout         [r] a step ran past its time limit
    │   ├── StreamError         [r] streaming image files between CRIU and spotguard failed
    │   ├── ContainerError      [r] the container runtime (podman) failed; names the command
    │   │   └── RuntimeCriuError [r] the runtime's CRIU refused ("criu failed"): CRIU's reason
    │   └── PreflightError          freeze or restore refused before touching anything
    │       ├── MismatchError       image and host differ (names both sides)
    │       ├── UnsafePath          a local directory is not private (another owner, a link)
    │       ├── UndumpableError     the job holds what CRIU cannot dump (names pid, resource, fix)
    │       └── MissingMount    [r] a mount the job uses (bind mount, volume) is absent here
    ├── ImageError                  checkpoint image format and content
    │   ├── ImageNotFound           no complete image (no manifest) at that place
    │   ├── ImageCorrupt            a chunk failed verification (names the chunk)
    │   ├── DecryptionError         missing or wrong encryption key
    │   └── ImageUntrusted          refused as untrustworthy before a byte is written (names what)
    │       ├── UnsignedImage       not authenticated (or plaintext) where a key is configured
    │       ├── BadSignature        signature/MAC does not match: altered, mixed, truncated
    │       ├── UntrustedSigner     signed by a key this host does not trust
    │       ├── ImageRollback       older sequence than a newer authenticated image of the job
    │       └── UnsafeCarriedFile   a carried file outside what the job owns (path, mode, link)
    ├── DestinationError        [r] a directory on this host could not take what was written
    ├── StoreError              [r] object storage
    │   ├── StoreUnavailable    [r] unreachable, 5xx, throttled (transient: retry)
    │   ├── ObjectNotFound          no such key
    │   └── PreconditionFailed      write refused: object exists / changed
    ├── ProviderError           [r] a cloud provider's verbs
    │   ├── PrecheckError           request can never succeed (bad spec, auth): don't retry
    │   ├── CapacityError       [r] no capacity / price too low here: fail over
    │   ├── UnknownInstanceType     not in the catalog
    │   └── NoMatchingOffer         nothing anywhere can restore this image
    ├── AgentNotRunning         [r] nothing answers on the local agent's API (exit 3)
    ├── AgentTaskDied               one of the agent's tasks raised: the agent stops (exit 1)
    ├── ControllerError         [r] the controller API or its state
    │   ├── AuthError               missing or wrong token; a token that may not act there
    │   │   └── TokenRejected       [r] the controller does not know the token (401): retried
    │   ├── ControllerRefused       the controller refused a request for good (400, 409, 4xx)
    │   ├── NotOwner                the sender no longer owns the job (fenced: stand down)
    │   ├── EventTooLarge           an agent event over the controller's size limit (413)
    │   ├── EventRateLimited    [r] too many events or bytes from one token for one job (429)
    │   └── StateError          [r] the state file is unreadable or inconsistent
    │       └── StateRefused        empty, corrupt or another program's: the operator acts (exit 2)
    └── DemoError                   ``spotguard demo``: a link of the chain did not hold (names it)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class SpotguardError(Exception):
    """Base of every error spotguard raises on purpose.

    ``retryable``: may the same step succeed when tried again (later, or on another
    machine)? ``code``: stable snake_case name for the wire and logs (set from the class
    name unless a class sets its own). ``image_fault``: the image itself is at fault.
    """

    exit_code = 1
    retryable: ClassVar[bool] = False
    image_fault: ClassVar[bool] = False
    code: ClassVar[str] = "spotguard_error"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            cls.code = _snake(cls.__name__)


class ConfigError(SpotguardError):
    """A setting, config file or flag is invalid."""

    exit_code = 2
    retryable = False


class MissingExtra(ConfigError):
    """A store, provider or feature needs an optional extra (``spotguard[aws]``, ...) that is
    not installed; ``extra`` names it."""

    retryable = False

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


class KeyFetchError(ConfigError):
    """``spotguard fetch-keys``: a key source (Secrets Manager, SSM, Secret Manager) refused
    or kept failing. Not retryable as such: the command already retried transient failures."""

    exit_code = 1
    retryable = False


class AgentNotRunning(SpotguardError):
    """Nothing answers on the local agent's API: it is stopped, crashed or never started.
    Exit status 3, as ``systemctl status`` uses for a unit that is not running."""

    exit_code = 3
    retryable = True  # the agent may be (re)starting


class AgentTaskDied(SpotguardError):
    """A task of the agent (protecting a job, watching notices, ...) raised: the agent stops
    with this error instead of running on blind."""

    retryable = False


class NoticeError(SpotguardError):
    """A notice source could not be read."""

    retryable = True


class MetadataUnavailable(NoticeError):
    """The metadata service did not answer usefully (refused, timeout, 5xx). Transient."""


class MetadataMalformed(NoticeError):
    """The metadata service answered with something the cloud does not document."""

    retryable = False


class SimulatorError(NoticeError):
    """The metadata emulator refused a control request or could not be reached."""

    retryable = False


class JobError(SpotguardError):
    """The job spotguard should protect is not usable."""

    retryable = False


class JobNotFound(JobError):
    """No process, job name or cgroup matches."""


class ParkError(JobError):
    """Park or unpark was refused before anything was done; the job's state stays where it is."""


class JobStateError(JobError):
    """A job-state move the agent's life cycle forbids (:mod:`spotguard.agent.jobstate`)."""


class CheckpointError(SpotguardError):
    """Freezing or restoring a process tree failed."""

    retryable = True


class CriuError(CheckpointError):
    """CRIU failed. Carries what ran, its exit code and the tail of its log."""

    retryable = True

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

    retryable = True


class GpuUnsupportedError(GpuError):
    """The driver refused to checkpoint a process's GPU state (CUDA_ERROR_NOT_SUPPORTED:
    managed memory, CUDA IPC): the same process fails the same way, so not retryable."""

    retryable = False


class NcclError(CheckpointError):
    """Releasing or rebuilding a job's NCCL communicators (spotguard's NCCL shim) failed: a
    rank did not quiesce in time, or the shim answered with an error."""


class InjectError(CheckpointError):
    """System calls could not be run inside a restored process (``checkpoint/inject.py``)."""


class StepTimeout(CheckpointError):
    """A checkpoint or restore step ran past its time limit."""


class StreamError(CheckpointError):
    """Streaming image files between CRIU and spotguard (``--stream``) failed."""


class ContainerError(CheckpointError):
    """The container runtime failed a step (``podman container checkpoint``, ``restore``, ...):
    the message names the command and carries the tail of what it said."""

    retryable = True


class RuntimeCriuError(ContainerError):
    """The runtime's CRIU failed (runc's "criu failed: type NOTIFY errno 0"); the message adds
    CRIU's own error lines (:func:`spotguard.container.runtime.once_more_if_criu_failed`)."""


class PreflightError(CheckpointError):
    """Freeze or restore refused before touching anything (missing CRIU, PIDs taken, ...)."""

    retryable = False


class UnsafePath(PreflightError):
    """A local path spotguard reads or writes as root is not private to it: owned by another
    user, a symlink, or writable by others (another user created it first, or swapped it)."""


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


class MissingMount(PreflightError):
    """A container image names a bind mount source or a volume that this host lacks, or a
    job's image a host mount the job uses (its files, its working directory) that this host
    lacks: they are the job's data, never carried in the image, so restore refuses before
    creating anything (another host that has them may restore it)."""

    retryable = True


class DestinationError(SpotguardError):
    """A local directory could not take what was written (full, I/O): not the image's fault."""

    retryable = True


class ImageError(SpotguardError):
    """A checkpoint image is missing, malformed or fails verification."""

    retryable = False
    image_fault = True


class ImageNotFound(ImageError):
    """No complete image (no manifest) at that place."""


class ImageCorrupt(ImageError):
    """A chunk failed verification; ``chunk`` names it."""

    def __init__(self, message: str, *, chunk: str | None = None) -> None:
        super().__init__(message)
        self.chunk = chunk


class DecryptionError(ImageError):
    """The image is encrypted and the key is missing or wrong."""

    retryable = False
    image_fault = False  # the host's key is missing or wrong: an older image needs it too


class ImageUntrusted(ImageError):
    """The image is refused as untrustworthy, before any byte of the job is written
    (docs/security.md). Fetching it again cannot help; another, genuine image may."""

    retryable = False


class UnsignedImage(ImageUntrusted):
    """Not authenticated (no signature, or plaintext) on a host that holds a key."""


class BadSignature(ImageUntrusted):
    """The manifest's signature or MAC does not match it: altered, mixed or truncated."""


class UntrustedSigner(ImageUntrusted):
    """Signed, but by a key this host does not trust."""


class ImageRollback(ImageUntrusted):
    """Genuine, but older (by authenticated sequence) than a newer image of the same job."""


class UnsafeCarriedFile(ImageUntrusted):
    """A carried file would be written outside what the job owns (path, mode or symlink)."""


class StoreError(SpotguardError):
    """Object storage failed."""

    retryable = True


class StoreUnavailable(StoreError):
    """The store is unreachable, answered 5xx or throttled. Transient: retry."""

    retryable = True


class ObjectNotFound(StoreError):
    """No object at that key."""

    retryable = False


class PreconditionFailed(StoreError):
    """A conditional write was refused (the object exists or changed)."""

    retryable = False


class ProviderError(SpotguardError):
    """A cloud provider operation failed."""

    retryable = True


class PrecheckError(ProviderError):
    """The request can never succeed as asked (bad spec, permissions). Do not retry."""

    retryable = False


class CapacityError(ProviderError):
    """No capacity (or spot price too low) in this zone/region. Fail over elsewhere."""

    retryable = True


class UnknownInstanceType(ProviderError):
    """The instance or machine type is not in the provider's catalog."""

    retryable = False


class NoMatchingOffer(ProviderError):
    """No offer anywhere the strategy may look can restore this image."""

    retryable = False


class ControllerError(SpotguardError):
    """The controller API or its state failed."""

    retryable = True


class AuthError(ControllerError):
    """Missing or wrong bearer token."""

    retryable = False


class TokenRejected(AuthError):
    """The controller does not know the bearer token (401): a wrong one, or one the
    controller is being restarted or rotated to. An agent's reports retry it slowly."""

    retryable = True


class ControllerRefused(ControllerError):
    """The controller refused a request for good (400 malformed or impossible, 409 a
    conflicting state, another 4xx): the same request cannot succeed; never resent."""

    retryable = False


class NotOwner(ControllerError):
    """The sender (instance and epoch) no longer owns the job at the controller: the job was
    relaunched elsewhere. Stand down; never retried."""

    retryable = False


class EventTooLarge(ControllerError):
    """An agent event larger than the controller takes (``MAX_EVENT_BYTES``): refused with
    413 before it is parsed or stored; never retried."""

    retryable = False


class EventRateLimited(ControllerError):
    """One token sent more events (or bytes) for one job than the controller takes in its
    window: refused with 429 and ``Retry-After``; retried later."""

    retryable = True

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StateError(ControllerError):
    """The controller's state file is unreadable or inconsistent."""

    retryable = True


class StateRefused(StateError):
    """A state file the controller will not use as it is: exit 2, no restart loop."""

    exit_code, retryable = 2, False


class DemoError(SpotguardError):
    """``spotguard demo``: one link of the end-to-end chain did not hold; ``step`` names it."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.reason = message


def without_type(message: str) -> str:
    """``"PreflightError: criu … not executable"`` → ``"criu … not executable"``: a message
    that crossed an API with its error type in front, as a person reads it (this module's)."""
    head, sep, rest = message.partition(": ")
    cls = globals().get(head) if sep else None
    if isinstance(cls, type) and issubclass(cls, SpotguardError):
        return rest
    return message
