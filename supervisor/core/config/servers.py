"""``[[server]]``: one daemon, several servers. The daemon's sections are built once, then one
whole ``Config`` per entry, its per-server tables (``PER_SERVER``) laid key by key over the
top-level ones; what the servers must not share is checked across them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from supervisor.core.config.checks import _cross_checks
from supervisor.core.config.rules import ConfigError, _show
from supervisor.core.config.schema import _SECTIONS, _build_section
from supervisor.core.config.sections import ServerConfig, StateConfig
from supervisor.core.config.units import Config

# What a ``[[server]]`` entry may set for itself, over the top-level section of that name
# (``[server.gpu] indices = [0, 1, 2, 3]`` after ``[[server]]``); None = every key. The
# rest (metrics, MQTT, the state directory, the router's address) belongs to the daemon.
PER_SERVER: dict[str, frozenset[str] | None] = {
    "gpu": None,
    "policy": None,
    "health": None,
    "router": frozenset({"worker_url"}),
    "logging": frozenset({"server_log", "server_log_max_bytes", "server_log_backups", "tail_bytes"}),
}


def _build_units(data: dict[str, Any], *, where: str, name: str) -> Config:
    """``[[server]]``: the daemon's sections once, then one ``Config`` per entry, its
    per-server tables (``PER_SERVER``) laid key by key over the top-level ones."""
    entries = data["server"]
    if not entries:
        raise ConfigError(f"{where}: [[server]]: empty: at least one server is needed")
    top = {s: raw for s, raw in data.items() if s != "server"}
    for section, raw in top.items():
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: [{section}] must be a table, not {_show(raw)}")
    base = Config(
        **{s: _build_section(where, s, _SECTIONS[s], raw) for s, raw in top.items()}, name=name,
    )
    units: list[Config] = []
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: [[server]] #{i} must be a table, not {_show(entry)}")
        unit_where = f"{where}: [[server]] #{i}"
        label = entry.get("name")
        if isinstance(label, str) and label:
            unit_where = f"{where}: server {label[:64]!r}"
        if not label:
            raise ConfigError(f'{unit_where}: name: missing: each [[server]] needs a name (e.g. name = "tp4-a")')
        own = {k: v for k, v in entry.items() if k not in PER_SERVER}
        sections: dict[str, Any] = {"server": _build_section(unit_where, "server", ServerConfig, own)}
        for section, allowed in PER_SERVER.items():
            raw = entry.get(section, {})
            if not isinstance(raw, dict):
                raise ConfigError(f"{unit_where}: [server.{section}] must be a table, not {_show(raw)}")
            if allowed is not None:
                for key in raw:
                    if key not in allowed:
                        raise ConfigError(
                            f"{unit_where}: [server.{section}] {key}: not set per server "
                            f"(per server: {', '.join(sorted(allowed))}; the rest goes in [{section}])"
                        )
            merged = {**top.get(section, {}), **raw}
            sections[section] = _build_section(unit_where, section, _SECTIONS[section], merged)
        if base.group.enabled:
            raise ConfigError(f"{unit_where}: [group] with [[server]]: a group node's daemon owns one server")
        state = StateConfig(dir=str(Path(base.state.dir) / sections["server"].name))
        unit = dataclasses.replace(base, **sections, state=state)
        _cross_checks(unit_where, unit)
        units.append(unit)
    cfg = dataclasses.replace(base, units=tuple(units))
    _unit_checks(where, cfg)
    return cfg


def _unit_checks(where: str, cfg: Config) -> None:
    """What several servers in one daemon must not share: a name, a port, a GPU, a log."""
    seen: dict[tuple[str, object], str] = {}

    def claim(what: str, value: object, owner: str) -> None:
        other = seen.setdefault((what, value), owner)
        if other != owner:
            raise ConfigError(f"{where}: servers {other!r} and {owner!r} have the same {what} {value}")

    for unit in cfg.units:
        owner = unit.server.name
        claim("name", owner, f"#{cfg.units.index(unit) + 1}")
        claim("port", unit.server.port, owner)
        if unit.logging.server_log:
            claim("[logging] server_log", unit.logging.server_log, owner)
        for index in unit.gpu.indices:
            claim("GPU index", index, owner)
        if unit.gpu.backend != "none" and not unit.gpu.indices and len(cfg.units) > 1:
            raise ConfigError(
                f"{where}: server {owner!r}: [server.gpu] indices: missing: with several servers "
                "each names its GPUs (exported as its CUDA_VISIBLE_DEVICES)"
            )
