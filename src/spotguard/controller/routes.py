"""The controller's HTTP routes, declared once: the server (:mod:`spotguard.controller.api`)
registers these templates and every client (:mod:`spotguard.controller.client`: the agent's
reports and directive polls, the CLI) fills them in with :func:`path` (the NCCL groups' routes
with :func:`group_path`). What each route takes and answers is in
:mod:`spotguard.controller.api`."""

from __future__ import annotations

from urllib.parse import quote

#: ``POST``: an agent event; answers an EventAnswer
EVENTS = "/v1/events"
#: ``GET``: every job's summary
JOBS = "/v1/jobs"
#: ``GET``: one job (state, owner, history, images)
JOB = "/v1/jobs/{job}"
#: ``POST``: move a job to another region or instance type
MIGRATE = "/v1/jobs/{job}/migrate"
#: ``POST``: relaunch a job parked to a store
UNPARK = "/v1/jobs/{job}/unpark"
#: ``POST``: relaunch a failed job from its newest image
RETRY = "/v1/jobs/{job}/retry"
#: ``GET``: what the controller wants from a job's agent now (``?epoch=N``)
DIRECTIVE = "/v1/jobs/{job}/directive"
#: ``POST``: a member opens or joins its NCCL group's freeze (a FreezeRequest); ``GET``
#: (``?after=G&wait=S``): the group's newest freeze generation, a long poll
GROUP_FREEZE = "/v1/groups/{group}/freeze"
#: ``PUT``: a job's entry in a round of its group (a RoundEntry); ``GET``
#: (``?have=N&wait=S``): the round, a long poll
GROUP_ROUND = "/v1/groups/{group}/rounds/{round}"
#: ``GET``: liveness, no token
HEALTHZ = "/healthz"
#: ``GET``: Prometheus text, no token
METRICS = "/metrics"

#: routes that take a bearer token (the others are open)
API_PREFIX = "/v1/"


def path(route: str, job: str | None = None) -> str:
    """``route`` with its ``{job}`` filled in (quoted: a job name is one path segment)."""
    if "{job}" not in route:
        return route
    if job is None:
        raise ValueError(f"route {route} needs a job")
    return route.format(job=quote(job, safe=""))


def group_path(route: str, group: str, round: str | None = None) -> str:
    """``route`` with its ``{group}`` (and ``{round}``) filled in, each quoted as one path
    segment."""
    if "{round}" in route:
        if round is None:
            raise ValueError(f"route {route} needs a round")
        return route.format(group=quote(group, safe=""), round=quote(round, safe=""))
    return route.format(group=quote(group, safe=""))
