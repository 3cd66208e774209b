"""``sglang-supervisor demo``: the seed's night, replayed against the simulator.

Scenario ``oom`` (default): launch at 0.93 with 0.82 GB of headroom; a burst of 150 short
and 32 long concurrent requests (each retried across restarts) dies with a CUDA OOM in
``deepseek_v2.py forward``; the supervisor reads the traceback (``cuda_oom_runtime``),
relaunches at 0.88, and the load completes. Scenario ``preempt``: the headroom guard sees
0.82 GB after CUDA-graph capture and steps down to 0.88 before any traffic: no crash.

It needs no GPU and no broker. It prints a short human timeline and exits 0 when the
night ended as the policy promises.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from supervisor.aio import within
from supervisor.core.config import Config, load_config
from supervisor.core.events import Event

if TYPE_CHECKING:  # loadgen (aiohttp) is imported only when the demo runs
    from supervisor.sim.loadgen import LoadResult

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "etc" / "demo.toml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=str(DEMO_CONFIG), help="demo config (default: etc/demo.toml)")
    p.add_argument("--scenario", choices=("oom", "preempt"), default="oom")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a config key; the value is read as TOML (a bare word is a string)",
    )
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep supervising this long after the scenario (for scraping, for a look)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines to stderr instead of a file")
    p.add_argument("--deadline", type=float, default=240.0, metavar="SECONDS",
                   help="give the scenario up after this long (exit 1)")
    p.add_argument("--report", default="", metavar="PATH",
                   help="where to write the night's report (default: report.html in the demo's directory; "
                        "'none': no report)")


class Timeline:
    """An EventSink that prints the night as a person would tell it."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.start = time.monotonic()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ready = asyncio.Event()
        self.state = "STOPPED"
        self.fraction: float | None = None

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {text}", file=self.out, flush=True)

    def emit(self, typed: Event) -> None:
        event, f = typed.kind, typed.fields()
        self.events.append((event, f))
        if event == "launch":
            self.fraction = f["mem_fraction_static"]
            self._say(f"launch #{f['attempt']}: SGLang (simulated) at mem_fraction_static={f['mem_fraction_static']:g}, pid {f['pid']}")
        elif event == "state_changed":
            self.state = f["to"]
            if f["to"] == "READY":
                self.ready.set()
            else:
                self.ready.clear()
        elif event == "server_ready":
            self._say(f"server ready after {f['startup_s']:.1f} s at {f['mem_fraction_static']:g}")
        elif event == "startup_facts" and f.get("avail_mem_after_capture_gb") is not None:
            self._say(f"startup facts: {f['avail_mem_after_capture_gb']:g} GB left after CUDA-graph capture, "
                      f"max_total_num_tokens={f.get('max_total_num_tokens')}")
        elif event == "headroom_low":
            act = f"stepping down to {f['next_mem_fraction_static']:g} before traffic arrives" if f["action"] == "step_down" else "warning only"
            self._say(f"headroom guard: {f['avail_mem_gb']:g} GB < {f['threshold_gb']:g} GB on {f['rank']}: {act}")
        elif event == "server_down":
            who = "its main process" if f.get("title") == "main" else f"{f.get('title')} (pid {f.get('pid')})"
            self._say(f"DOWN: {who} died; reading the log while SGLang tears itself down")
        elif event == "crash":
            where = f" at {f['location']}" if f.get("location") else ""
            self._say(f"CRASH: {f['cause']} ({f['phase']}){where}, {f.get('exc_type') or ''} - remedy {f['remedy']}")
            if f.get("evidence"):
                self._say(f"  evidence: {f['evidence'][0][:140]}")
        elif event == "restart_scheduled":
            self._say(f"restart in {f['delay_s']:.1f} s at mem_fraction_static={f['mem_fraction_static']:g}")
        elif event == "recovered":
            self._say(f"recovered from {f['cause']} at {f['mem_fraction_static']:g}")
        elif event == "gave_up":
            self._say(f"GAVE UP: {f['reason']}")

    def count(self, event: str, **match: Any) -> int:
        return sum(1 for e, f in self.events if e == event and all(f.get(k) == v for k, v in match.items()))


def demo_config(args: argparse.Namespace, workdir: Path) -> Config:
    """The demo's config: etc/demo.toml, the scenario's settings, then the user's --set."""
    action = "step_down" if args.scenario == "preempt" else "warn"
    base = [
        f"state.dir={workdir / 'state'}",
        f"gpu.sim_dir={workdir / 'gpus'}",
        f'gpu.headroom_action="{action}"',
        "report.gpu_sample_s=1",  # the morning report of a two-minute night: one GPU record a second
        "report.keep_days=1",
    ]
    cfg = load_config(args.config, [*base, *args.overrides])
    server = cfg.server
    command = server.command
    if command and command[0] in ("python", "python3"):
        command = (sys.executable, *command[1:])  # the simulator runs in this interpreter
    env = {"SGLANG_SIM_GPU_DIR": cfg.gpu.sim_dir, **server.env}
    if cfg.gpu.backend == "simulated":
        from supervisor.sim import simgpu

        simgpu.ensure_gpus(cfg.gpu.sim_dir, 8, 96)  # the seed's cards: 96 GB each
    return dataclasses.replace(cfg, server=dataclasses.replace(server, command=command, env=env))


DaemonRunner = Callable[..., Awaitable[int]]
"""The CLI's ``run_daemon_async``: the demo runs the real daemon, built by the CLI's
composition root (this package never imports the CLI)."""

ReportWriter = Callable[[Config, Path], Path]
"""The CLI's report writer: (config, where) -> the path of the night's report it wrote."""


def run(args: argparse.Namespace, run_daemon: DaemonRunner, write_report: ReportWriter | None = None) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sglang-supervisor-demo-"))
    cfg = demo_config(args, workdir)
    code = asyncio.run(_run(args, cfg, workdir, run_daemon))
    if write_report is not None and args.report != "none":
        try:
            path = write_report(cfg, Path(args.report) if args.report else workdir / "report.html")
        except Exception as exc:  # noqa: BLE001 - the night went as it went; the report is a bonus
            print(f"the night's report could not be written: {exc}", file=sys.stdout)
        else:
            print(f"the night's report: {path}", file=sys.stdout)
    return code


async def _run(args: argparse.Namespace, cfg: Config, workdir: Path, run_daemon_async: DaemonRunner) -> int:
    from supervisor.sim.loadgen import run_load

    out = sys.stdout
    timeline = Timeline(out)
    log_path = workdir / "supervisor.jsonl"
    log_file: IO[str] = sys.stderr if args.log_json else log_path.open("w", buffering=1)  # noqa: SIM115
    print(f"sglang-supervisor demo ({args.scenario}): SGLang and the GPUs are simulated; "
          f"state in {cfg.state.dir}", file=out)
    if not args.log_json:
        print(f"JSON log lines: {log_path}", file=out)
    if cfg.metrics.enabled:
        print(f"metrics: http://{cfg.metrics.listen}/metrics", file=out)

    daemon_box: dict[str, Any] = {}
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        try:
            await within(timeline.ready.wait(), args.deadline)
            host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "") else cfg.server.host
            url = f"http://{host}:{cfg.server.port}"
            timeline._say("load: 150 short + 32 long concurrent requests (retried across restarts)")
            result = await run_load(url, deadline_s=args.deadline)
            outcome["load"] = result
            timeline._say(f"load done: {result.completed} completed, {result.failed} failed, "
                          f"{result.retries} retries, {result.elapsed_s:.1f} s")
            await within(timeline.ready.wait(), args.deadline)
            if args.hold > 0:
                timeline._say(f"holding for {args.hold:g} s")
                await asyncio.sleep(args.hold)
        except TimeoutError:
            outcome["timeout"] = True
            timeline._say(f"deadline of {args.deadline:g} s passed")
        finally:
            daemon = daemon_box.get("daemon")
            if daemon is not None:
                daemon.request_stop("demo finished")

    task = asyncio.create_task(scenario())
    try:
        code = await run_daemon_async(
            cfg, extra_sinks=[timeline], log_stream=log_file,
            on_daemon=lambda d: daemon_box.__setitem__("daemon", d),
        )
    finally:
        task.cancel()
        if log_file is not sys.stderr:
            log_file.close()
    return _verdict(args.scenario, timeline, outcome, code, out)


def _verdict(scenario: str, t: Timeline, outcome: dict[str, Any], code: int, out: IO[str]) -> int:
    load: LoadResult | None = outcome.get("load")
    crashes = t.count("crash")
    ooms = t.count("crash", cause="cuda_oom_runtime")
    checks = {
        "daemon exited cleanly": code == 0,
        "load completed": load is not None and load.failed == 0 and load.completed == 182,
        "final fraction 0.88": t.fraction is not None and abs(t.fraction - 0.88) < 1e-9,
    }
    if scenario == "oom":
        checks["one runtime CUDA OOM, read as cuda_oom_runtime"] = ooms == 1 and crashes == 1
    else:
        checks["stepped down before any crash"] = crashes == 0 and t.count("headroom_low", action="step_down") == 1
    print("", file=out)
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}", file=out)
    good = all(checks.values())
    print("demo: " + ("the supervisor handled the night as promised" if good else "something went wrong"), file=out)
    return 0 if good else 1
