"""The command line and the composition root: the only place that knows concrete adapters.

    sglang-supervisor run --config F [--set S.K=V ...] [--dry-run]
    sglang-supervisor check-config --config F
    sglang-supervisor status --config F [--json]
    sglang-supervisor restart --config F [--no-wait] [--timeout S]
    sglang-supervisor explain LOGFILE|- [--json]
    sglang-supervisor preflight --config F [--json]
    sglang-supervisor drill --config F
    sglang-supervisor demo [--scenario oom|preempt] [--hold S] [--set ...] [--log-json]

Bad input gets one line on stderr (what, where, why) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import Sequence
from typing import IO, Any

from . import __version__
from .config import Config, ConfigError, load_config

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own convention)
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def _add_config(p: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    p.add_argument("--config", "-c", required=True, help="the TOML config file")
    if overrides:
        p.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
            help="override a config key; the value is read as TOML (a bare word is a string)",
        )


def build_parser() -> argparse.ArgumentParser:
    from . import alerts, explain, preflight

    parser = _Parser(prog="sglang-supervisor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"sglang-supervisor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("run", help="run the daemon")
    _add_config(p)
    p.add_argument("--dry-run", action="store_true", help="print the argv it would launch, as JSON")

    p = sub.add_parser("check-config", help="validate a config file")
    _add_config(p)

    p = sub.add_parser("status", help="state, fraction and crash history from the state directory")
    _add_config(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "restart", help="a planned restart of the running daemon's server: drain, stop, relaunch with the current flags",
        description="Ask the running daemon to drain its server (SIGTERM to SGLang's main process: in-flight "
        "requests finish), stop it and relaunch it with the current flags, then wait until it is READY again. "
        "Example: sglang-supervisor restart --config /etc/sglang-supervisor/kimi.toml",
    )
    _add_config(p, overrides=False)
    p.add_argument("--no-wait", action="store_true", help="return once the daemon has accepted the request")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for READY (default 3600)")

    p = sub.add_parser("explain", help="diagnose a crash log")
    explain.add_arguments(p)

    p = sub.add_parser("preflight", help="check GPUs, host RAM, port and model path")
    _add_config(p)
    preflight.add_arguments(p)

    p = sub.add_parser("drill", help="publish a drill alert and report whether the broker acked it")
    _add_config(p)
    alerts.add_arguments(p)

    from . import demo

    p = sub.add_parser("demo", help="the seed's night against the simulator")
    demo.add_arguments(p)
    return parser


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"sglang-supervisor: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "explain":
        from . import explain

        return explain.run(args)
    if cmd == "demo":
        from . import demo

        return demo.run(args)
    cfg = load_config(args.config, getattr(args, "overrides", []))
    if cmd == "check-config":
        print(f"{args.config}: ok")
        return 0
    if cmd == "run":
        if args.dry_run:
            print(json.dumps(list(next_argv(cfg))))
            return 0
        return asyncio.run(run_daemon_async(cfg, config_path=args.config, overrides=args.overrides))
    if cmd == "status":
        return status(cfg, as_json=args.json)
    if cmd == "restart":
        return restart(cfg, wait=not args.no_wait, timeout_s=args.timeout)
    if cmd == "preflight":
        from . import preflight

        return preflight.run(args, cfg)
    if cmd == "drill":
        from . import alerts

        return alerts.run(args, cfg)
    raise AssertionError(cmd)


# --- the daemon's composition root ------------------------------------------------------


async def run_daemon_async(
    cfg: Config,
    *,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    extra_sinks: Sequence[Any] = (),
    log_stream: IO[str] | None = None,
    on_daemon: Any = None,
    install_signals: bool = True,
) -> int:
    """Build the real adapters around a ``Daemon`` and run it to the end."""
    from prometheus_client import CollectorRegistry

    from . import gpu, logs
    from .daemon import Daemon, Ports
    from .sdnotify import Notifier
    from .store import StateStore

    logger = logs.configure(cfg.logging.format, cfg.logging.level, log_stream)
    host = socket.gethostname()
    instance = cfg.mqtt.instance or cfg.name
    sinks: list[Any] = [logs.LogSink(logger)]
    metrics_server = None
    alerter = None
    metrics = None
    if cfg.metrics.enabled:
        from .metrics import Metrics, MetricsError, start_metrics_server

        registry = CollectorRegistry(auto_describe=True)
        metrics = Metrics(registry, fraction_ladder=cfg.policy.fraction_ladder, headroom_min_gb=cfg.gpu.headroom_min_gb)
        sinks.append(metrics)
        try:
            metrics_server = await start_metrics_server(cfg.metrics.listen, registry)
        except MetricsError as exc:
            logger.error("metrics_unavailable", error=str(exc))
        else:
            logger.info("metrics_listening", listen=metrics_server.url)
    if cfg.mqtt.enabled:
        from .alerts import MqttAlerter

        def on_health(kind: str, value: Any) -> None:
            if metrics is None:
                return
            if kind == "mqtt_connected":
                metrics.emit(kind, {"connected": bool(value)})
            elif kind in ("alert_sent", "alert_dropped"):
                metrics.emit(kind, {"kind": value})

        alerter = MqttAlerter(cfg.mqtt, host=host, instance=instance, logger=logger, on_health=on_health)
        await alerter.start()
        sinks.append(alerter)
    sinks.extend(extra_sinks)

    def reload() -> Config:
        if config_path is None:
            raise ConfigError("no config file to reload")
        return load_config(config_path, overrides)

    ports = Ports(
        store=StateStore(cfg.state.dir),
        sinks=sinks,
        logger=logger,
        gpu_probe=gpu.make_probe(cfg.gpu),
        notifier=Notifier.from_env(),
        reload=reload,
        host=host,
        install_signals=install_signals,
    )
    daemon = Daemon(cfg, ports)
    if on_daemon is not None:
        on_daemon(daemon)
    try:
        return await daemon.run()
    finally:
        if alerter is not None:
            await alerter.aclose()
        if metrics_server is not None:
            await metrics_server.close()


def next_argv(cfg: Config) -> tuple[str, ...]:
    """The argv the daemon would launch next: the learned rung if the state dir has one."""
    from .machine import Learned, build_argv
    from .store import StateStore

    data, _warning = StateStore(cfg.state.dir).load(move_aside=False)
    learned = Learned.initial(cfg)
    if data and isinstance(data.get("learned"), dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            learned = Learned.from_dict(data["learned"]).rebased(cfg)
    return build_argv(cfg, learned.fraction, learned.hicache_size_gb)


# --- restart ----------------------------------------------------------------------------


def restart(cfg: Config, *, wait: bool = True, timeout_s: float = 3600.0, out: IO[str] | None = None) -> int:
    """Ask the running daemon for a planned restart; with ``wait``, until READY again."""
    import time

    from .control import ControlError, request, socket_path
    from .store import StateStore

    out = out or sys.stdout
    try:
        answer = asyncio.run(request(socket_path(cfg.state.dir), {"cmd": "restart", "reason": "sglang-supervisor restart"}))
    except ControlError as exc:
        return _fail(f"restart: {exc} (is the daemon for {cfg.name} running?)", 1)
    if not answer.get("ok"):
        return _fail(f"restart: refused: {answer.get('error')}", 1)
    before = answer.get("attempt")
    print(f"restart accepted ({answer.get('state')}, launch {before})", file=out, flush=True)
    if not wait:
        return 0
    store = StateStore(cfg.state.dir)
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        data, _warning = store.load(move_aside=False)
        state = (data or {}).get("state")
        attempt = (data or {}).get("attempt")
        if state != seen:
            print(f"  {state}", file=out, flush=True)
            seen = state
        if state == "READY" and isinstance(attempt, int) and isinstance(before, int) and attempt > before:
            print(f"ready again (launch {attempt})", file=out)
            return 0
        if state in ("GAVE_UP", "STOPPED"):
            return _fail(f"restart: the daemon is {state}: {(data or {}).get('reason', '')}", 1)
        time.sleep(0.2)
    return _fail(f"restart: not READY again after {timeout_s:g} s (state {seen})", 1)


# --- status -----------------------------------------------------------------------------


def status(cfg: Config, *, as_json: bool = False, out: IO[str] | None = None) -> int:
    from .store import StateStore

    out = out or sys.stdout
    store = StateStore(cfg.state.dir)
    data, warning = store.load(move_aside=False)
    running = store.locked_by_other()
    if data is None:
        if as_json:
            print(json.dumps({"running": running, "state": None, "warning": warning}), file=out)
        else:
            print(f"no state in {cfg.state.dir} (never run here?)" + (f" - {warning}" if warning else ""), file=out)
        return 0
    learned = data.get("learned", {})
    if as_json:
        print(json.dumps({"running": running, **data}, indent=1), file=out)
        return 0
    state = data.get("state", "?")
    print(f"instance:  {cfg.name}  (daemon {'running, pid ' + str(data.get('daemon_pid')) if running else 'not running'})", file=out)
    print(f"state:     {state}{'' if running else ' (last known)'}  {data.get('reason', '')}", file=out)
    def frac(value: object) -> str:
        return "SGLang's own choice" if value is None else str(value)

    print(
        f"fraction:  {frac(learned.get('fraction'))}  (configured {frac(learned.get('base_fraction'))}; "
        f"ran out of CUDA memory at: {', '.join(map(str, learned.get('oom_fractions', []))) or 'none'})",
        file=out,
    )
    print(f"hicache:   {learned.get('hicache_size_gb')} GB per rank   restarts: {learned.get('restarts', 0)}", file=out)
    history = learned.get("history", [])
    print(f"history:   {len(history)} crash(es) and step-down(s)", file=out)
    if history:
        rows = [("time", "cause", "phase", "exit", "fraction", "next", "location")]
        for h in history[-20:]:
            rows.append((
                h["wall_time"], h["cause"], h["phase"], h["exit"], "sglang" if h["fraction"] is None else f"{h['fraction']:g}",
                "-" if h["next_fraction"] is None else f"{h['next_fraction']:g}", h.get("location") or "-",
            ))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=out)
    return 0


if __name__ == "__main__":  # python -m supervisor.cli
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
