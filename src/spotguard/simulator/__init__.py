"""``metadata-sim``: an AWS IMDSv2, GCP metadata and Azure Scheduled Events emulator with a
control API to inject, change and cancel notices and faults while it runs.

Users rehearse interruptions with it; spotguard's tests and demo run against it.
"""

from spotguard.simulator.client import SimClient
from spotguard.simulator.server import MetadataSim
from spotguard.simulator.state import SimFacts, SimNotice, SimState

__all__ = ["MetadataSim", "SimClient", "SimFacts", "SimNotice", "SimState"]
