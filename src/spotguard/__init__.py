"""spotguard: keep GPU jobs alive through spot interruptions.

The public surface is listed in ``__all__``; everything else is private to the package.
"""

from spotguard.errors import SpotguardError
from spotguard.facts import GpuDevice, GpuInventory, HostFacts, InstanceFacts
from spotguard.notices.base import Cloud, Notice, NoticeKind, NoticeSource
from spotguard.timeline import Step, Timeline

__version__ = "0.1.0"

__all__ = [
    "Cloud",
    "GpuDevice",
    "GpuInventory",
    "HostFacts",
    "InstanceFacts",
    "Notice",
    "NoticeKind",
    "NoticeSource",
    "SpotguardError",
    "Step",
    "Timeline",
    "__version__",
]
