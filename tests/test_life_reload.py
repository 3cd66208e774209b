"""A reload (SIGHUP) replaces the health prober and the KV reader of a running server; the
old ones' HTTP sessions are closed, not dropped (dropped, aiohttp prints "Unclosed client
session" on the daemon's stderr, among its JSON lines: the real soak, tests/real/soak_real.py,
saw it after every SIGHUP). They are closed when the launch ends (``ServerLife._end``) or at
the end, since a probe of the launch may still be using them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness import write_config

from supervisor.adapters.ports import ProbeOutcome
from supervisor.aio import TaskScope
from supervisor.core.config import load_config
from supervisor.unit.life import ServerLife


class FakeProber:
    def __init__(self) -> None:
        self.closed = 0

    async def probe(self) -> ProbeOutcome:
        return ProbeOutcome(True, 200, 0.001, "ok")

    async def read(self) -> tuple[float, int] | None:
        return (0.1, 0)

    async def aclose(self) -> None:
        self.closed += 1


def life(cfg: Any, made: list[FakeProber]) -> ServerLife:
    def make(*_args: Any) -> FakeProber:
        made.append(FakeProber())
        return made[-1]

    ports = SimpleNamespace(prober=make, kv_reader=make, cleanup=SimpleNamespace(listeners=lambda _port: set()))
    log = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None, error=lambda *a, **k: None)
    return ServerLife(cfg, ports, instance_id="t", post=lambda _e: None, emit=lambda _e: None,  # type: ignore[arg-type]
                      tasks=TaskScope("test"), wall_now=lambda: "", log=log)  # type: ignore[arg-type]


async def test_a_reload_closes_the_replaced_prober_and_kv_reader(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path))
    made: list[FakeProber] = []
    unit = life(cfg, made)
    await unit.probe(starting=False, tree_grew=lambda: None, read_kv=True)
    first = list(made)
    assert len(first) == 2 and not any(p.closed for p in first)  # the prober and the KV reader

    unit.reload(cfg)
    unit.reload(cfg)  # twice before a probe: nothing made in between, nothing to close twice
    await unit.probe(starting=False, tree_grew=lambda: None, read_kv=True)
    # a probe of this launch may still use the old ones: they are closed when the launch ends
    assert len(made) == 4 and not any(p.closed for p in made)

    unit.reload(cfg)
    await unit.close()  # what a reload left unclosed, the end closes
    assert [p.closed for p in made] == [1, 1, 1, 1]
