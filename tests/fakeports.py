"""The daemon's ports for tests that drive a ``Daemon`` over fakes: one call builds the
daemon's own ports and each server's (``UnitPorts``), as ``cli/run.py`` does for real."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from supervisor.adapters.ports import Ports, Store, UnitPorts
from supervisor.core.config import Config, unit_name


def fake_ports(store: Store, *, sinks: Sequence[Any], logger: Any, start_control: Any,
               unit_store: Callable[[Config], Store] | None = None,
               unit_sinks: Mapping[str, Sequence[Any]] | None = None, host: str = "testhost",
               install_signals: bool = False, **shared: Any) -> Ports:
    """``shared``: the adapters every unit shares (cleanup, preflight, spawner, prober...);
    ``unit_store``/``unit_sinks``: each server's own (a single server shares ``store``)."""
    def units(cfg: Config) -> UnitPorts:
        return UnitPorts(store=unit_store(cfg) if unit_store else store, logger=logger,
                         sinks=tuple((unit_sinks or {}).get(unit_name(cfg), ())), host=host, **shared)

    return Ports(store=store, sinks=list(sinks), logger=logger, start_control=start_control, units=units, host=host,
                 install_signals=install_signals)
