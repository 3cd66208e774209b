"""One night of two servers behind the real SGLang router, both owned by one real daemon
(two ``[[server]]`` entries), under client load through the router
(tests/test_router_daemon.py asserts on it, bench/bench_router.py measures it side by side
with the router alone).

1. a scheduler of server ``a`` is SIGKILLed while serving (SGLang 0.5.23's crash path with
   its diagnostics on: the main process sleeps 5 s, then kills its tree);
2. a rolling restart: ``sglang-supervisor restart`` once, and the daemon restarts the
   servers one at a time.

``integrated``: the daemon has ``[router]`` and keeps the router's view true; otherwise the
router is given the servers with ``--worker-urls`` and runs at its defaults (60 s health
checks, 5 retries, a circuit breaker).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from conftest import wait_until
from harness import REPO, DaemonRun, merge_servers, watch_exit, write_config

from supervisor.sim.loadgen import prompt


@dataclass
class Load:
    """Clients sending /generate through the router until stopped; counts what failed."""

    url: str
    concurrency: int
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def _client(self, n: int) -> None:
        import aiohttp

        payload = {"text": prompt(8, n), "sampling_params": {"max_new_tokens": 4}}
        async with aiohttp.ClientSession() as http:
            while not self._stop.is_set():
                try:
                    async with http.post(self.url + "/generate", json=payload,
                                         timeout=aiohttp.ClientTimeout(total=30)) as resp:
                        body = await resp.read()
                        if resp.status == 200:
                            self.ok += 1
                        else:
                            self.failed.append(f"HTTP {resp.status}: {body[:120]!r}")
                except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                    self.failed.append(repr(exc)[:160])
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def listed(router: str) -> list[str]:
    with urllib.request.urlopen(router + "/workers", timeout=5) as resp:
        return sorted(w["url"] for w in json.loads(resp.read())["workers"])


def scheduler_of(main_pid: int) -> psutil.Process:
    for child in psutil.Process(main_pid).children(recursive=True):
        if " ".join(child.cmdline()).startswith("sglang::scheduler"):
            return child
    raise AssertionError(f"no sglang::scheduler under pid {main_pid}")


def two_servers(tmp_path: Path) -> list[Path]:
    """Two daemons' configs (without a [router] section: the daemons know nothing of it)."""
    configs = []
    for name in ("a", "b"):
        tmp = tmp_path / name
        tmp.mkdir()
        sections: dict[str, dict[str, Any]] = {
            "server": {"tp_size": 1, "stop_grace_s": 10.0},
            "health": {"interval_s": 1.0, "failures": 3},
        }
        cfg = write_config(tmp, sections, sim_args=("--sim-version", "0.5.23"), name=name)
        text = cfg.read_text()
        # write_config set the dump switches off for the fast tests; this night keeps them on
        cfg.write_text(text.replace('SGLANG_PYSPY_DUMP_BEFORE_CRASH = "0"', 'SGLANG_PYSPY_DUMP_BEFORE_CRASH = "1"'))
        configs.append(cfg)
    return configs


def url_of(cfg: Path) -> str:
    import tomllib

    return f"http://127.0.0.1:{tomllib.loads(cfg.read_text())['server']['port']}"


async def pair_behind_router(tmp_path: Path, start_router: Callable[..., str]) -> tuple[Path, str, list[str]]:
    """Two simulated servers ``a`` and ``b`` (``two_servers``) as one daemon's ``[[server]]``
    entries, with ``[router]`` on a real router just started: (the daemon's config, the
    router's URL, the servers' URLs in that order)."""
    configs = two_servers(tmp_path)
    merged = merge_servers(configs, tmp_path / "pair.toml", ((0,), (1,)))
    router_url = await asyncio.to_thread(start_router)
    merged.write_text(merged.read_text() + f'\n[router]\nenabled = true\nurl = "{router_url}"\nreconcile_s = 2.0\n')
    return merged, router_url, [url_of(c) for c in configs]


async def until_listed(router: str, urls: list[str], what: str, timeout: float = 30.0) -> None:
    """Until the router lists exactly ``urls``."""
    await asyncio.to_thread(wait_until, lambda: listed(router) == sorted(urls), timeout, 0.05, what)


async def night(tmp_path: Path, start_router: Callable[..., str], concurrency: int, integrated: bool, *,
                configs: list[Path] | None = None, ready_s: float = 60.0,
                gpus: tuple[tuple[int, ...], ...] = ((0,), (1,))) -> dict[str, Any]:
    """Kill one server's scheduler under load, then a rolling restart of both.
    ``configs``: the two servers' own configs (default: two simulated servers), merged into
    one daemon's ``[[server]]`` entries (``gpus``: their indices; () for none)."""
    configs = configs or two_servers(tmp_path)
    urls = [url_of(c) for c in configs]
    merged = merge_servers(configs, tmp_path / "pair.toml", gpus)
    if integrated:
        router_url = await asyncio.to_thread(start_router)
        merged.write_text(merged.read_text() + f'\n[router]\nenabled = true\nurl = "{router_url}"\nreconcile_s = 2.0\n')
    else:
        router_url = await asyncio.to_thread(start_router, "--worker-urls", *urls)
    out: dict[str, Any] = {"concurrency": concurrency, "integrated": integrated}
    with DaemonRun(merged) as d:
        for name in ("a", "b"):
            await asyncio.to_thread(d.wait_for, "server_ready", ready_s, server=name)
        await asyncio.to_thread(wait_until, lambda: listed(router_url) == sorted(urls), 30, 0.05, "both servers listed")

        # 1. a scheduler SIGKILLed while serving
        load = Load(router_url, concurrency)
        load.start()
        await asyncio.sleep(1.0)
        main = int(d.wait_for("launch", server="a")["pid"])
        b_launches = len(d.find("launch", server="b"))
        victim = scheduler_of(main)
        exited: dict[str, float] = {}
        watcher = watch_exit(main, exited)
        killed_at = time.monotonic()
        victim.kill()
        await asyncio.to_thread(d.wait_for, "server_ready", ready_s, attempt=2, server="a")
        await asyncio.to_thread(wait_until, lambda: listed(router_url) == sorted(urls), 30, 0.05, "listed again")
        await asyncio.sleep(1.0)
        await load.stop()
        out["crash"] = {"ok": load.ok, "failed": len(load.failed), "examples": load.failed[:3],
                        "other_server_relaunched": len(d.find("launch", server="b")) - b_launches}
        if integrated:
            down = d.wait_for("server_down", server="a")
            removed = next(r for r in d.find("router_removed", server="a") if r["mono"] >= down["mono"])
            out["crash"]["noticed_s"] = round(down["mono"] - killed_at, 4)
            out["crash"]["removed_s"] = round(removed["mono"] - killed_at, 4)
            out["crash"]["removed_after_decision_s"] = removed["after_s"]
        watcher.join(30)
        out["crash"]["main_exit_s"] = round(exited["at"] - killed_at, 4) if "at" in exited else None

        # 2. a rolling restart: one command, the daemon restarts the servers one at a time
        load = Load(router_url, concurrency)
        load.start()
        await asyncio.sleep(1.0)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor.cli", "restart", "--config", str(merged),
            stdout=asyncio.subprocess.DEVNULL, cwd=REPO,
        )
        assert await proc.wait() == 0
        # the command returns when the daemon's pass is done, not before (its log line is
        # written before the command is told)
        assert d.find("rolling_restart", step="done"), "restart returned before the daemon's pass was done"
        await asyncio.to_thread(wait_until, lambda: listed(router_url) == sorted(urls), 30, 0.05, "listed again")
        await asyncio.sleep(1.0)
        await load.stop()
        out["restart"] = {"ok": load.ok, "failed": len(load.failed), "examples": load.failed[:3],
                          "order": rolling_order(d)}
    return out


def rolling_order(d: DaemonRun) -> list[str]:
    """The rolling restart's steps as "a: stop" / "a: ready" lines, in the daemon's order."""
    steps = []
    start = d.wait_for("rolling_restart", step="restart")["mono"]
    for e in d.events():
        if e.get("mono", 0) < start or e.get("server") not in ("a", "b"):
            continue
        if e.get("event") == "state_changed" and e.get("to") == "RESTARTING":
            steps.append(f"{e['server']}: stop")
        elif e.get("event") == "server_ready":
            steps.append(f"{e['server']}: ready")
    return steps
