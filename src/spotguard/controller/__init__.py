"""The controller: relaunch a matching instance when a job's VM goes away, and restore it there.

* :mod:`~spotguard.controller.state` — SQLite state (WAL, versioned), every transition recorded
* :mod:`~spotguard.controller.machine` — the job state machine's reaction to agent events
* :mod:`~spotguard.controller.core` — one reconcile loop per job; launches through a provider
* :mod:`~spotguard.controller.strategies` — recovery strategies by name
* :mod:`~spotguard.controller.api` — the HTTP API for agents and the CLI
* :mod:`~spotguard.controller.server` — all of it as one async context

See docs/controller.md.
"""

from __future__ import annotations

from spotguard.controller.core import Controller
from spotguard.controller.server import ControllerServer, serve_forever
from spotguard.controller.settings import ClientSettings, ControllerSettings
from spotguard.controller.state import JobRecord, JobState, StateDB
from spotguard.controller.strategies import STRATEGIES, Strategy, get_strategy, register

__all__ = [
    "STRATEGIES",
    "ClientSettings",
    "Controller",
    "ControllerServer",
    "ControllerSettings",
    "JobRecord",
    "JobState",
    "StateDB",
    "Strategy",
    "get_strategy",
    "register",
    "serve_forever",
]
