"""The end-to-end scenario of ``spotguard demo``, in order, each step checked.

1. the embedded default comes up (:class:`~spotguard.demo.stack.DemoStack`), and the
   uninterrupted reference run starts alongside (same arguments, no sleeping);
2. the sample job starts on VM 1 and a real agent protects it (the controller says so);
3. once the job printed step K, the notice is injected into VM 1's metadata service (or an
   operator drain is asked of VM 1's agent through its local API);
4. the agent reports notice → frozen → durable (bytes reaching the store are shown meanwhile);
5. preempt / maintenance / drain: the job stops on VM 1, the controller launches VM 2 through
   the local provider, VM 2's agent restores the image; rebalance: the job resumes on VM 1;
6. the job finishes; its output must equal the reference run's, byte for byte, and the image
   must verify chunk by chunk.

Any step that does not hold raises :class:`~spotguard.errors.DemoError` naming it; the report
then carries that one reason, and every process is stopped either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from spotguard.agent.client import call
from spotguard.checkpoint.jobs import JobInfo, exit_status, list_jobs
from spotguard.demo.options import JOB_NAME, DemoOptions
from spotguard.demo.report import DemoReport, durable_record, first_difference, timeline
from spotguard.demo.stack import FACTS, DemoStack
from spotguard.demo.ui import Ui
from spotguard.demo.watch import Follower, View, has_event, store_bytes
from spotguard.errors import DemoError, SpotguardError
from spotguard.image import ImageReader, ImageSettings, verify_image
from spotguard.log import JsonFormatter

NOTICE_TIMEOUT_S = 20.0


def _steps_printed(job: JobInfo) -> list[str]:
    try:
        text = (job.dir / "stdout").read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith("step ")]


async def _wait_for_step(stack: DemoStack, job: JobInfo, ui: Ui, step: int, within: float) -> None:
    ui.waiting(f"waiting for the job to reach step {step} on VM 1")
    end = time.monotonic() + within
    while len(_steps_printed(job)) < step:
        status = exit_status(job)
        if status is not None:
            raise DemoError("job", f"the job ended (status {status}) before step {step}")
        _check_agent1(stack, "job")
        if time.monotonic() > end:
            raise DemoError("job", f"the job did not reach step {step} within {within:.0f} s")
        await asyncio.sleep(0.05)
    ui.event(f"the job reached step {step} on VM 1")


def _check_agent1(stack: DemoStack, step: str, *, may_end: bool = False) -> None:
    """VM 1's agent must run; once its job is stopped or over (``may_end``) it may stop
    by itself (``--exit-when-done``), but only cleanly."""
    proc = stack.agent1
    if proc is None or proc.returncode is None or (may_end and proc.returncode == 0):
        return
    if proc.returncode is not None:
        log_file = stack.vm1 / "agent.log"
        raise DemoError(
            step,
            f"the agent on VM 1 exited with status {proc.returncode}{_last_error(log_file)} "
            f"(see {log_file})",
        )


def _last_error(log_file: Path) -> str:
    """``: <the agent's last error line>`` from its log, or nothing."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return f": {errors[-1].strip()}" if errors else ""


async def _inject(stack: DemoStack, opts: DemoOptions, ui: Ui) -> float:
    """Send the notice (or the drain); returns when it was sent (Unix time)."""
    assert stack.sims is not None
    sim1 = stack.sims[0]
    t0 = time.time()
    if opts.fault == "notices":
        sim1.state.add_fault("error", cloud=opts.cloud, status=503)
        ui.event(f"fault: VM 1's {opts.cloud} metadata service answers 503 from now on")
    if opts.drain:
        try:
            answer = await call(
                stack.agent1_listen,
                stack.api_token,
                "POST",
                "/drain",
                {"reason": "spotguard demo: operator drain", "wait": False, "deadline_s": 120},
                timeout_s=10.0,
            )
        except SpotguardError as exc:
            raise DemoError("notice", f"the agent's local API refused the drain: {exc}") from exc
        ui.event(f"operator drain sent to VM 1's agent API (notice {answer['notice']['id']})")
        return t0
    notice = sim1.state.send(opts.cloud, opts.kind, in_seconds=opts.notice_in_seconds())
    left = (notice.not_before.timestamp() - t0) if notice.not_before else 0.0
    ui.event(
        f"{opts.cloud} {opts.kind} notice injected into VM 1's metadata service "
        f"(action {notice.action}, event in {left:.0f} s)"
    )
    return t0


def _source_errors(agent_log: Path) -> str:
    """The last notice-source failure in an agent's JSON log (for a notice that never came)."""
    last = ""
    try:
        lines = agent_log.read_text(errors="replace").splitlines()
    except OSError:
        return last
    for line in lines:
        if '"spotguard.notices' in line and '"warning"' in line:
            try:
                last = str(json.loads(line).get("msg", ""))
            except ValueError:
                continue
    return f"; VM 1's agent logged: {last}" if last else ""


def _moved(view: View, state: str, after: float) -> bool:
    return any(
        h.get("to") == state and h.get("from") != state and float(h.get("at", 0)) >= after
        for h in view.get("history") or []
    )


def _restored_job(stack: DemoStack) -> tuple[Path, JobInfo]:
    """The local VM whose state dir holds the restored job."""
    for d in reversed(stack.vm_dirs()):
        for job in list_jobs(d / "state"):
            if job.name == JOB_NAME:
                return d, job
    raise DemoError("restore", "no local VM holds the restored job")


async def _finished_output(job: JobInfo, where: str) -> str:
    """The job's whole output once its init recorded the exit status."""
    end = time.monotonic() + 15.0
    while (status := exit_status(job)) is None:
        if time.monotonic() > end:
            raise DemoError("finish", f"the job on {where} never recorded its exit status")
        await asyncio.sleep(0.1)
    if status != 0:
        raise DemoError("finish", f"the job exited with status {status} on {where}")
    return (job.dir / "stdout").read_text()


async def _image(image_url: str, settings: ImageSettings) -> tuple[dict[str, Any], str]:
    """The image's manifest (as JSON), after every chunk verified, and the job's output as
    the image captured it (what the job had printed when it was frozen)."""
    try:
        report = await verify_image(image_url, settings=settings)
        async with ImageReader(image_url, settings=settings) as reader:
            manifest = reader.manifest.model_dump(mode="json", exclude={"files"})
            names = [f.name for f in reader.manifest.files if f.name.endswith("/stdout")]
            captured = b""
            if names:
                async for data in reader.iter_file(names[0]):
                    captured += data
    except SpotguardError as exc:
        raise DemoError("image", f"the image {image_url} does not verify: {exc}") from exc
    manifest["verified_chunks"] = report.chunks
    return manifest, captured.decode(errors="replace")


async def _scenario(stack: DemoStack, opts: DemoOptions, ui: Ui, report: DemoReport) -> None:
    assert stack.client is not None and stack.sims is not None
    ui.event(
        f"embedded default up: metadata-sim for VM 1 and VM 2, store {stack.store_url}, "
        f"controller {stack.controller_url} (local provider), CRIU {stack.criu}"
    )
    reference = asyncio.create_task(stack.start_reference())
    # Stopped with the stack's processes if the run fails first; its outcome then is moot.
    reference.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        await _protected_run(stack, opts, ui, report, reference)
    finally:
        reference.cancel()


async def _protected_run(
    stack: DemoStack,
    opts: DemoOptions,
    ui: Ui,
    report: DemoReport,
    reference: asyncio.Task[str],
) -> None:
    assert stack.client is not None and stack.sims is not None
    job = await stack.start_job()
    ui.event(
        f"sample job {JOB_NAME!r} started on VM 1 (pid {job.pid}, {opts.mb} MiB of state, "
        f"{opts.steps} steps)"
    )
    await stack.start_agent1()
    f1, f2 = FACTS[opts.cloud]
    follower = Follower(
        stack.client, JOB_NAME, ui, {f1.instance_id: "VM 1", f2.instance_id: "VM 2"}
    )
    after_durable = False

    def agent1_check(step: str) -> None:
        _check_agent1(stack, step, may_end=after_durable)

    follower.checks.append(agent1_check)
    await follower.until(
        "protect",
        "waiting for the agent on VM 1 to protect the job",
        lambda v: v.get("state") == "protected",
        opts.stage_timeout,
    )
    await _wait_for_step(stack, job, ui, opts.notice_step, opts.stage_timeout)
    t0 = await _inject(stack, opts, ui)
    report.scenario["notice_sent_at"] = t0
    stop = asyncio.Event()
    poller = asyncio.create_task(store_bytes(stack.store_url, f"{JOB_NAME}/", ui, stop))
    try:
        try:
            await follower.until(
                "notice",
                "waiting for VM 1's agent to see the notice",
                lambda v: has_event(v, "notice", after=t0),
                min(opts.stage_timeout, NOTICE_TIMEOUT_S),
            )
        except DemoError as exc:
            if exc.step != "notice":
                raise
            why = _source_errors(stack.vm1 / "agent.log")
            raise DemoError("notice", exc.reason + why) from exc
        view = await follower.until(
            "freeze",
            "freezing the job and writing its image to the store",
            lambda v: has_event(v, "durable", after=t0),
            opts.stage_timeout,
        )
    finally:
        stop.set()
        await poller
    image_url = str(view.get("image_url") or "")
    report.image_url = image_url
    where = "VM 1"
    after_durable = True
    if opts.relaunches:
        await follower.until(
            "relaunch",
            "waiting for the controller to launch VM 2",
            lambda v: _moved(v, "restoring", t0),
            opts.stage_timeout,
        )
        view = await follower.until(
            "restore",
            "waiting for VM 2's agent to restore the job",
            lambda v: has_event(v, "restored", after=t0),
            opts.stage_timeout,
        )
        where = "VM 2"
    left = max(opts.steps - opts.notice_step, 0) * opts.step_seconds
    view = await follower.until(
        "finish",
        f"waiting for the job to finish on {where}",
        lambda v: v.get("state") == "finished",
        left + opts.stage_timeout,
    )
    report.history = view.get("history") or []
    if opts.relaunches:
        vm_dir, final_job = _restored_job(stack)
        report.scenario["vm2_dir"] = str(vm_dir)
    else:
        final_job = job
    got = await _finished_output(final_job, where)
    ui.waiting("comparing the output with the uninterrupted run")
    expected = await reference
    diff = first_difference(expected, got)
    if diff is not None:
        raise DemoError("compare", f"the job's output differs from the uninterrupted run: {diff}")
    manifest, captured = await _image(image_url, stack.image)
    report.image = manifest
    report.timeline = timeline(
        t0,
        report.history,
        manifest,
        durable_record(stack.vm1 / "agent.log"),
        notice_label=opts.notice_label,
        relaunched=opts.relaunches,
    )
    lines = len(got.splitlines())
    checksum = got.strip().splitlines()[-1].split()[-1][:16]
    if opts.relaunches:
        on_vm1 = sum(1 for line in captured.splitlines() if line.startswith("step "))
        report.proof = (
            f"the job printed {lines} lines identical to the uninterrupted run: steps 1-{on_vm1} "
            f"on VM 1 (as its image holds them), {on_vm1 + 1}-{opts.steps} on VM 2 "
            f"(final checksum {checksum}); image verified ({manifest['verified_chunks']} chunks)"
        )
    else:
        report.proof = (
            f"the job kept running on VM 1 through its checkpoint and printed {lines} lines "
            f"identical to the uninterrupted run (final checksum {checksum}); the image it "
            f"left verified ({manifest['verified_chunks']} chunks)"
        )


async def run_demo(opts: DemoOptions, ui: Ui, image: ImageSettings) -> DemoReport:
    """Run the whole scenario; the report says whether every step held (and why not).
    ``image`` are the ``[image]`` settings the command loaded."""
    started = time.monotonic()
    report = DemoReport(
        scenario={
            "cloud": opts.cloud,
            "kind": "drain" if opts.drain else opts.kind,
            "store": opts.store,
            "steps": opts.steps,
            "mb": opts.mb,
            "notice_at_step": opts.notice_step,
            "fault": opts.fault,
        }
    )
    stack = DemoStack(opts, image)
    report.workdir = str(stack.root)
    try:
        async with _logs_to(stack.root / "demo.log"), stack:
            try:
                await _scenario(stack, opts, ui, report)
                report.ok = True
            except DemoError as exc:
                report.failed_step, report.reason = exc.step, exc.reason
                stack.keep = True  # the logs explain the failure
                t0 = report.scenario.get("notice_sent_at")
                if isinstance(t0, float) and stack.client is not None:
                    report.history = await _history(stack)
                    report.timeline = timeline(
                        t0,
                        report.history,
                        {},
                        durable_record(stack.vm1 / "agent.log"),
                        notice_label=opts.notice_label,
                        relaunched=opts.relaunches,
                    )
            finally:
                ui.waiting("stopping every process the demo started")
    except DemoError as exc:
        report.failed_step, report.reason = exc.step, exc.reason
    finally:
        ui.close()
    report.kept = stack.keep and stack.root_exists()
    report.seconds = time.monotonic() - started
    return report


async def _history(stack: DemoStack) -> list[dict[str, Any]]:
    assert stack.client is not None
    try:
        view = (await stack.client.job(JOB_NAME)).to_json()
    except SpotguardError:
        return []
    history: list[dict[str, Any]] = view.get("history") or []
    return history


@contextlib.asynccontextmanager
async def _logs_to(path: Path) -> AsyncIterator[None]:
    """Send this process's log records (controller, metadata-sim) to ``path`` as JSON lines
    while the demo runs, so the terminal shows the demo's own lines only."""
    root = logging.getLogger()
    saved = root.handlers[:]
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    root.handlers[:] = [handler]
    try:
        yield
    finally:
        root.handlers[:] = saved
        handler.close()
