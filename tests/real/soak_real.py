"""``make soak-real``: a real night, compressed (issue 26, item 1).

Two real SGLang 0.5.23 servers on the CPU (the bf16 tiny model), owned by ONE daemon
(two ``[[server]]`` entries) behind the real ``sglang-router`` (``[router]``), a real
mosquitto (``[mqtt]``) with a subscriber counting every alert by id, ``[report]`` on. Two
clients send ``/generate`` through the router the whole time (concurrency 2).

Every 45-90 s (seeded: ``SOAK_SEED``, printed) one fault, drawn from a shuffled deck of
the kinds in ``FAULTS`` (each kind once before any repeats): SIGKILL of a scheduler, of a
main process, of a detokenizer; SIGSTOP of a scheduler (a hang); ``sglang-supervisor
restart`` (rolling); SIGHUP with a changed flag; the router killed and started again; the
broker stopped for 20 s; the daemon SIGKILLed and started again as systemd would
(``Restart=on-failure``, ``RestartSec`` compressed to ``SOAK_RESTART_SEC``, 2 s); the state
directory made unwritable (a read-only bind mount over it) for 10 s. A foreign SGLang on a
spare port is started once during the night: the daemon must leave it untouched, the
harness reaps it at the end. A fault is never injected before the last one has recovered
(both servers READY and listed by the router).

The night lasts ``SOAK_MINUTES`` (default 30). Results: ``--out`` (JSON) and a table on
stdout; ``python -m tests.real.soak_report`` renders the JSON as a section of
docs/reliability.md. ``tests/real/test_soak_real.py`` runs it for 5 minutes and asserts the
goals.

Every failed client request is attributed to the fault whose window (injection, to serving
again + ``GRACE_S``) it overlaps; a failure outside every window is ``unattributed``.

Launching real servers needs the host lock: run it as
``flock /tmp/real-sglang.lock python -m tests.real.soak_real`` (the Makefile does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import tomli_w

REPO = Path(__file__).resolve().parents[2]
for _p in (str(REPO), str(REPO / "tests"), str(REPO / "tests" / "chaos")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from conftest import free_port, free_port_for_later, wait_until  # noqa: E402
from harness import DaemonRun, merge_servers, read_events, watch_exit  # noqa: E402

from supervisor.adapters.procstart import running, started, still  # noqa: E402
from supervisor.core.events import ALERT_KINDS  # noqa: E402
from tests.real import nights  # noqa: E402
from tests.real.sglang_env import RealSGLang, load  # noqa: E402
from tests.routerlib import http_status  # noqa: E402

FAULTS = (
    "sigkill_scheduler", "sigkill_main", "sigkill_detokenizer", "sigstop_scheduler", "rolling_restart",
    "sighup_flag", "router_restart", "broker_stop", "daemon_kill", "state_unwritable",
)
FOREIGN = "foreign_server"
# make test's night opens with the router's two faults (tests/real/test_real_router.py reads
# them: the night of tests/router_night.py, on the soak's servers instead of two more)
OPENING = ("sigkill_scheduler", "rolling_restart")
# Faults whose window may cost requests (the server hangs with requests in it); every other
# fault must cost none.
MAY_FAIL = frozenset({"sigstop_scheduler"})
# Faults after which the daemon alerts (a server down, its crash, its restart)
ALERTING = frozenset({"sigkill_scheduler", "sigkill_main", "sigkill_detokenizer", "sigstop_scheduler"})
GAP_S = (45.0, 90.0)
# Knobs for developing the harness only (the night itself runs at the defaults):
# SOAK_GAP="10-20" shortens the gaps, SOAK_FAULTS="daemon_kill,router_restart" narrows the deck.
if os.environ.get("SOAK_GAP"):
    GAP_S = tuple(float(x) for x in os.environ["SOAK_GAP"].split("-"))  # type: ignore[assignment]
DECK = tuple(os.environ["SOAK_FAULTS"].split(",")) if os.environ.get("SOAK_FAULTS") else FAULTS
GRACE_S = 3.0  # a window ends this long after serving again (a request in flight at that moment)
# Two (or three, with the foreign one) real servers loading at once on 2 cores shared with
# other work take minutes: 240 s (the real tier's startup_timeout_s) was seen to run out
STARTUP_TIMEOUT_S = 600.0
READY_S = 660.0
RECOVER_S = 660.0
ROUTER_RECONCILE_S = 1.0
BROKER_DOWN_S = 20.0
TAIL_BYTES = 256 * 1024
UNWRITABLE_S = 10.0
RESTART_SEC = float(os.environ.get("SOAK_RESTART_SEC", "2"))
SERVERS = ("a", "b")
# SGLang's crash path as users run it (tests/real/test_real_router.py): py-spy dump switch
# on (a 5 s sleep before the tree is killed), the CUDA coredump wait off
DIAGNOSTICS_ON = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class SoakSetupError(RuntimeError):
    """A component the night needs is missing (mosquitto, the router, SGLang): a failure."""


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the client ---------------------------------------------------------------------------------


@dataclass
class Req:
    t0: float
    t1: float
    ok: bool
    error: str = ""


class Clients:
    """``n`` threads, each sending /generate through the router back to back."""

    def __init__(self, url: str, n: int = 2) -> None:
        self.url = url
        self.reqs: list[Req] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True, name=f"soak-client-{i}")
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        body = json.dumps({"text": f"client {i}: the night shift goes on and", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}).encode()
        while not self._stop.is_set():
            t0 = time.monotonic()
            ok, err = False, ""
            try:
                req = urllib.request.Request(self.url + "/generate", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                    ok = r.status == 200
                    err = "" if ok else f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                err = f"HTTP {e.code}: {e.read()[:100]!r}"
            except Exception as e:  # noqa: BLE001 - every failure counts, whatever its kind
                err = repr(e)[:160]
            with self._lock:
                self.reqs.append(Req(t0, time.monotonic(), ok, err))
            if not ok:
                self._stop.wait(0.2)  # a dead router answers at once: do not spin

    def ok_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for r in self.reqs if r.ok and r.t0 >= t)

    def stop(self) -> list[Req]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        with self._lock:
            return list(self.reqs)


# --- processes ----------------------------------------------------------------------------------


class Proc:
    """A process in its own session, its output in a file; ``stop`` kills its group and reaps."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.argv = argv
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def router_argv(port: int) -> list[str]:
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SoakSetupError("sglang-router is not installed; it comes with the [test] extra (pip install -e '.[test]')")
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "info"]


def tree_of(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def part_of(main: int, prefix: str, timeout: float = 30.0) -> psutil.Process:
    """The process of ``main``'s tree whose title starts with ``prefix`` (sglang::scheduler ...)."""
    def find() -> psutil.Process | None:
        for p in tree_of(main)[1:]:
            try:
                if " ".join(p.cmdline()).startswith(prefix):
                    return p
            except psutil.Error:
                continue
        return None
    return wait_until(find, timeout, 0.1, f"{prefix} under pid {main}")


def resources(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(fields["Threads"]),
                "rss_kb": int(fields["VmRSS"].split()[0])}
    except (OSError, KeyError, ValueError):
        return None


class Watch:
    """Samples every ``interval`` s: the daemon's fds, threads and RSS, and every process
    seen under the daemon, the router, the broker (pid -> create time, name)."""

    def __init__(self, interval: float = 1.0) -> None:
        self.roots: dict[str, int] = {}
        self.seen: dict[int, tuple[int, str, str]] = {}  # pid -> (start since boot, name, under)
        self.samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-watch")
        self._thread.start()

    def root(self, name: str, pid: int) -> None:
        with self._lock:
            self.roots[name] = pid

    def sample(self) -> None:
        with self._lock:
            roots = dict(self.roots)
        for under, pid in roots.items():
            for p in tree_of(pid):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(p.pid, (started(p.pid), p.name(), under))
        daemon = roots.get("daemon")
        if daemon is not None and (r := resources(daemon)) is not None:
            self.samples.append({"t": time.monotonic(), "pid": daemon, **r})

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def leftovers(self, wait_s: float = 10.0) -> list[str]:
        """Seen processes still there (zombies too) after ``wait_s`` (the suite's own end-of-run
        check, tests/leftovers.py, waits as long: a parent may be about to reap its child)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = []
            for pid, (start, name, under) in list(self.seen.items()):
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if still(pid, start):
                        parent = p.ppid()
                        with contextlib.suppress(psutil.Error):
                            parent_name = psutil.Process(parent).name()
                            left.append(f"{pid} {name} ({p.status()}, under the {under}; parent {parent} "
                                        f"{parent_name})")
                            continue
                        left.append(f"{pid} {name} ({p.status()}, under the {under}; parent {parent})")
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


# --- the fault record ---------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    t0: float  # monotonic, at injection
    at_s: float  # seconds into the night
    target: str = ""
    recovered: float | None = None  # monotonic: serving again (both READY and listed)
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def to_serving_s(self) -> float | None:
        return None if self.recovered is None else round(self.recovered - self.t0, 2)

    def window(self) -> tuple[float, float]:
        end = self.recovered if self.recovered is not None else float("inf")
        return self.t0 - 0.5, end + GRACE_S


# --- the night ----------------------------------------------------------------------------------


class Night:
    def __init__(self, real: RealSGLang, tmp: Path, minutes: float, seed: int, opening: tuple[str, ...] = ()) -> None:
        self.real = real  # bf16, as real models are (RealSGLang.model)
        self.tmp = tmp
        self.minutes = minutes
        self.seed = seed
        self.opening = opening  # the first faults, in this order; then the shuffled deck
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.daemons: list[DaemonRun] = []
        self.daemon_exits: list[dict[str, Any]] = []
        self.mounted: Path | None = None
        self.foreign: Proc | None = None
        self.foreign_tree: dict[int, tuple[int, str]] = {}  # pid -> (start since boot, title)
        self.flag_value = 0
        self.prefix = f"soak-{os.getpid()}-{seed}"
        self.watch = Watch()
        self.t_start = time.monotonic()
        self.tree = REPO  # the checkout whose daemon runs (a re-exec's test upgrades a copy)

    # -- setup

    def setup(self) -> None:
        from chaoslib import Subscriber

        from tests.mosquitto import Broker

        if shutil.which("mosquitto") is None and not os.path.exists("/usr/sbin/mosquitto"):
            raise SoakSetupError("mosquitto is not installed (scripts/install-system-deps installs it)")
        self.broker = Broker(self.tmp / "broker", persistent=True)
        self.broker.start()
        self.sub = Subscriber(self.broker.host, self.broker.port, topic=f"{self.prefix}/#")
        self.router_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.router = self._start_router()

        configs = []
        for name in SERVERS:
            d = self.tmp / name
            d.mkdir()
            configs.append(nights.real_config(
                d, self.real, {"server": {"stop_grace_s": 30.0},
                               "health": {"failures": 3, "startup_timeout_s": STARTUP_TIMEOUT_S}},
                env=DIAGNOSTICS_ON, name=name,
            ))
        self.urls = sorted(f"http://127.0.0.1:{tomllib.loads(c.read_text())['server']['port']}" for c in configs)
        self.config = merge_servers(configs, self.tmp / "soak.toml")
        doc = tomllib.loads(self.config.read_text())
        doc["router"] = {"enabled": True, "url": self.router_url, "reconcile_s": ROUTER_RECONCILE_S}
        doc["mqtt"] = {"enabled": True, "host": self.broker.host, "port": self.broker.port,
                       "topic_prefix": self.prefix, "instance": "soak", "reconnect_initial_s": 0.2,
                       "reconnect_max_s": 1.0}
        doc["report"] = {"enabled": True, "gpu_sample_s": 1.0}
        # Each server's output tail (kept for the diagnosis; 2 MiB by default) fills at the
        # servers' log rate, ~0.15 MB a minute here: a bounded buffer, not a leak, but it
        # would take half an hour to fill and pass for one. A smaller one is full before the
        # warm sample, so that the RSS compared after it is what grows without a bound.
        doc.setdefault("logging", {})["tail_bytes"] = TAIL_BYTES
        self.doc = doc
        self._write_config()
        self.state_dir = Path(doc["state"]["dir"])
        say(f"seed {self.seed}; {self.minutes:g} min; router {self.router_url}; servers {self.urls}; "
            f"broker {self.broker.port}; config {self.config}")
        self._start_daemon()
        self._wait_serving(time.monotonic(), READY_S, "the first start")
        self.clients = Clients(self.router_url, 2)
        wait_until(lambda: self.clients.ok_since(0) > 0, 60, 0.2, "a first request through the router")
        time.sleep(3.0)
        self.watch.sample()
        self.res_start = dict(self.watch.samples[-1])
        self.t_start = time.monotonic()
        say(f"serving; daemon {self.d.proc.pid} at start: {self.res_start}")

    def _write_config(self) -> None:
        self.config.write_text(tomli_w.dumps(self.doc))
        self.config.chmod(0o644)

    def _start_router(self) -> Proc:
        p = Proc(router_argv(self.router_port), self.tmp / "router.log")
        try:
            wait_until(lambda: p.alive() and http_status(self.router_url + "/health") == 200, 30, 0.05, "the router")
        except AssertionError:  # wait_until's timeout
            tail = (self.tmp / "router.log").read_text(errors="replace")[-2000:]
            p.stop()
            raise SoakSetupError(f"the router did not answer on {self.router_url}:\n{tail}") from None
        self.watch.root("router", p.proc.pid)
        return p

    def _start_daemon(self) -> None:
        self.d = DaemonRun(self.config, tree=self.tree)
        self.daemons.append(self.d)
        self.watch.root("daemon", self.d.proc.pid)

    def listed(self) -> bool:
        try:
            with urllib.request.urlopen(self.router_url + "/workers", timeout=3) as r:
                return sorted(w["url"] for w in json.loads(r.read())["workers"]) == self.urls
        except (OSError, ValueError, KeyError):
            return False

    def ready_after(self, name: str, t: float) -> bool:
        return any(float(e.get("mono", 0)) > t for e in self.d.find("server_ready", server=name))

    def _wait_serving(self, t0: float, timeout: float, what: str, names: tuple[str, ...] = ()) -> float:
        """Until the servers ``names`` were READY after ``t0`` and the router lists both."""
        def up() -> bool:
            if self.d.proc.poll() is not None:
                raise AssertionError(f"the daemon exited {self.d.proc.returncode} during {what}")
            return all(self.ready_after(n, t0) for n in names) and self.listed()
        if not names and what == "the first start":
            names = SERVERS
        wait_until(up, timeout, 0.25, f"serving again after {what}")
        return time.monotonic()

    def main_of(self, name: str) -> int:
        return int(self.d.find("launch", server=name)[-1]["pid"])

    # -- faults

    def inject(self, kind: str) -> Fault:
        f = Fault(kind, time.monotonic(), round(time.monotonic() - self.t_start, 1))
        self.faults.append(f)
        say(f"fault {len(self.faults)}: {kind}")
        try:
            getattr(self, f"_fault_{kind}")(f)
        except Exception as e:  # noqa: BLE001 - recorded; the night goes on if it can
            f.error = repr(e)[:1500]
            say(f"  {kind} did not recover: {f.error[:300]}")
        else:
            say(f"  serving again after {f.to_serving_s} s {f.detail or ''}")
        return f

    def _kill_part(self, f: Fault, prefix: str | None, sig: int) -> None:
        """One server's part (or main, ``prefix`` None) signalled; until serving again. Kept
        for the router's checks (``test_real_router``): when the daemon noticed and when the
        router lost the server (from the signal), when a killed part's main process exited
        (SGLang's crash diagnostics on: it sleeps 5 s first), the other server's launches."""
        name = self.rng.choice(SERVERS)
        f.target = name
        main = self.main_of(name)
        others = {n: len(self.d.find("launch", server=n)) for n in SERVERS if n != name}
        victim = psutil.Process(main) if prefix is None else part_of(main, prefix)
        f.detail["pid"] = victim.pid
        exited: dict[str, float] = {}
        watcher = watch_exit(main, exited) if prefix is not None and sig == signal.SIGKILL else None
        f.t0 = time.monotonic()
        victim.send_signal(sig)
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind, (name,))

        def since(event: str) -> list[dict[str, Any]]:
            return [e for e in self.d.find(event, server=name) if float(e.get("mono", 0)) > f.t0]

        crash, down, removed = since("crash"), since("server_down"), since("router_removed")
        if crash:
            f.detail["cause"] = crash[0].get("cause")
        if down:
            f.detail["noticed_s"] = round(float(down[0]["mono"]) - f.t0, 4)
        if removed:
            f.detail["removed_s"] = round(float(removed[0]["mono"]) - f.t0, 4)
        f.detail["other_server_relaunched"] = sum(len(self.d.find("launch", server=n)) - k for n, k in others.items())
        if watcher is not None:
            watcher.join(30)
            f.detail["main_exit_s"] = round(exited["at"] - f.t0, 4) if "at" in exited else None

    def _fault_sigkill_scheduler(self, f: Fault) -> None:
        self._kill_part(f, "sglang::scheduler", signal.SIGKILL)

    def _fault_sigkill_main(self, f: Fault) -> None:
        self._kill_part(f, None, signal.SIGKILL)

    def _fault_sigkill_detokenizer(self, f: Fault) -> None:
        self._kill_part(f, "sglang::detokenizer", signal.SIGKILL)

    def _fault_sigstop_scheduler(self, f: Fault) -> None:
        self._kill_part(f, "sglang::scheduler", signal.SIGSTOP)

    def _fault_rolling_restart(self, f: Fault) -> None:
        cmd = subprocess.run(
            [sys.executable, "-m", "supervisor.cli", "restart", "--config", str(self.config), "--timeout", "400"],
            cwd=REPO, capture_output=True, text=True, timeout=450,
        )
        f.detail["rc"] = cmd.returncode
        if cmd.returncode != 0:
            raise AssertionError(f"restart exited {cmd.returncode}: {(cmd.stdout + cmd.stderr)[-800:]}")
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind, SERVERS)
        # the daemon's steps, in its order: one server down and back before the next
        f.detail["order"] = [
            f"{e['server']}: {'stop' if e['event'] == 'state_changed' else 'ready'}" for e in self.d.events()
            if f.t0 <= float(e.get("mono", 0)) <= f.recovered and e.get("server") in SERVERS
            and ((e.get("event") == "state_changed" and e.get("to") == "RESTARTING") or e.get("event") == "server_ready")
        ]

    def _fault_sighup_flag(self, f: Fault) -> None:
        name = self.rng.choice(SERVERS)
        f.target = name
        self.flag_value += 1
        value = str(64 + self.flag_value)
        entry = next(s for s in self.doc["server"] if s["name"] == name)
        entry["extra_args"] = ["--max-running-requests", value]
        self._write_config()
        f.detail["flag"] = f"--max-running-requests {value}"
        f.t0 = time.monotonic()
        self.d.proc.send_signal(signal.SIGHUP)
        ev = wait_until(lambda: [e for e in self.d.find("config_reloaded") if float(e.get("mono", 0)) > f.t0],
                        30, 0.2, "config_reloaded")[0]
        f.detail["reloaded_ok"] = ev.get("ok")
        if not ev.get("ok"):
            raise AssertionError(f"the reload was refused: {ev}")
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind)

    def _fault_router_restart(self, f: Fault) -> None:
        f.t0 = time.monotonic()
        self.router.stop(signal.SIGKILL)
        time.sleep(1.0)
        self.router = self._start_router()
        f.detail["router_up_mono"] = time.monotonic()
        f.detail["router_down_s"] = round(time.monotonic() - f.t0, 2)
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind)

    def _fault_broker_stop(self, f: Fault) -> None:
        f.t0 = time.monotonic()
        self.broker.stop()
        time.sleep(BROKER_DOWN_S)
        self.broker.start()
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind)

    def _fault_daemon_kill(self, f: Fault) -> None:
        old = self.d
        last = resources(old.proc.pid)
        f.detail["old_daemon"] = {"pid": old.proc.pid, **(last or {})}
        f.t0 = time.monotonic()
        old.kill()
        self.daemon_exits.append({"pid": old.proc.pid, "rc": old.proc.returncode, "how": "SIGKILL (fault)"})
        time.sleep(RESTART_SEC)  # Restart=on-failure after RestartSec (compressed)
        self._start_daemon()
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind, SERVERS)
        killed = self.d.find("orphans_killed")
        f.detail["orphans_killed"] = sum(len(e.get("pids") or []) for e in killed)

    def _fault_reexec(self, f: Fault) -> None:
        """``sglang-supervisor reexec`` (docs/upgrade.md), from the daemon's tree: the same
        daemon and server pids and launches after it, nothing relaunched. Not in the night's
        deck (the new program's memory is another's): ``test_real_reexec`` injects it."""
        before = {n: (self.main_of(n), len(self.d.find("launch", server=n))) for n in SERVERS}
        f.t0 = time.monotonic()
        cmd = subprocess.run([sys.executable, "-m", "supervisor.cli", "reexec", "--config", str(self.config),
                              "--timeout", "300"], cwd=self.tree, capture_output=True, text=True, timeout=400)
        f.detail["rc"] = cmd.returncode
        if cmd.returncode != 0:
            raise AssertionError(f"reexec exited {cmd.returncode}: {(cmd.stdout + cmd.stderr)[-800:]}")
        said = wait_until(lambda: [e for e in self.d.find("reexec") if float(e.get("mono", 0)) > f.t0],
                          30, 0.2, "the reexec line")[0]
        f.detail.update(gap_s=said.get("gap_s"), from_version=said.get("from_version"), version=said.get("version"),
                        adopted=said.get("adopted"))
        after = {n: (self.main_of(n), len(self.d.find("launch", server=n))) for n in SERVERS}
        if after != before or said.get("pid") != self.d.proc.pid or said.get("relaunching"):
            raise AssertionError(f"not adopted in place: {before} -> {after}; {said}")
        f.recovered = time.monotonic()

    def _fault_state_unwritable(self, f: Fault) -> None:
        target = self.state_dir
        f.t0 = time.monotonic()
        subprocess.run(["mount", "--bind", str(target), str(target)], check=True, capture_output=True, timeout=20)
        self.mounted = target
        subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], check=True, capture_output=True, timeout=20)
        probe = target / ".soak-probe"
        try:
            probe.write_text("x")
            f.detail["really_unwritable"] = False
            probe.unlink()
        except OSError:
            f.detail["really_unwritable"] = True
        time.sleep(UNWRITABLE_S)
        self._unmount()
        f.recovered = self._wait_serving(f.t0, RECOVER_S, f.kind)
        f.detail["state_write_failed"] = len([e for e in self.d.find("state_write_failed")
                                              if float(e.get("mono", 0)) > f.t0])

    def _unmount(self) -> None:
        if self.mounted is not None:
            subprocess.run(["umount", str(self.mounted)], capture_output=True, timeout=20)
            self.mounted = None

    def start_foreign(self) -> None:
        port = free_port_for_later()
        env = self.real.environ()
        for var in ("SGLANG_SUPERVISOR_TEST_ID",):
            env.pop(var, None)
        f = Fault(FOREIGN, time.monotonic(), round(time.monotonic() - self.t_start, 1), target=f"port {port}")
        self.faults.append(f)
        say(f"fault {len(self.faults)}: {FOREIGN} on port {port}")
        (self.tmp / "foreign").mkdir(exist_ok=True)
        self.foreign = Proc(self.real.launch_args(port), self.tmp / "foreign" / "sglang.log", env=env)
        self.foreign_port = port
        f.detail["pid"] = self.foreign.proc.pid
        f.recovered = time.monotonic()  # nothing of ours goes down; its load is the fault

    def note_foreign_tree(self) -> None:
        if self.foreign is not None:
            for p in tree_of(self.foreign.proc.pid):
                with contextlib.suppress(psutil.Error):
                    if p.pid not in self.foreign_tree:
                        self.foreign_tree[p.pid] = (started(p.pid), (p.cmdline() or [p.name()])[0])

    # -- the loop

    def run(self) -> None:
        end = self.t_start + self.minutes * 60
        deck: list[str] = list(self.opening)
        foreign_in = self.rng.uniform(10.0, min(60.0, self.minutes * 20))
        next_at = self.t_start + self.rng.uniform(*GAP_S)
        # the foreign server comes at its time whatever a fault's recovery is doing then
        self._foreign_timer = threading.Timer(foreign_in, self.start_foreign)
        self._foreign_timer.start()
        while True:
            now = time.monotonic()
            if self.foreign is not None:
                self.note_foreign_tree()
            if now >= end:
                break
            if now >= next_at:
                if not deck:
                    deck = list(DECK)
                    self.rng.shuffle(deck)
                kind = deck.pop(0)
                f = self.inject(kind)
                if f.recovered is None:
                    say("the night cannot go on: a fault did not recover")
                    break
                # every 45-90 s, and never before the last one recovered
                next_at = max(f.t0 + self.rng.uniform(*GAP_S), time.monotonic() + 5.0)
            time.sleep(0.5)
        say("the night is over")

    # -- the end

    def finish(self) -> dict[str, Any]:
        if hasattr(self, "_foreign_timer"):  # a night of chosen faults (``inject`` alone) has none
            self._foreign_timer.cancel()
            self._foreign_timer.join(60)
        self.note_foreign_tree()
        self.watch.sample()
        res_end = dict(self.watch.samples[-1]) if self.watch.samples else {}
        reqs = self.clients.stop() if hasattr(self, "clients") else []
        foreign = self._foreign_check()
        rc = self.d.stop()
        self.daemon_exits.append({"pid": self.d.proc.pid, "rc": rc, "how": "SIGTERM (end of the night)"})
        report = subprocess.run([sys.executable, "-m", "supervisor.cli", "report", "--config", str(self.config),
                                 "--format", "text", "--since", "24h"], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        alerts = self._tally_alerts()
        self._teardown()
        leftovers = self.watch.leftovers()
        return self._results(reqs, res_end, foreign, alerts, leftovers, report)

    def _foreign_check(self) -> dict[str, Any]:
        if self.foreign is None:
            return {"started": False}
        alive = []
        changed = []
        transient = []  # a child of the server's own that came and went (not a part of it)
        for pid, (start, title) in self.foreign_tree.items():
            # the start since boot, not psutil's create time: a step of the wall clock moves
            # every create time (a CI run saw this server, still answering, read as gone)
            with contextlib.suppress(psutil.Error):
                if running(pid, start) and psutil.Process(pid).status() != psutil.STATUS_STOPPED:
                    alive.append(pid)
                    continue
            # The server (its main process and its sglang:: parts) must all be there; any other
            # child it started and ended (seen once while it started) is its own business, as
            # long as the daemon did not kill it (``killed_by_daemon``).
            (changed if pid == self.foreign.proc.pid or title.startswith("sglang::") else transient).append(pid)
        killed_by_daemon = sorted({pid for d in self.daemons for e in d.find("orphans_killed")
                                   for pid in e.get("pids") or [] if pid in self.foreign_tree})
        health = http_status(f"http://127.0.0.1:{self.foreign_port}/health")
        return {"started": True, "pid": self.foreign.proc.pid, "port": self.foreign_port,
                "processes_seen": len(self.foreign_tree), "alive_at_end": len(alive), "gone_or_changed": changed,
                "transient": {pid: self.foreign_tree[pid][1][:80] for pid in transient},
                "killed_by_daemon": killed_by_daemon, "health_at_end": health,
                "untouched": bool(self.foreign_tree) and not changed and not killed_by_daemon}

    def _tally_alerts(self) -> dict[str, Any]:
        logged: Counter[tuple[str, str, Any]] = Counter()
        for d in self.daemons:
            for e in read_events(d.log_path):
                if e.get("event") in ALERT_KINDS:
                    inst = f"soak-{e['server']}" if e.get("server") else "soak"
                    logged[(inst, ALERT_KINDS[e["event"]], e.get("attempt"))] += 1

        def received() -> tuple[Counter[tuple[str, str, Any]], int, int]:
            with self.sub._lock:
                msgs = list(self.sub.messages)
            seen: dict[str, dict[str, Any]] = {}
            total = 0
            for _, topic, payload in msgs:
                if "/event/" not in topic:
                    continue
                with contextlib.suppress(ValueError):
                    p = json.loads(payload)
                    total += 1
                    seen.setdefault(str(p.get("id")), p)
            keys = Counter((str(p.get("instance")), str(p.get("kind")), p.get("attempt")) for p in seen.values())
            return keys, total, len(seen)

        deadline = time.monotonic() + 30
        while True:
            keys, total, distinct = received()
            missing = logged - keys
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return {"logged": sum(logged.values()), "received": distinct, "lost": sum(missing.values()),
                "duplicates": total - distinct, "unexpected": sum((keys - logged).values()),
                "missing": [list(k) for k in missing.elements()][:20],
                "by_kind": dict(Counter(k[1] for k in logged.elements()))}

    def _teardown(self) -> None:
        if hasattr(self, "_foreign_timer"):
            self._foreign_timer.cancel()
            self._foreign_timer.join(60)
        self._unmount()
        for d in self.daemons:
            if d.proc.poll() is None:
                with contextlib.suppress(Exception):
                    d.stop()
        with contextlib.suppress(Exception):
            self.router.stop()
        with contextlib.suppress(Exception):
            self.sub.close()
        with contextlib.suppress(Exception):
            self.broker.stop()
        if self.foreign is not None:
            self.foreign.stop()
        self.watch.close()

    def abort(self) -> None:
        """Reap everything after a failure."""
        with contextlib.suppress(Exception):
            if hasattr(self, "clients"):
                self.clients.stop()
        self._teardown()
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.kill()
        for pid, (start, _, _) in list(self.watch.seen.items()):
            if still(pid, start):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def _results(self, reqs: list[Req], res_end: dict[str, Any], foreign: dict[str, Any], alerts: dict[str, Any],
                 leftovers: list[str], report: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        per_fault: list[dict[str, Any]] = []
        failed = [r for r in reqs if not r.ok]
        attributed: dict[int, list[Req]] = {i: [] for i in range(len(self.faults))}
        unattributed: list[Req] = []
        for r in failed:
            hits = [i for i, f in enumerate(self.faults) if f.kind != FOREIGN and r.t1 >= f.window()[0]
                    and r.t0 <= f.window()[1]]
            if hits:
                attributed[hits[-1]].append(r)
            else:
                unattributed.append(r)
        for i, f in enumerate(self.faults):
            lo, hi = f.window()
            in_window = [r for r in reqs if r.t1 >= lo and r.t0 <= hi]
            # the router is the clients' only door: while it is away (killed, listening again, the
            # daemon's next reconcile putting the servers back in) a request has nowhere to go
            away = 0
            if f.kind == "router_restart" and "router_up_mono" in f.detail:
                away_until = f.detail["router_up_mono"] + ROUTER_RECONCILE_S + 2.0
                away = sum(1 for r in attributed[i] if r.t1 <= away_until)
            per_fault.append({
                "n": i + 1, "kind": f.kind, "at_s": f.at_s, "target": f.target, "to_serving_s": f.to_serving_s,
                "requests_in_window": len(in_window), "failed": len(attributed[i]), "failed_router_away": away,
                "failures": Counter(r.error[:70] for r in attributed[i]).most_common(3),
                "detail": f.detail, "error": f.error,
            })
        incarnations = []
        for d in self.daemons:
            s = [x for x in self.watch.samples if x["pid"] == d.proc.pid]
            if not s:
                continue
            # the daemon's first launch loads the diagnosis's tables in a thread (its rules, the
            # catalogue's word index: ~2 MB, once; Daemon.warm_diagnosis), long before READY:
            # "warm" is the first sample 10 s after the first READY
            events = read_events(d.log_path)
            marks = [float(e["mono"]) for e in events if e.get("event") == "server_ready"][:1]
            warm = next((x for x in s if marks and x["t"] >= marks[0] + 10.0), None)
            incarnations.append({"pid": d.proc.pid, "first": s[0], "warm": warm, "last": s[-1], "samples": len(s),
                                 "rss_mb_every_30s": [round(x["rss_kb"] / 1024, 1) for x in s[::30]]})
        rss0 = self.res_start.get("rss_kb") or 0
        rss1 = res_end.get("rss_kb") or 0
        last = incarnations[-1] if incarnations else {}
        base = last.get("warm") or {}
        end = last.get("last") or {}
        warm_pct = (round(100.0 * (end["rss_kb"] - base["rss_kb"]) / base["rss_kb"], 2)
                    if base.get("rss_kb") and end.get("rss_kb") and end["t"] - base["t"] >= 30 else None)
        return {
            "seed": self.seed, "minutes": self.minutes, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "sglang": self.real.version, "model": self.real.model,
            "night_s": round(time.monotonic() - self.t_start, 1),
            "faults_by_kind": dict(Counter(f.kind for f in self.faults)),
            "faults": per_fault,
            "requests": {"total": len(reqs), "ok": len(reqs) - len(failed), "failed": len(failed),
                         "failed_in_hang_windows": sum(p["failed"] for p in per_fault if p["kind"] in MAY_FAIL),
                         "failed_router_away": sum(p["failed_router_away"] for p in per_fault),
                         "failed_in_other_windows": sum(p["failed"] - p["failed_router_away"] for p in per_fault
                                                        if p["kind"] not in MAY_FAIL),
                         "unattributed": len(unattributed),
                         "unattributed_examples": [asdict(r) for r in unattributed[:5]]},
            "alerts": alerts,
            "leftovers": leftovers,
            "foreign": foreign,
            "daemon": {"start": self.res_start, "end": res_end,
                       "rss_change_pct": round(100.0 * (rss1 - rss0) / rss0, 2) if rss0 else None,
                       "rss_warm_base": base, "rss_warm_change_pct": warm_pct,
                       "incarnations": incarnations, "exits": self.daemon_exits},
            "report": {"rc": report.returncode, "chars": len(report.stdout), "head": report.stdout[:400],
                       "stderr": report.stderr[-400:]},
        }


# --- the table ------------------------------------------------------------------------------------


def table(r: dict[str, Any]) -> str:
    out = [f"soak-real: seed {r['seed']}, {r['minutes']:g} min ({r['night_s']:.0f} s of night), SGLang {r['sglang']}",
           "", f"{'#':>3} {'fault':<20} {'at s':>7} {'target':<10} {'to serving s':>12} {'reqs':>6} {'failed':>6}  detail"]
    for f in r["faults"]:
        detail = {k: v for k, v in f["detail"].items() if k not in ("old_daemon",)}
        out.append(f"{f['n']:>3} {f['kind']:<20} {f['at_s']:>7.1f} {f['target']:<10} "
                   f"{f['to_serving_s'] if f['to_serving_s'] is not None else 'never':>12} "
                   f"{f['requests_in_window']:>6} {f['failed']:>6}  {json.dumps(detail)[:90]}"
                   + (f"  ERROR {f['error'][:120]}" if f["error"] else ""))
        for err, n in f["failures"]:
            out.append(f"{'':>36}{n} x {err}")
    q, a, d = r["requests"], r["alerts"], r["daemon"]
    out += ["", "faults by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults_by_kind"].items())),
            f"requests: {q['ok']} ok, {q['failed']} failed ({q['failed_in_hang_windows']} in hang windows, "
            f"{q['failed_router_away']} while the router was away, "
            f"{q['failed_in_other_windows']} in other fault windows, {q['unattributed']} outside any)",
            f"alerts: {a['logged']} logged, {a['received']} received, {a['lost']} lost, {a['duplicates']} duplicated",
            f"processes left: {len(r['leftovers'])} {r['leftovers'][:5]}",
            f"foreign server: {json.dumps(r['foreign'])}",
            f"daemon at start: {d['start']}", f"daemon at end:   {d['end']} (RSS {d['rss_change_pct']} % from the "
            f"start, {d['rss_warm_change_pct']} % from the warm sample {d['rss_warm_base']})",
            f"report: rc {r['report']['rc']}, {r['report']['chars']} chars"]
    return "\n".join(out)


def run_night(minutes: float, seed: int, tmp: Path, opening: tuple[str, ...] = ()) -> dict[str, Any]:
    real = load()
    night = Night(real, tmp, minutes, seed, opening)
    try:
        night.setup()
        night.run()
        return night.finish()
    except BaseException:
        night.abort()
        raise


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", "30")))
    ap.add_argument("--seed", type=int, default=int(os.environ["SOAK_SEED"]) if os.environ.get("SOAK_SEED") else None)
    ap.add_argument("--out", default=".soak/results.json")
    ap.add_argument("--keep", action="store_true", help="keep the night's directory (logs)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    say(f"SOAK_SEED={seed} SOAK_MINUTES={args.minutes:g}")
    tmp = Path(tempfile.mkdtemp(prefix="soak-real-"))
    results = run_night(args.minutes, seed, tmp)
    results["command"] = f"SOAK_SEED={seed} SOAK_MINUTES={args.minutes:g} make soak-real"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table(results))
    say(f"results in {out}; logs in {tmp}")
    return 0 if goals_met(results) == [] else 1


def goals_met(r: dict[str, Any]) -> list[str]:
    """The goals the test asserts; the list of those missed."""
    missed = []
    q = r["requests"]
    if q["ok"] == 0:
        missed.append("no request succeeded")
    if q["failed_in_other_windows"] or q["unattributed"]:
        missed.append(f"{q['failed_in_other_windows']} requests failed in non-hang fault windows, "
                      f"{q['unattributed']} outside any fault window")
    if any(f["error"] for f in r["faults"]):
        missed.append("a fault did not recover: " + "; ".join(f"{f['kind']}: {f['error'][:200]}"
                                                              for f in r["faults"] if f["error"]))
    if r["alerts"]["lost"] or r["alerts"]["duplicates"]:
        missed.append(f"alerts: {r['alerts']['lost']} lost, {r['alerts']['duplicates']} duplicated")
    if r["leftovers"]:
        missed.append(f"{len(r['leftovers'])} processes left: {r['leftovers'][:5]}")
    if r["foreign"].get("started") and not r["foreign"].get("untouched"):
        missed.append(f"the foreign server was touched: {r['foreign']}")
    pct = r["daemon"]["rss_warm_change_pct"]
    if pct is not None and abs(pct) > 5.0:
        missed.append(f"the daemon's RSS moved {pct} % (warm {r['daemon']['rss_warm_base']}, end {r['daemon']['end']})")
    return missed


if __name__ == "__main__":
    sys.exit(main())
