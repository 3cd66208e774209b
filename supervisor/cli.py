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
import textwrap
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, NoReturn

from . import __version__
from .config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from .alerts import MqttAlerter
    from .metrics import Metrics

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse's own convention)
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def _add_config(p: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    p.add_argument("--config", "-c", required=True, help="the TOML config file")
    if overrides:
        p.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
            help="override a config key; the value is read as TOML (a bare word is a string)",
        )


DESCRIPTION = """\
Keep an SGLang server running unattended on a GPU host. sglang-supervisor launches the
server, watches its /health and the free memory of every GPU, and when the server dies it
reads the traceback, names the cause and relaunches it with the remedy that points the
right way: a CUDA OOM while serving lowers --mem-fraction-static one rung, a startup
"increase --mem-fraction-static" raises it, a host OOM shrinks the hierarchical cache, a
dead GPU stops and calls a human. Prometheus metrics and MQTT alerts say what happened."""

EPILOG = """\
Examples:
  sglang-supervisor demo                     # try it: a simulated 8-GPU night, no GPU needed
  sglang-supervisor check-config --config /etc/sglang-supervisor/kimi.toml
  sglang-supervisor run --config /etc/sglang-supervisor/kimi.toml
  sglang-supervisor status --config /etc/sglang-supervisor/kimi.toml
  sglang-supervisor explain /var/log/sglang-supervisor/kimi/server.log

'sglang-supervisor COMMAND --help' shows a command's options and an example."""

CONFIG = "/etc/sglang-supervisor/kimi.toml"


def _command(
    sub: Any, name: str, summary: str, example: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand whose --help has a description and an example."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=textwrap.fill(description or summary[0].upper() + summary[1:] + ".", 88),
        epilog=f"Example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    from . import alerts, explain, preflight

    parser = _Parser(prog="sglang-supervisor", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sglang-supervisor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    p = _command(
        sub, "run", "run the daemon: launch the server and keep it running",
        f"sglang-supervisor run --config {CONFIG} --set server.mem_fraction_static=0.88",
        "Run the daemon in the foreground (systemd runs it so): launch SGLang with the config's flags, "
        "watch it, and relaunch it with the remedy when it dies. --dry-run prints the argv it would "
        "launch and exits.",
    )
    _add_config(p)
    p.add_argument("--dry-run", action="store_true", help="print the argv it would launch, as JSON")

    p = _command(sub, "check-config", "validate a config file", f"sglang-supervisor check-config --config {CONFIG}")
    _add_config(p)

    p = _command(
        sub, "status", "state, fraction and crash history from the state directory",
        f"sglang-supervisor status --config {CONFIG} --json",
    )
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = _command(
        sub, "restart",
        "a planned restart of the running daemon's server: drain, stop, relaunch with the current flags",
        f"sglang-supervisor restart --config {CONFIG}",
        "Ask the running daemon to drain its server (SIGTERM to SGLang's main process: in-flight "
        "requests finish), stop it and relaunch it with the current flags, then wait until it is READY again.",
    )
    _add_config(p, overrides=False)
    p.add_argument("--no-wait", action="store_true", help="return once the daemon has accepted the request")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for READY (default 3600)")

    p = _command(
        sub, "explain", "diagnose a crash log",
        "journalctl -u my-old-sglang -o cat | sglang-supervisor explain -",
        "Read a dead SGLang server's log and say why it died: the cause, the evidence line, where in "
        "the code, and what the supervisor would do about it.",
    )
    explain.add_arguments(p)

    p = _command(sub, "preflight", "check GPUs, host RAM, port and model path",
                 f"sglang-supervisor preflight --config {CONFIG}")
    _add_config(p)
    preflight.add_arguments(p)

    p = _command(
        sub, "drill", "publish a drill alert and report whether the broker acked it",
        f"sglang-supervisor drill --config {CONFIG}",
        "Publish a drill alert to the config's MQTT broker, as a real alert would go, and report "
        "whether the broker acknowledged it (exit 0) or not (exit 1).",
    )
    _add_config(p)
    alerts.add_arguments(p)

    from . import demo

    p = _command(
        sub, "demo", "the seed's night against the simulator (no GPU needed)",
        "sglang-supervisor demo --scenario preempt --hold 60",
        "Replay a night against a simulated SGLang on simulated GPUs: the server dies of a CUDA OOM "
        "at 0.93 and comes back at 0.88 (--scenario oom), or the headroom guard steps down before "
        "it dies (--scenario preempt).",
    )
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

    from . import cleanup, control, gpu, logs, preflight
    from .cgroup import cgroup_oom_kills
    from .daemon import Daemon, Ports
    from .health import HealthProber
    from .process import ServerProcess
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
        alerter = build_alerter(cfg, host=host, instance=instance, logger=logger, metrics=metrics)
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
        cleanup=cleanup,
        preflight=preflight,
        spawner=ServerProcess,
        prober=HealthProber,
        gpu_monitor=gpu.GpuMonitor,
        start_control=control.ControlServer.start,
        oom_kills=cgroup_oom_kills,
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


def _no_health(kind: str, value: Any) -> None:
    """The alerter's health hook when metrics are off: nothing to count."""


def alerting_health_callback(metrics: Metrics | None) -> Callable[[str, Any], None]:
    """The MQTT alerter's ``on_health``: the metrics sink's own hook, or a no-op without metrics.

    There is one mapping from the alerter's health reports to metrics, ``Metrics.alerting_health``;
    a copy here once left out ``mqtt_connect_failed``.
    """
    return _no_health if metrics is None else metrics.alerting_health


def build_alerter(cfg: Config, *, host: str, instance: str, logger: Any, metrics: Metrics | None) -> MqttAlerter:
    """The daemon's MQTT alerter (not started), reporting its health to ``metrics``."""
    from .alerts import MqttAlerter

    return MqttAlerter(cfg.mqtt, host=host, instance=instance, logger=logger,
                       on_health=alerting_health_callback(metrics))


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
        rows.extend(
            (
                h["wall_time"], h["cause"], h["phase"], h["exit"], "sglang" if h["fraction"] is None else f"{h['fraction']:g}",
                "-" if h["next_fraction"] is None else f"{h['next_fraction']:g}", h.get("location") or "-",
            )
            for h in history[-20:]
        )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=out)
    return 0


if __name__ == "__main__":  # python -m supervisor.cli
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
