"""A parsed TOML document built into a ``Config``, and a config file read, overridden
(``--set``) and validated; a config of ``--set`` items alone (the demo)."""

from __future__ import annotations

import os
import stat
import tomllib
import typing
from pathlib import Path
from typing import Any

from supervisor.core.config.checks import _cross_checks
from supervisor.core.config.overrides import parse_override
from supervisor.core.config.rules import ConfigError, _did_you_mean
from supervisor.core.config.schema import _SECTIONS, _build_section
from supervisor.core.config.servers import _build_units
from supervisor.core.config.units import Config


def build_config(data: dict[str, Any], *, where: str = "config", name: str = "supervisor") -> Config:
    """Validate a parsed TOML document into a ``Config``; ``where`` prefixes every error.

    ``[server]`` may be an array of tables (``[[server]]``): one daemon, several servers,
    each built into a whole ``Config`` of its own (``units``)."""
    for section in data:
        if section not in _SECTIONS:
            known = ", ".join(f"[{s}]" for s in _SECTIONS)
            hint = _did_you_mean(section, _SECTIONS, "[{}]")
            raise ConfigError(f"{where}: [{section}]: unknown section{hint} (known: {known})")
    if isinstance(data.get("server"), list):
        return _build_units(data, where=where, name=name)
    sections = {section: _build_section(where, section, _SECTIONS[section], raw) for section, raw in data.items()}
    cfg = Config(**sections, name=name)
    _cross_checks(where, cfg)
    return cfg


def check_file_mode(path: Path) -> None:
    """Refuse a config that users other than the owner may write: it holds a command line."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o022:
        raise ConfigError(
            f"{path}: writable by group or others (mode {mode & 0o777:04o}); it sets the command "
            f"line run as the service user: chmod go-w {path}"
        )


def load_config(path: str | os.PathLike[str], overrides: typing.Sequence[str] = ()) -> Config:
    """Read, override and validate a config file. Raises ``ConfigError`` (one line)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    check_file_mode(p)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    except ValueError as exc:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise ConfigError(f"{p}: unusable TOML value: {str(exc)[:120]}") from None
    except RecursionError:
        raise ConfigError(f"{p}: arrays or tables nested too deeply") from None
    for item in overrides:
        section, key, value = parse_override(item)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {item!r}: [{section}] is not a table in {p}")
        table[key] = value
    cfg = build_config(data, where=str(p), name=p.stem)
    check_secret_files(cfg, where=str(p))
    return cfg


def check_secret_files(cfg: Config, *, where: str = "config") -> None:
    """With MQTT on, ``[mqtt] password_file`` exists and others cannot read it (it holds the
    broker's password). Group-readable is left to the service's group (the alerter warns)."""
    if not (cfg.mqtt.enabled and cfg.mqtt.password_file):
        return
    path = Path(cfg.mqtt.password_file)
    label = f"{where}: [mqtt] password_file = {str(path)!r}"
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{label}: not a regular file")
    if mode & stat.S_IROTH:
        raise ConfigError(
            f"{label}: readable by others (mode {mode & 0o777:04o}); it holds the broker's password: chmod o-r {path}"
        )


def config_from_overrides(overrides: typing.Sequence[str], *, name: str = "demo") -> Config:
    """A config made of ``--set`` items alone (used by the demo on top of its own file)."""
    data: dict[str, Any] = {}
    for item in overrides:
        section, key, value = parse_override(item)
        data.setdefault(section, {})[key] = value
    return build_config(data, where="--set", name=name)
