"""The chaos matrix's machinery: one trial = one fault against a real daemon, fully accounted.

A ``Trial`` writes a fast config (``harness.write_config``) with ``[mqtt]`` pointed at a real
mosquitto, starts daemons as subprocesses, and at the end checks what every trial must
show whatever the fault: each daemon stopped with exit 0, every alert the daemon logged
arrived on the broker exactly once (by ``id``; duplicates are counted), never two servers on
the port, and no process of the trial left (running or zombie). ``chaos_trial`` records the
outcome as one JSON line in the file named by ``CHAOS_RESULTS`` (``tests/chaos/report.py``
renders them into docs/reliability.md).

Imported by the chaos tests as ``chaoslib`` (pytest puts tests/chaos on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from harness import DaemonHung, DaemonRun, ProcessWatch, overdue_line, write_config

from supervisor.core.events import ALERT_KINDS
from tests.leftovers import append_line

TRIALS = int(os.environ.get("CHAOS_TRIALS", "2"))
RESULTS_ENV = "CHAOS_RESULTS"
TOPIC_PREFIX = "chaos"


# --- results -------------------------------------------------------------------------------


def record_result(record: dict[str, Any]) -> None:
    """Append one JSON line to ``$CHAOS_RESULTS`` (nothing when it is unset)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    append_line(path, json.dumps(record, default=str))  # whole lines, with pytest-xdist workers appending too


# --- the JSON log, read incrementally -------------------------------------------------------


class LogFollower:
    """Reads a daemon's JSON-lines log incrementally (the soak's log grows to megabytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """The events appended since the last poll (also kept in ``events``)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.events += new
        return new


# --- MQTT: a subscriber in a thread of its own ----------------------------------------------


class Subscriber:
    """A paho subscriber on ``{prefix}/#`` with a persistent session (the broker keeps its
    QoS 1 messages while either side is away) that reconnects by itself and records every
    message with its arrival time (monotonic)."""

    def __init__(self, host: str, port: int, topic: str = f"{TOPIC_PREFIX}/#") -> None:
        import paho.mqtt.client as mqtt

        self.topic = topic
        self.messages: list[tuple[float, str, bytes]] = []
        self.subscribed = threading.Event()
        self._lock = threading.Lock()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"chaos-sub-{uuid.uuid4().hex[:8]}", clean_session=False
        )
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.1, 1)
        self.client.connect_async(host, port, keepalive=5)
        self.client.loop_start()
        if not self.subscribed.wait(30):
            self.close()
            raise AssertionError(f"the chaos subscriber could not subscribe on {host}:{port}")

    def _on_connect(self, client: Any, _userdata: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if not reason.is_failure:
            client.subscribe(self.topic, qos=1)

    def _on_message(self, _client: Any, _userdata: Any, msg: Any) -> None:
        with self._lock:
            self.messages.append((time.monotonic(), str(msg.topic), bytes(msg.payload)))

    def alerts(self, instance: str) -> list[tuple[float, dict[str, Any]]]:
        """(arrival, payload) of the alert events of one instance."""
        with self._lock:
            msgs = list(self.messages)
        out = []
        for at, topic, payload in msgs:
            if f"/{instance}/event/" not in topic:
                continue
            with contextlib.suppress(ValueError):
                out.append((at, json.loads(payload)))
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@dataclass(frozen=True, slots=True)
class AlertTally:
    """Alerts the daemon logged against the ones the broker delivered."""

    logged: int
    received: int  # distinct ids
    lost: int
    duplicates: int
    last_arrival: float | None  # monotonic arrival of the last distinct alert


def _alert_key(kind: str, fields: dict[str, Any]) -> tuple[str, Any]:
    return kind, fields.get("attempt")


def tally_alerts(events: list[dict[str, Any]], sub: Subscriber, instance: str, timeout: float = 30.0) -> AlertTally:
    """Wait (with a deadline) until every alert event in ``events`` arrived; count the rest."""
    logged = Counter(_alert_key(ALERT_KINDS[e["event"]], e) for e in events if e.get("event") in ALERT_KINDS)

    def received() -> tuple[Counter[tuple[str, Any]], int, float | None]:
        seen: dict[str, tuple[float, dict[str, Any]]] = {}
        total = 0
        for at, payload in sub.alerts(instance):
            total += 1
            seen.setdefault(str(payload.get("id")), (at, payload))
        keys = Counter(_alert_key(p["kind"], p) for _, p in seen.values())
        last = max((at for at, _ in seen.values()), default=None)
        return keys, total - len(seen), last

    deadline = time.monotonic() + timeout
    while True:
        keys, dups, last = received()
        missing = logged - keys
        if not missing or time.monotonic() > deadline:
            return AlertTally(sum(logged.values()), sum(keys.values()), sum(missing.values()), dups, last)
        time.sleep(0.1)


# --- filesystems that are full ----------------------------------------------------------------


@contextlib.contextmanager
def full_tmpfs(path: Path, size_kb: int = 256) -> Iterator[bool]:
    """Mount a small tmpfs on ``path`` (True) or yield False where mounting is not allowed.
    Fill it with ``fill`` when the test wants it full; unmounted (lazily if busy) on exit."""
    path.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    try:
        if mount is None or os.environ.get("CHAOS_NO_MOUNT"):  # CHAOS_NO_MOUNT=1 tries the fallbacks
            raise OSError("no mount binary")
        subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_kb}k", "chaos-tmpfs", str(path)],
                       check=True, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        yield False
        return
    try:
        yield True
    finally:
        umount = shutil.which("umount") or "umount"
        if subprocess.run([umount, str(path)], capture_output=True, timeout=20).returncode != 0:
            subprocess.run([umount, "-l", str(path)], capture_output=True, timeout=20)


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem says ENOSPC; returns the file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = b"\0" * 4096
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
    return filler


# --- one trial ------------------------------------------------------------------------------


@dataclass
class Trial:
    """One fault, once: its config, its daemons, its measurements."""

    fault: str
    index: int
    tmp: Path
    broker: Any  # tests.mosquitto.Broker
    sub: Subscriber
    instance: str = ""
    cfg: Path | None = None
    port: int = 0
    watch: ProcessWatch | None = None
    daemons: list[DaemonRun] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)  # daemons we SIGKILLed on purpose
    recover_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tally: AlertTally | None = None

    @property
    def gpus(self) -> Path:
        return self.tmp / "gpus"

    def configure(self, sections: dict[str, dict[str, Any]] | None = None, sim_args: tuple[str, ...] = ()) -> Path:
        """Write the trial's config: the harness defaults, MQTT on, then ``sections``."""
        import tomllib

        self.instance = f"{self.fault}-{self.index}-{uuid.uuid4().hex[:6]}"
        base: dict[str, dict[str, Any]] = {
            "policy": {"max_crashes": 50},
            "mqtt": {
                "enabled": True, "host": self.broker.host, "port": self.broker.port,
                "topic_prefix": TOPIC_PREFIX, "instance": self.instance, "keepalive_s": 5,
                "connect_timeout_s": 5.0, "reconnect_initial_s": 0.2, "reconnect_max_s": 1.0,
            },
        }
        for section, keys in (sections or {}).items():
            base.setdefault(section, {}).update(keys)
        self.cfg = write_config(self.tmp, base, sim_args=sim_args)
        self.port = int(tomllib.loads(self.cfg.read_text())["server"]["port"])
        self.watch = ProcessWatch(self.port, gpu_dir=self.gpus)
        return self.cfg

    def start(self, *extra: str, env: dict[str, str] | None = None) -> DaemonRun:
        """Start a daemon on the trial's config (each run logs to a file of its own)."""
        assert self.cfg is not None and self.watch is not None
        d = DaemonRun(self.cfg, *extra, env=env)
        self.watch.add_root(d.proc.pid)
        self.daemons.append(d)
        return d

    def kill(self, d: DaemonRun) -> float:
        """SIGKILL a daemon (after its logged alerts reached the broker); returns when."""
        self.tally_now(d)
        d.kill()
        self.killed.add(d.proc.pid)
        return time.monotonic()

    def tally_now(self, d: DaemonRun) -> AlertTally:
        return tally_alerts(d.events(), self.sub, self.instance)

    def server_pid(self, d: DaemonRun, attempt: int = 1) -> int:
        return int(d.wait_for("launch", attempt=attempt)["pid"])

    def signal_server(self, d: DaemonRun, sig: int, attempt: int = 1, group: bool = False) -> float:
        """Send ``sig`` to the server of launch ``attempt`` (its group with ``group``)."""
        pid = self.server_pid(d, attempt)
        (os.killpg if group else os.kill)(pid, sig)
        return time.monotonic()

    def finish(self) -> list[str]:
        """Stop every daemon, account for alerts, servers and processes; returns problems."""
        problems: list[str] = []
        for d in self.daemons:
            if d.proc.pid in self.killed:
                continue
            asked = time.monotonic()
            try:
                code = d.stop()
                self.extra["stop_s"] = round(max(self.extra.get("stop_s", 0.0), time.monotonic() - asked), 3)
            except DaemonHung as exc:  # SIGKILLed with its group; the trial fails with its pending tasks
                problems.append(str(exc))
                continue
            if code != 0:
                problems.append(f"daemon {d.proc.pid} exited {code}")
                said = overdue_line(d.log_path)
                if said:
                    problems.append(said)
        events = [e for d in self.daemons for e in d.events()]
        for bad in ("task_failed", "prepare_failed", "sink_failed", "alert_emit_failed"):
            if any(e.get("event") == bad for e in events):
                problems.append(f"the daemon logged {bad}")
        self.tally = tally_alerts(events, self.sub, self.instance)
        if self.tally.lost:
            problems.append(f"{self.tally.lost} of {self.tally.logged} alerts never arrived")
        if self.watch is not None:
            servers = self.watch.close()
            self.extra["max_servers"] = servers
            if servers > 1:
                problems.append(f"{servers} servers ran at the same time on port {self.port}")
            try:
                wait_until(lambda: not self.watch.leftovers(), timeout=15.0, what="no leftover processes")
            except AssertionError:
                left = self.watch.leftovers()
                self.extra["leftovers"] = left
                problems.append(f"leftover processes: {left}")
                _kill_all(left)
        return problems


def _kill_all(described: list[str]) -> None:
    for text in described:
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.kill(int(text.split()[0]), signal.SIGKILL)


@contextlib.contextmanager
def chaos_trial(fault: Any, index: int, tmp: Path, broker: Any, sub: Subscriber) -> Iterator[Trial]:
    """Run one trial of ``fault`` (a ``Fault``): yields the ``Trial``; checks and records it."""
    t = Trial(fault.name, index, tmp, broker, sub)
    started = time.monotonic()
    error: str | None = None
    try:
        yield t
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        try:
            problems = t.finish()
        except Exception as exc:  # noqa: BLE001 - the record must be written whatever broke
            problems = [f"the trial's cleanup failed: {exc!r}"[:500]]
        if error is None and problems:
            error = "; ".join(problems)
        record_result({
            "kind": "trial", "fault": fault.name, "title": fault.title, "side": fault.side,
            "promise": fault.promise, "recover_from": fault.recover_from, "trial": index,
            "ok": error is None, "error": error, "recover_s": t.recover_s,
            "alerts_logged": t.tally.logged if t.tally else None,
            "alerts_received": t.tally.received if t.tally else None,
            "alerts_lost": t.tally.lost if t.tally else None,
            "alert_duplicates": t.tally.duplicates if t.tally else None,
            "orphans": len(t.extra.get("leftovers", [])), "max_servers": t.extra.get("max_servers"),
            "extra": {k: v for k, v in t.extra.items() if k not in ("leftovers", "max_servers")},
            "duration_s": round(time.monotonic() - started, 2),
        })
    if problems:
        raise AssertionError("; ".join(problems))


@dataclass(frozen=True)
class Fault:
    """One row of the matrix: what is done, what the policy promises, how it is run."""

    name: str
    title: str
    side: str  # "sglang" | "ours"
    promise: str
    recover_from: str  # what the recovery time is measured from
    run: Callable[[Trial], None]


def gap(d: DaemonRun, first: dict[str, Any], event: str, **match: Any) -> tuple[dict[str, Any], float]:
    """The first ``event`` (matching) logged after ``first``, and the seconds between them."""
    later = _wait_after(d, first, event, **match)
    return later, round(float(later["mono"]) - float(first["mono"]), 3)


def _wait_after(d: DaemonRun, first: dict[str, Any], event: str, timeout: float = 45.0, **match: Any) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((e for e in d.find(event, **match) if float(e["mono"]) > float(first["mono"])), None)

    return wait_until(found, timeout=timeout, interval=0.05, what=f"{event} {match} after {first.get('event')}")


def after(d: DaemonRun, t0: float, event: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
    """The first ``event`` (matching) logged after monotonic time ``t0`` (same clock)."""
    return _wait_after(d, {"mono": t0, "event": f"t={t0:.3f}"}, event, timeout=timeout, **match)


# --- fixtures shared by the chaos modules (imported into them) -------------------------------


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real mosquitto with persistence (it can be stopped and started on the same port)."""
    from tests.mosquitto import Broker

    b = Broker(tmp_path_factory.mktemp("broker"), persistent=True)
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def subscriber(broker: Any) -> Iterator[Subscriber]:
    """A subscriber on ``chaos/#`` for the whole module."""
    sub = Subscriber(broker.host, broker.port)
    try:
        yield sub
    finally:
        sub.close()
