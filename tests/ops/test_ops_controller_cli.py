"""Issue 28.5, the controller's refusals in the command line: one line as a person reads it
(no ``ControllerError:`` or other type name in front). A real controller process, real HTTP,
the real ``spotguard jobs`` / ``migrate`` commands."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from ops_helpers import clean_env, free_port

from sgtest import sg
from spotguard.contracts import EventKind, make_event

TOKEN = "ops-admin-token-0123456789abcdef"
VM1 = {"provider": "local", "instance_id": "vm-first", "region": "local", "zone": "local-1"}


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = clean_env(SPOTGUARD_CONTROLLER_TOKEN=TOKEN, SPOTGUARD_STATE_DIR=str(tmp_path))
    proc = subprocess.Popen(
        ["spotguard", "controller", "--listen", f"127.0.0.1:{port}",
         "--state", str(tmp_path / "controller.db")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the controller did not start: {proc.stderr.read()}")  # type: ignore[union-attr]
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def post_event(url: str, job: str, kind: EventKind) -> None:
    body = make_event(job=job, kind=kind, instance=VM1).model_dump_json().encode()
    req = urllib.request.Request(url + "/v1/events", data=body, method="POST", headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})  # fmt: skip
    urllib.request.urlopen(req, timeout=10).close()


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"SPOTGUARD_CONTROLLER_URL": url, "SPOTGUARD_CONTROLLER_TOKEN": TOKEN}
    return sg(*args, env={"SPOTGUARD_CONFIG": os.devnull, **env}, timeout=60)


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout == ""
    return lines[0]


def test_controller_refusals_read_as_sentences(controller: str) -> None:
    post_event(controller, "busy", EventKind.STARTED)
    line = one_line(cli(controller, "jobs", "unpark", "busy"))
    assert line == (
        "spotguard: error: the controller refused: job 'busy' is protected, not parked; only a "
        "job parked to a store can be unparked through the controller"
    )
    line = one_line(cli(controller, "jobs", "retry", "busy"))
    assert line.startswith("spotguard: error: the controller refused: job 'busy'"), line
    line = one_line(cli(controller, "migrate", "busy", "--to", "no-such-region-9"))
    assert line.startswith("spotguard: error: the controller refused: "), line
    assert "Error:" not in line and "Error: " not in line, line
    gone = one_line(cli(controller, "jobs", "show", "nosuch"))
    assert "Error:" not in gone, gone
    # the API's own answer keeps the type for machines
    req = urllib.request.Request(controller + "/v1/jobs/busy/unpark", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert json.loads(err.value.read())["error"].startswith("ControllerError: job 'busy'")


def test_without_type_takes_off_spotguard_error_names_only() -> None:
    from spotguard.errors import without_type

    assert without_type("PreflightError: criu x is not an executable") == (
        "criu x is not an executable"
    )
    assert without_type("ControllerError: job 'a' is failed") == "job 'a' is failed"
    assert without_type("note: not a type") == "note: not a type"
    assert without_type("KeyError: 'x'") == "KeyError: 'x'"  # not one of spotguard's


def test_a_job_view_is_one_snapshot_while_events_are_applied(controller: str) -> None:
    """``GET /v1/jobs/JOB`` (what ``jobs show`` and the demo read) read the job, then its
    history, then its images, each on its own: an image made durable in between showed in the
    history with the job's ``image_url`` still the one before (the demo under load: "the
    image  does not verify: '' is not an image URL")."""
    import threading

    post_event(controller, "snap", EventKind.STARTED)
    stop = threading.Event()
    torn: list[str] = []

    def watch() -> None:
        req = urllib.request.Request(controller + "/v1/jobs/snap",
                                     headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        while not stop.is_set():
            with urllib.request.urlopen(req, timeout=10) as r:
                view = json.loads(r.read())
            images = [i["image_url"] for i in view["images"]]
            durable = [h for h in view["history"] if "is durable" in h["reason"]]
            if len(durable) != len(images) or (images and view["image_url"] != images[-1]):
                torn.append(f"image_url {view['image_url']!r}, {len(durable)} durable rows, "
                            f"images {images[-1:]}")  # fmt: skip

    watchers = [threading.Thread(target=watch) for _ in range(2)]
    for w in watchers:
        w.start()
    try:
        for i in range(100):  # under the 120 events a minute one job may send
            url = f"file:///s/snap/images/{i:04d}"
            ev = make_event(job="snap", kind=EventKind.DURABLE, instance=VM1, mode="resume",
                            image_url=url)  # fmt: skip
            req = urllib.request.Request(
                controller + "/v1/events",
                data=ev.model_dump_json().encode(),
                method="POST",
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=10).close()
    finally:
        stop.set()
        for w in watchers:
            w.join()
    assert torn == [], f"{len(torn)} torn views, first: {torn[0]}"
