"""Core types, settings, contracts and the CLI shell."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

import click
import pytest
from click.testing import CliRunner
from pydantic import Field

import spotguard
from spotguard import config, errors
from spotguard.contracts import AgentEvent, Assignment, EventKind, check_job_name
from spotguard.notices.base import Cloud, Notice, NoticeKind, stable_id
from spotguard.timeline import Timeline


def test_public_surface_is_complete() -> None:
    for name in spotguard.__all__:
        assert hasattr(spotguard, name), name


def test_every_error_derives_from_base_and_is_documented() -> None:
    doc = errors.__doc__ or ""
    for name, obj in vars(errors).items():
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, errors.SpotguardError)
            assert name in doc, f"{name} missing from the tree in errors.py"


def test_notice_requires_utc_deadline_and_round_trips() -> None:
    with pytest.raises(ValueError, match="timezone"):
        Notice("x", Cloud.AWS, NoticeKind.PREEMPT, datetime(2026, 1, 1))
    n = Notice("x", Cloud.AWS, NoticeKind.PREEMPT, datetime(2026, 1, 1, tzinfo=UTC), "terminate")
    assert n.to_json()["deadline"] == "2026-01-01T00:00:00Z"
    assert n.cancel().cancelled and not n.cancelled
    assert stable_id("aws", "preempt", {"a": 1}) == stable_id("aws", "preempt", {"a": 1})
    assert stable_id("aws", "preempt", {"a": 1}) != stable_id("aws", "preempt", {"a": 2})


class DemoSettings(config.Settings):
    section: ClassVar[str] = "demo"
    interval: float = Field(1.0, description="Poll interval in seconds", gt=0)
    name: str = Field("x", description="A name")
    loud: bool = Field(False, description="Be loud")


def test_settings_precedence_file_env_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text('[demo]\ninterval = 2.0\nname = "file"\n')
    assert config.load(DemoSettings, config_file=cfg).interval == 2.0
    monkeypatch.setenv("SPOTGUARD_INTERVAL", "3")
    s = config.load(DemoSettings, {"name": None}, config_file=cfg)
    assert (s.interval, s.name) == (3.0, "file")
    s = config.load(DemoSettings, {"interval": 4.0, "name": "flag"}, config_file=cfg)
    assert (s.interval, s.name) == (4.0, "flag")
    with pytest.raises(errors.ConfigError, match="--interval / SPOTGUARD_INTERVAL"):
        config.load(DemoSettings, {"interval": -1.0})


def test_settings_generate_click_flags() -> None:
    @click.command()
    @config.options(DemoSettings)
    def cmd(**flags: object) -> None:
        s = config.load(DemoSettings, flags)
        click.echo(f"{s.interval} {s.name} {s.loud}")

    out = CliRunner().invoke(cmd, ["--interval", "5", "--loud"])
    assert out.output.strip() == "5.0 x True", out.output
    assert "SPOTGUARD_INTERVAL" in CliRunner().invoke(cmd, ["--help"]).output


def test_bad_config_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("not = [valid")
    with pytest.raises(errors.ConfigError, match="not valid TOML"):
        config.load(DemoSettings, config_file=bad)


def test_assignment_user_data_round_trip() -> None:
    a = Assignment(job="train-1", image_url="s3://b/train-1/images/x", store="s3://b")
    script = a.user_data()
    assert script.startswith("#!/bin/sh") and "spotguard-agent" in script
    assert Assignment.from_user_data(script) == a
    assert Assignment.from_user_data(a.model_dump_json()) == a
    with pytest.raises(ValueError, match="invalid job name"):
        check_job_name("Bad Name")


def test_agent_event_is_strict() -> None:
    ev = AgentEvent(job="j", kind=EventKind.DURABLE, image_url="file:///x")
    assert AgentEvent.model_validate_json(ev.model_dump_json()) == ev
    with pytest.raises(ValueError):
        AgentEvent.model_validate({"job": "j", "kind": "nonsense"})


def test_timeline_times_failures_too() -> None:
    t = Timeline()
    with t.step("ok"):
        pass
    with pytest.raises(RuntimeError), t.step("bad"):
        raise RuntimeError("x")
    assert [s.ok for s in t.steps] == [True, False]
    assert all(s.seconds is not None for s in t.steps)
    assert Timeline.from_list(t.to_list()).steps[1].name == "bad"
    assert t.span() >= 0


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run(["spotguard", "--help"], capture_output=True, text=True, check=True)
    for name in ("agent", "controller", "checkpoint", "restore", "images", "demo", "metadata-sim"):
        assert name in out.stdout
