"""Notice policy and agent settings (file, env, flags)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotguard import config
from spotguard.agent.policy import Action, Policy
from spotguard.agent.settings import AgentSettings, parse_listen
from spotguard.errors import ConfigError
from spotguard.notices.base import Cloud, Notice, NoticeKind

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def notice(kind: NoticeKind, action: str | None = None, in_s: float = 120.0) -> Notice:
    return Notice(f"n-{kind}-{action}", Cloud.AWS, kind, NOW + timedelta(seconds=in_s), action)


def test_defaults_per_kind() -> None:
    p = Policy.default()
    assert p.decide(notice(NoticeKind.PREEMPT, "terminate"), NOW).action is Action.EXIT
    assert p.decide(notice(NoticeKind.REBALANCE), NOW).action is Action.RESUME
    assert p.decide(notice(NoticeKind.DRAIN), NOW).action is Action.EXIT
    assert p.decide(notice(NoticeKind.PREEMPT).cancel(), NOW).action is Action.NONE


def test_maintenance_starts_just_before_deadline_and_ignores_live_migration() -> None:
    p = Policy.default()
    far = p.decide(notice(NoticeKind.MAINTENANCE, "instance-reboot", in_s=3600), NOW)
    assert far.action is Action.EXIT
    assert far.start_at == NOW + timedelta(seconds=3600 - 300)
    near = p.decide(notice(NoticeKind.MAINTENANCE, "instance-stop", in_s=60), NOW)
    assert near.start_at == NOW
    live = p.decide(notice(NoticeKind.MAINTENANCE, "MIGRATE_ON_HOST_MAINTENANCE"), NOW)
    assert live.action is Action.NONE
    assert p.decide(notice(NoticeKind.MAINTENANCE, "Freeze"), NOW).action is Action.NONE


def test_settings_from_file_env_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        '[agent]\njob = ["train"]\nstore = "s3://b/p"\npolicy_maintenance = "resume"\n'
        "periodic_interval = 600\n"
    )
    s = config.load(AgentSettings, config_file=cfg)
    assert (s.job, s.store, s.periodic_interval) == (["train"], "s3://b/p", 600.0)
    assert s.policy().actions[NoticeKind.MAINTENANCE] is Action.RESUME
    monkeypatch.setenv("SPOTGUARD_JOB", "a, b")
    monkeypatch.setenv("SPOTGUARD_POLICY_REBALANCE", "none")
    s = config.load(AgentSettings, {"store": "gs://x/y"}, config_file=cfg)
    assert (s.job, s.store) == (["a", "b"], "gs://x/y")
    assert s.policy().actions[NoticeKind.REBALANCE] is Action.NONE
    s = config.load(AgentSettings, {"job": ("1234",)}, config_file=cfg)
    assert s.job == ["1234"]


def test_listen_must_be_loopback_or_unix(tmp_path: Path) -> None:
    assert parse_listen("127.0.0.1:9901") == ("127.0.0.1", 9901)
    assert parse_listen("unix:/run/spotguard/agent.sock") == Path("/run/spotguard/agent.sock")
    with pytest.raises(ConfigError, match="loopback"):
        config.load(AgentSettings, {"api_listen": "0.0.0.0:9901"})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        config.load(AgentSettings, {"api_listen": "nonsense"})


def test_token_file_is_read(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    s = config.load(AgentSettings, {"controller_token_file": tok})
    assert s.controller_bearer() == "s3cret"
    s = config.load(AgentSettings, {"controller_token_file": tmp_path / "missing"})
    with pytest.raises(ConfigError, match="cannot be read"):
        s.controller_bearer()
