"""sglang-supervisor's command line: one module per command, and the parser that routes to them.

    sglang-supervisor run --config F [--set S.K=V ...] [--dry-run]     (cli/run.py)
    sglang-supervisor check-config --config F
    sglang-supervisor status --config F [--server NAME] [--json]       (cli/status.py)
    sglang-supervisor restart --config F [--server NAME] [--no-wait]   (cli/restart.py)
    sglang-supervisor reexec --config F                                (cli/reexec.py)
    sglang-supervisor stop|start --config F [--server NAME] [--no-wait] (cli/maintenance.py)
    sglang-supervisor logs --config F [--server NAME] [-n N] [-f] [--launch N]  (cli/logs.py)
    sglang-supervisor explain LOGFILE|- [--json] [--launch N] [--config F]  (cli/explain.py)
    sglang-supervisor preflight --config F [--json]                    (cli/preflight.py)
    sglang-supervisor drill --config F                                 (cli/drill.py)
    sglang-supervisor fleet list|reset --config F [...]                (cli/fleet.py)
    sglang-supervisor report --config F [--since 12h] [-o F] [--format html|png|text]  (cli/report.py)
    sglang-supervisor demo [--scenario oom|preempt] [--hold S] [...]   (cli/demo.py)

Bad input gets one line on stderr (what, where, why) and exit code 2, never a traceback.
The CLI is the only layer that may reach the simulator, and only through ``cli/registry.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from supervisor import __version__
from supervisor.cli.common import EXIT_USAGE, fail
from supervisor.core.config import ConfigError, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse's own convention)
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse drops a failed write; a closed pipe (``--help | head``) is main()'s to end quietly
        if message:
            (file or sys.stderr).write(message)


def _add_config(p: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    """``--config`` and ``--set``: every command that reads a config takes both, so that what
    ``run --set`` changed (a state directory, a port) is read back the same way."""
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
    from supervisor.cli import demo, drill, explain, fleet, preflight, report

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
        sub, "status", "each server's state, pid, uptime, fraction and last cause; the exit code for monitors",
        f"sglang-supervisor status --config {CONFIG} || echo \"not serving: $?\"",
        "One line per server (name, state, pid, uptime, fraction, last crash), from the state "
        "directory, whether or not the daemon runs; why it gave up or is held under it. Exit code "
        "(LSB, as systemctl is-active): 0 every server serving; 3 a server not running (stopped, "
        "held, starting, backing off); 1 a server that gave up, or a daemon that is not running "
        "while its state says it should; 4 no state.",
    )
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (everything in the state file)")
    p.add_argument("--verbose", "-v", action="store_true", help="also the fraction's history, capacity and fleet")
    p.add_argument("--server", metavar="NAME", help="only this server (a config with several [[server]])")

    for cmd, summary, description in (
        ("stop", "stop a server for maintenance and keep it stopped; the daemon stays up",
         "Ask the running daemon to take the server out of SGLang's router, drain it (as a planned "
         "restart does), stop it and keep it stopped, across daemon restarts too, until 'start'. No "
         "crash is counted and the fraction does not move. With one server the daemon stays up, "
         "idle. Without --server, every server."),
        ("start", "start a server stopped by 'stop' (or one that gave up)",
         "Ask the running daemon to launch a server held by 'stop' (or one that gave up, with its "
         "crash budget afresh), and wait until it is READY and back in the router."),
    ):
        p = _command(sub, cmd, summary, f"sglang-supervisor {cmd} --config {CONFIG} --server tp4-a", description)
        _add_config(p)
        p.add_argument("--server", metavar="NAME", help=f"{cmd} only this server (default: all)")
        p.add_argument("--no-wait", action="store_true", help="return once the daemon has accepted the request")
        p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait (default 3600)")
        p.add_argument("--reason", default=f"sglang-supervisor {cmd}", help="why, for the journal and the alert")

    p = _command(
        sub, "logs", "print a server's log (server.log), one launch of it, or follow it",
        f"sglang-supervisor logs --config {CONFIG} --server tp4-a -n 100 -f",
        "Print the server's own output as the daemon wrote it (server.log): the last -n lines, or "
        "one launch (--launch N: from the daemon's '=== sglang-supervisor launch N' line to the "
        "next); -f follows it like tail -F, across relaunches and log rotation.",
    )
    _add_config(p)
    p.add_argument("--server", metavar="NAME", help="this server's log (default: the first)")
    p.add_argument("-n", "--lines", type=int, metavar="N", help="the last N lines (default 50, or all of a --launch)")
    p.add_argument("--launch", type=int, metavar="N", help="only launch N (all its lines unless -n is given)")
    p.add_argument("-f", "--follow", action="store_true", help="follow the log as it grows")

    p = _command(
        sub, "restart",
        "a planned restart of the running daemon's servers, one at a time: drain, stop, relaunch with the current flags",
        f"sglang-supervisor restart --config {CONFIG} --server tp4-a",
        "Ask the running daemon to take its server out of SGLang's router, drain it (SIGTERM to "
        "SGLang's main process: in-flight requests finish), stop it and relaunch it with the current "
        "flags, then wait until it is READY (and back in the router) again. With several servers it "
        "does so one at a time, and takes one down only while another serves; --server restarts one.",
    )
    _add_config(p)
    p.add_argument("--server", metavar="NAME", help="restart only this server (default: all, one at a time)")
    p.add_argument("--no-wait", action="store_true", help="return once the daemon has accepted the request")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for READY (default 3600)")

    p = _command(
        sub, "reexec", "re-execute the running daemon in place (an upgrade): the same pid, the servers serving on",
        f"pip install -U sglang-supervisor && sglang-supervisor reexec --config {CONFIG}",
        "Ask the running daemon to re-execute itself with the code installed now (as systemd's "
        "daemon-reexec does): it checks the new code (--version, check-config), waits for a safe "
        "point, hands its state over and execs, keeping its pid, its servers' output pipes and its "
        "lock. The new program adopts each server where it stands: no relaunch, no request lost. "
        "SIGUSR2 does the same (systemctl kill -s USR2). Exit 0 when every server was adopted.",
    )
    _add_config(p)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the new program (default 300)")
    p.add_argument("--reason", default="sglang-supervisor reexec", help="why, for the journal")

    p = _command(
        sub, "explain", "diagnose a crash log",
        "sglang-supervisor explain --launch 2 /var/log/sglang-supervisor/kimi/server.log\n"
        "  journalctl -u my-old-sglang -o cat | sglang-supervisor explain -",
        "Read a dead SGLang server's log and say why it died: the cause, the evidence line, where in "
        "the code, and what the supervisor would do about it. A log of several launches (the daemon's "
        "'=== sglang-supervisor launch N' lines, or a new start-up after SGLang's READY line) is read "
        "one launch at a time: the last one that ended (launch N of M: crashed / stopped cleanly / "
        "still running), or --launch N; its start-up facts are that launch's only.",
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
    drill.add_arguments(p)

    p = _command(
        sub, "fleet", "list or reset the fleet-memory records in etcd ([fleet], docs/fleet.md)",
        f"sglang-supervisor fleet list --config {CONFIG}",
        "Fleet memory: daemons running the same configuration (model, SGLang version, GPU, layout, "
        "memory flags) share the fractions that ran out of CUDA memory in etcd. 'fleet list' shows "
        "every record; 'fleet reset' deletes one (--key) or all (--all).",
    )
    fleet_sub = p.add_subparsers(dest="fleet_command", required=True, parser_class=_Parser, metavar="ACTION")
    fleet.add_arguments(fleet_sub, _command, _add_config, CONFIG)

    p = _command(
        sub, "report", "the morning report: one page of the night from the state directory",
        f"sglang-supervisor report --config {CONFIG} --since 12h -o night.html",
        "Write the night's report from the state directory (the daemon's journal and GPU memory "
        "ring): a timeline of the states, mem_fraction_static, the crashes and restarts and the free "
        "GPU memory of each rank; a summary table; and what to do now, in the alerts' words. HTML "
        "(one self-contained file), PNG (for a chat or an alert) or text (for a terminal).",
    )
    _add_config(p)
    report.add_arguments(p)

    p = _command(
        sub, "demo", "the seed's night against the simulator (no GPU needed)",
        "sglang-supervisor demo --scenario preempt --hold 60",
        "Replay a night against a simulated SGLang on simulated GPUs: the server dies of a CUDA OOM "
        "at 0.93 and comes back at 0.88 (--scenario oom), or the headroom guard steps down before "
        "it dies (--scenario preempt).",
    )
    demo.add_arguments(p)
    return parser


# A reader that went away (``explain - | head -3``): the status of a command killed by SIGPIPE.
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    if os.getpid() == 1:
        _pid1_signals()
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help, --version: argparse printed; what is buffered must reach the pipe
            sys.stdout.flush()
            raise
        try:
            code = _dispatch(args)
        except ConfigError as exc:
            code = fail(str(exc))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        return 130
    return code


def _closed_pipe() -> int:
    """stdout's reader went away: end quietly, with the status the shell shows for a command
    killed by SIGPIPE (141). What is still buffered goes to /dev/null, so the interpreter's own
    flush at exit cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_CLOSED_PIPE


def _pid1_signals() -> None:
    """As PID 1 (a container's entrypoint) a signal with no handler is ignored: SIGTERM would
    do nothing until the daemon's own handlers are installed (``Daemon.run``). Until then it
    ends the process, as it would anywhere else; nothing has been launched yet."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "explain":
        from supervisor.cli import explain

        return explain.run(args)
    if cmd == "demo":
        from supervisor.cli import demo

        return demo.run(args)
    cfg = load_config(args.config, getattr(args, "overrides", []))
    if cmd == "check-config":
        print(f"{args.config}: ok")
        return 0
    if cmd == "run":
        from supervisor.cli.run import dry_run, run_daemon_async

        if args.dry_run:
            print(json.dumps(dry_run(cfg)))
            return 0
        return asyncio.run(run_daemon_async(cfg, config_path=args.config, overrides=args.overrides))
    if cmd == "status":
        from supervisor.cli.status import status

        return status(cfg, server=args.server, as_json=args.json, verbose=args.verbose)
    if cmd in ("stop", "start"):
        from supervisor.cli.maintenance import maintenance

        return maintenance(cmd, cfg, server=args.server, wait=not args.no_wait, timeout_s=args.timeout,
                           reason=args.reason, out=sys.stdout)
    if cmd == "logs":
        from supervisor.cli.logs import logs

        lines = args.lines if args.lines is not None else 0 if args.launch is not None else 50
        return logs(cfg, server=args.server, lines=lines, launch=args.launch, follow=args.follow)
    if cmd == "restart":
        from supervisor.cli.restart import restart

        return restart(cfg, server=args.server, wait=not args.no_wait, timeout_s=args.timeout)
    if cmd == "reexec":
        from supervisor.cli.reexec import reexec

        return reexec(cfg, timeout_s=args.timeout, reason=args.reason, out=sys.stdout)
    if cmd == "preflight":
        from supervisor.cli import preflight

        return preflight.run(args, cfg)
    if cmd == "drill":
        from supervisor.cli import drill

        return drill.run(args, cfg)
    if cmd == "report":
        from supervisor.cli import report

        return report.run(args, cfg)
    if cmd == "fleet":
        from supervisor.cli import fleet

        return fleet.run(args, cfg)
    raise AssertionError(cmd)
