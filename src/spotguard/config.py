"""Settings: each one defined once — key, type, default, help — and read from a TOML file,
the environment and command-line flags, in that order of increasing precedence.

A settings group is a :class:`Settings` subclass with a ``section`` (its table in the config
file) and fields with ``description``. From that one definition come:

* the config-file key  ``[section] field_name = ...``
* the environment var  ``SPOTGUARD_FIELD_NAME`` (``env_prefix`` may override)
* the CLI flag         ``--field-name`` (added to a click command by :func:`options`)

Example::

    class AgentSettings(Settings):
        section: ClassVar[str] = "agent"
        store: str = Field("file:///var/lib/spotguard/images", description="Image store URL.")

    @click.command()
    @options(AgentSettings)
    def agent(**flags): settings = load(AgentSettings, flags, config_file=cli.config(ctx))

Settings are loaded once, at the edge (a command, the daemon's start), and passed down: no
library module calls :func:`load`. The config file is read once per process
(:meth:`ConfigFile.read`, done by the CLI for ``--config``) and checked as a whole: a section
or key that no settings group defines is an error naming the file, the section and the known
ones — a misspelling is never silently ignored.
"""

from __future__ import annotations

import enum
import importlib
import os
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import annotated_types
import click
from pydantic import ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from spotguard.errors import ConfigError

CONFIG_ENV = "SPOTGUARD_CONFIG"
DEFAULT_CONFIG_PATHS = (Path("/etc/spotguard/spotguard.toml"),)
#: Every module that defines a :class:`Settings` group (imported to learn the known sections;
#: a test checks that no group is missing here).
SETTINGS_MODULES = (
    "spotguard.agent.settings",
    "spotguard.checkpoint.settings",
    "spotguard.container.settings",
    "spotguard.controller.settings",
    "spotguard.image.delivery",
    "spotguard.image.settings",
    "spotguard.notices.fleet",
    "spotguard.notices.settings",
    "spotguard.notify",
    "spotguard.park.settings",
    "spotguard.planner",
    "spotguard.providers.aws",
    "spotguard.providers.gcp",
    "spotguard.providers.local",
    "spotguard.simulator.settings",
)

#: The largest number a setting may hold unless its field sets its own upper bound (``le`` or
#: ``lt``): beyond these a value is a mistake (``1e308`` seconds), and the arithmetic done
#: with it overflows (``timedelta``, ``asyncio.sleep``, C integers). Infinity and NaN are
#: refused everywhere (``allow_inf_nan``).
FLOAT_LIMIT = 1e9  # seconds: about 31 years
INT_LIMIT = 2**53  # bytes: 8 PiB

S = TypeVar("S", bound="Settings")
F = TypeVar("F", bound=Callable[..., Any])


class Settings(BaseSettings):
    """Base of every settings group. Subclasses set ``section`` and describe each field."""

    section: ClassVar[str] = ""
    #: every group defined so far, by section (several groups may share one section)
    registry: ClassVar[dict[str, list[type[Settings]]]] = {}
    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_",
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a number past :data:`FLOAT_LIMIT` / :data:`INT_LIMIT` in a field that sets
        no upper bound of its own (bounded where it is parsed, not where it overflows)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        limit = FLOAT_LIMIT if isinstance(value, float) else INT_LIMIT
        field = cls.model_fields.get(info.field_name or "")
        own = field is not None and any(
            isinstance(m, annotated_types.Le | annotated_types.Lt) for m in field.metadata
        )
        if not own and abs(value) > limit:
            raise ValueError(f"{value!r} is out of range (at most {limit:g})")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_empty_path(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse ``''`` for a path setting: it would mean the working directory, silently
        (``--state-dir ''`` made ``./jobs`` wherever the command ran, and tightened its mode)."""
        field = cls.model_fields.get(info.field_name or "")
        path = field is not None and field.annotation is Path
        if path and isinstance(value, str) and not value.strip():
            raise ValueError("empty: give a path (an empty one means the working directory)")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags (passed as init kwargs) > environment > config file (merged in by load()).
        return (init_settings, env_settings)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("section"):
            Settings.registry.setdefault(cls.section, []).append(cls)

    @classmethod
    def env_name(cls, field: str) -> str:
        prefix = cls.model_config.get("env_prefix", "")
        return f"{prefix}{field}".upper()


def config_path(explicit: str | Path | None = None) -> Path | None:
    """The config file to read: ``--config``, else ``$SPOTGUARD_CONFIG``, else the default
    path if it exists, else none."""
    if explicit:
        return Path(explicit)
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    for p in DEFAULT_CONFIG_PATHS:
        if p.exists():
            return p
    return None


def read_file(path: Path | None) -> dict[str, Any]:
    """Parse the TOML config file (empty when there is none)."""
    if path is None:
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except OSError as exc:
        raise ConfigError(
            f"config file {path} cannot be read: {exc.strerror or exc} (running as uid "
            f"{os.getuid()})"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8: a binary file, or the wrong file
        raise ConfigError(f"config file {path} is not valid TOML: {not_text(exc)}") from exc


def http_host(url: str) -> tuple[str, str] | None:
    """``(scheme, host)`` of an ``http(s)://HOST[:PORT]...`` URL with a port in range, else
    None (the one parse :func:`check_http_url` and the agent's controller check share)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname if parts.port != 0 else None  # .port: ValueError if bad
    except ValueError:  # a port not a number, or past 65535
        return None
    return (parts.scheme, host) if parts.scheme in ("http", "https") and host else None


def check_http_url(url: str, what: str) -> str:
    """``url`` if :func:`http_host` takes it, else a :class:`ConfigError` naming ``what``
    (not "unreachable" with the request's URL, later)."""
    if http_host(url) is None:
        raise ConfigError(f"{what} {url!r} is not an http(s) URL: use http(s)://HOST[:PORT]")
    return url


def not_text(exc: UnicodeDecodeError) -> str:
    """Why a file meant to be text is not, as one short phrase (the codec's own message
    names its internals: "'utf-8' codec can't decode ... invalid start byte")."""
    return f"it is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at {exc.start})"


def known_sections() -> dict[str, set[str]]:
    """Every config section any settings group defines, with its keys."""
    for module in SETTINGS_MODULES:
        importlib.import_module(module)
    return {
        section: {name for group in groups for name in group.model_fields}
        for section, groups in Settings.registry.items()
    }


def _hint(name: str, known: set[str]) -> str:
    close = get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_file(path: Path, data: Mapping[str, Any]) -> None:
    """Refuse sections and keys no settings group defines (a misspelling would be ignored)."""
    known = known_sections()
    for section, values in data.items():
        if section not in known:
            raise ConfigError(
                f"config file {path}: unknown section [{section}]{_hint(section, set(known))}; "
                f"known sections: {', '.join(sorted(known))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path}: [{section}] must be a table")
        for key in values:
            if key not in known[section]:
                raise ConfigError(
                    f"config file {path}: unknown key {key!r} in [{section}]"
                    f"{_hint(key, known[section])}; known keys: "
                    f"{', '.join(sorted(known[section]))}"
                )


@dataclass(frozen=True)
class ConfigFile:
    """The config file of this process, read and checked once (see :meth:`read`)."""

    path: Path | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, explicit: str | Path | None = None) -> ConfigFile:
        """Read ``--config`` (else ``$SPOTGUARD_CONFIG``, else the default path if present):
        a :class:`ConfigError` for a missing or invalid file or an unknown section or key."""
        path = config_path(explicit)
        data = read_file(path)
        if path is not None:
            check_file(path, data)
        return cls(path, data)

    def section(self, name: str) -> dict[str, Any]:
        """The values of ``[name]`` (empty when the file has none)."""
        values = self.data.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"config file {self.path}: [{name}] must be a table")
        return dict(values)


def load(
    cls: type[S],
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: ConfigFile | str | Path | None = None,
) -> S:
    """Build ``cls`` from defaults < config file section < environment < flags.

    Called at the edge only (commands, daemon start). ``config_file`` is the file already
    read (:class:`ConfigFile`), or a path to read. ``flags`` may hold extra keys (other click
    parameters) and ``None`` for flags that were not given; both are ignored. Validation
    errors become :class:`ConfigError` naming the setting and where it can be set.
    """
    cfg = config_file if isinstance(config_file, ConfigFile) else ConfigFile.read(config_file)
    file_values = cfg.section(cls.section) if cls.section else {}
    given = {
        k: v
        for k, v in (flags or {}).items()
        if k in cls.model_fields and v is not None and v != ()
    }
    env_set = {k for k in cls.model_fields if cls.env_name(k) in os.environ}
    values = {k: v for k, v in file_values.items() if k not in env_set and k in cls.model_fields}
    values.update(given)
    try:
        return cls(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            where = f"--{key.replace('_', '-')} / {cls.env_name(key)} / [{cls.section}] {key}"
            problems.append(f"{key}: {err['msg']} (set with {where})")
        source = f" ({cfg.path})" if cfg.path is not None else ""
        raise ConfigError(f"invalid settings{source}: " + "; ".join(problems)) from exc


def _click_type(annotation: Any) -> tuple[Any, bool, bool]:
    """(click type, is_flag, multiple) for a field annotation."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _click_type(args[0])
    if origin in (list, tuple, set, frozenset):
        inner, _, _ = _click_type(args[0] if args else str)
        return inner, False, True
    if origin is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)]), False, False
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return click.Choice([str(m.value) for m in annotation]), False, False
    if annotation is bool:
        return None, True, False
    if annotation in (int, float, str):
        return annotation, False, False
    if annotation is Path:  # a str: the field's validators see what was typed ('' included)
        return click.Path(), False, False
    return str, False, False


def options(
    cls: type[Settings], *, exclude: tuple[str, ...] = (), hidden: tuple[str, ...] = ()
) -> Callable[[F], F]:
    """Decorator adding one click option per field of ``cls`` (default ``None`` = not given,
    so the file and environment still apply); those in ``hidden`` are accepted but left out
    of ``--help`` (advanced settings a command's help points to the docs for)."""

    def decorate(fn: F) -> F:
        for name, info in reversed(list(cls.model_fields.items())):
            if name in exclude:
                continue
            fn = _option(cls, name, info, hidden=name in hidden)(fn)
        return fn

    return decorate


def _option(
    cls: type[Settings], name: str, info: FieldInfo, *, hidden: bool = False
) -> Callable[[F], F]:
    ctype, is_flag, multiple = _click_type(info.annotation)
    flag = "--" + name.replace("_", "-")
    default = info.get_default(call_default_factory=True)
    help_text = (info.description or "").rstrip(".")
    shown = "" if default in (None, "", [], ()) else f" [default: {default}]"
    help_text = f"{help_text}.{shown} [env: {cls.env_name(name)}]"
    if is_flag:
        decls = [f"{flag}/--no-{flag[2:]}"]
        return click.option(*decls, name, default=None, help=help_text, hidden=hidden)
    return click.option(
        flag, name, type=ctype, default=None, multiple=multiple, help=help_text, hidden=hidden
    )
