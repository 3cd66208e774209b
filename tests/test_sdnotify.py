"""sd_notify against a real AF_UNIX datagram socket that plays systemd's side."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from conftest import wait_until

from supervisor.adapters.sdnotify import STATUS_MAX_CHARS, Notifier
from supervisor.daemon import watchdog_loop

Message = dict[str, str]


class NotifyListener:
    """systemd's end of NOTIFY_SOCKET: a bound datagram socket drained by a thread."""

    def __init__(self, address: str) -> None:
        """``address`` is what goes into NOTIFY_SOCKET: a path or ``@abstract-name``."""
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self._sock.settimeout(0.05)
        self._lock = threading.Lock()
        self._received: list[tuple[float, Message]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="notify-listener", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self._received.append((time.monotonic(), fields))

    @property
    def messages(self) -> list[Message]:
        """Every message so far, oldest first."""
        with self._lock:
            return [m for _, m in self._received]

    def timed(self) -> list[tuple[float, Message]]:
        """Every message so far with its arrival time (monotonic)."""
        with self._lock:
            return list(self._received)

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float = 20.0,
                 what: str = "a notify message", after: int = 0) -> Message:
        """The first message (from index ``after`` on) satisfying ``predicate``, within ``timeout``."""
        def found() -> Message | None:
            return next((m for m in self.messages[after:] if predicate(m)), None)

        return wait_until(found, timeout=timeout, what=what)

    def close(self) -> None:
        """Stop the thread and close the socket (and remove a path socket)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        if not self.address.startswith("@"):
            Path(self.address).unlink(missing_ok=True)


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NotifyListener]:
    """A listener on a path socket in tmp_path, or on an abstract ``@`` socket."""
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
    else:
        address = f"@sglang-supervisor-test-{uuid.uuid4().hex}"
    lst = NotifyListener(address)
    yield lst
    lst.close()


@pytest.fixture
def notifier(listener: NotifyListener) -> Iterator[Notifier]:
    """A notifier built from an environment that points at the listener."""
    n = Notifier.from_env({"NOTIFY_SOCKET": listener.address})
    yield n
    n.close()


def test_ready_reaches_the_socket(listener: NotifyListener, notifier: Notifier) -> None:
    """ready() sends READY=1, with a STATUS line in the same datagram when given."""
    assert notifier.ready("STARTING fraction=0.93 restarts=0")
    msg = listener.wait_for(lambda m: "READY" in m, what="READY=1")
    assert msg == {"READY": "1", "STATUS": "STARTING fraction=0.93 restarts=0"}


def test_status_is_one_bounded_line_sent_on_change(listener: NotifyListener, notifier: Notifier) -> None:
    """status() flattens newlines, bounds the length and does not resend unchanged text."""
    notifier.status("READY fraction=0.88\nrestarts=1\r\nlast=cuda_oom_runtime")
    notifier.status("READY fraction=0.88 restarts=1 last=cuda_oom_runtime")  # same line: not resent
    notifier.status("x" * 5000)
    notifier.ready()  # a marker: everything before it has arrived once it has
    listener.wait_for(lambda m: m.get("READY") == "1", what="marker")
    statuses = [m["STATUS"] for m in listener.messages if "STATUS" in m]
    assert statuses[0] == "READY fraction=0.88 restarts=1 last=cuda_oom_runtime"
    assert len(statuses) == 2
    assert len(statuses[1]) == STATUS_MAX_CHARS and statuses[1].endswith("...")


def test_stopping_reloading_and_extend_timeout(listener: NotifyListener, notifier: Notifier) -> None:
    """STOPPING=1, RELOADING=1 with a current MONOTONIC_USEC, and EXTEND_TIMEOUT_USEC arrive as sent."""
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.ready()
    notifier.extend_timeout(90_000_000)
    notifier.stopping("STOPPING reason=sigterm")
    listener.wait_for(lambda m: "STOPPING" in m, what="STOPPING=1")
    reload_msg, ready_msg, extend_msg, stop_msg = listener.messages
    assert reload_msg["RELOADING"] == "1"
    assert before <= int(reload_msg["MONOTONIC_USEC"]) <= after
    assert ready_msg == {"READY": "1"}
    assert extend_msg == {"EXTEND_TIMEOUT_USEC": "90000000"}
    assert stop_msg == {"STOPPING": "1", "STATUS": "STOPPING reason=sigterm"}


class SpanOver(Exception):
    """Raised by SimulatedClock.sleep when the simulated span is over: it ends watchdog_loop."""


class SimulatedClock:
    """Time that moves only when watchdog_loop sleeps; ``sleep`` is what the loop is given.

    Before the clock moves on, ``settle`` (if set) is awaited: the test uses it to let the
    listener thread take each datagram, so no ping is dropped by a full receive queue
    (``net.unix.max_dgram_qlen`` is 10 on many hosts). Real time only bounds that wait; it
    never decides a count or a spacing.
    """

    def __init__(self, span_s: float) -> None:
        self.now = 0.0
        self.span_s = span_s
        self.sleeps: list[float] = []
        self.settle: Callable[[], Awaitable[None]] | None = None

    async def sleep(self, seconds: float) -> None:
        if self.settle is not None:
            await self.settle()
        self.sleeps.append(seconds)
        self.now += seconds
        if self.now >= self.span_s:
            raise SpanOver


class ClockedNotifier(Notifier):
    """A real notifier that also notes the simulated time of each WATCHDOG=1 and whether it went out."""

    def __init__(self, address: str, *, watchdog_usec: int, clock: SimulatedClock) -> None:
        super().__init__(address, watchdog_usec=watchdog_usec)
        self.clock = clock
        self.pings: list[tuple[float, bool]] = []

    def watchdog(self) -> bool:
        sent = super().watchdog()
        self.pings.append((self.clock.now, sent))
        return sent


def _watchdog_messages(listener: NotifyListener) -> list[Message]:
    return [m for m in listener.messages if "WATCHDOG" in m]


async def _run_simulated(listener: NotifyListener, span_s: float, alive: Callable[[SimulatedClock], bool] | None = None
                         ) -> ClockedNotifier:
    """watchdog_loop with WATCHDOG_USEC=0.5 s over ``span_s`` simulated seconds, pinging the real listener."""
    clock = SimulatedClock(span_s)
    notifier = ClockedNotifier(listener.address, watchdog_usec=500_000, clock=clock)

    async def settle() -> None:  # every ping sent so far has reached systemd's end
        deadline = time.monotonic() + 20.0
        while len(_watchdog_messages(listener)) < len(notifier.pings):
            assert time.monotonic() < deadline, "a WATCHDOG=1 datagram never reached the listener"
            await asyncio.sleep(0.001)

    clock.settle = settle
    interval = notifier.watchdog_interval()
    assert interval == 0.25  # WATCHDOG_USEC / 2, exactly (a binary fraction: sums stay exact)
    with pytest.raises(SpanOver):
        await watchdog_loop(notifier, interval, None if alive is None else lambda: alive(clock), sleep=clock.sleep)
    notifier.close()
    return notifier


async def test_watchdog_loop_pings_every_half_watchdog_usec(listener: NotifyListener) -> None:
    """Over a simulated minute with WATCHDOG_USEC=0.5 s: exactly 240 pings, one at t=0 and then every 0.25 s.

    Deterministic: the loop's ``sleep`` is a simulated clock's, so the count and the spacing
    are exact, not a fraction of what a real second allowed. Every ping also goes through the
    real socket and arrives, in order.
    """
    notifier = await _run_simulated(listener, 60.0)
    times = [t for t, _ in notifier.pings]
    assert times == [i * 0.25 for i in range(240)]
    assert {b - a for a, b in zip(times, times[1:], strict=False)} == {0.25}
    assert all(sent for _, sent in notifier.pings)
    assert notifier.clock.sleeps == [0.25] * 240
    assert _watchdog_messages(listener) == [{"WATCHDOG": "1"}] * 240
    assert listener.messages == _watchdog_messages(listener)


async def test_watchdog_loop_withholds_exactly_the_pings_while_not_alive(listener: NotifyListener) -> None:
    """alive() False for simulated t in [2 s, 4 s): those 8 pings are withheld, the pace around them is unchanged."""
    notifier = await _run_simulated(listener, 6.0, alive=lambda clock: not 2.0 <= clock.now < 4.0)
    assert [t for t, _ in notifier.pings] == [i * 0.25 for i in range(24) if not 8 <= i < 16]
    assert notifier.clock.sleeps == [0.25] * 24  # the loop keeps turning while it withholds
    assert _watchdog_messages(listener) == [{"WATCHDOG": "1"}] * 16


async def test_watchdog_loop_withholds_pings_while_not_alive(listener: NotifyListener, notifier: Notifier) -> None:
    """With alive() False no WATCHDOG=1 is sent; pings resume once it turns True."""
    alive = False
    task = asyncio.create_task(watchdog_loop(notifier, 0.02, alive=lambda: alive))
    await asyncio.sleep(0.3)  # the loop turns ~15 times while not alive
    notifier.ready()  # marker
    await asyncio.to_thread(listener.wait_for, lambda m: "READY" in m, 20.0, "marker")
    assert not [m for m in listener.messages if "WATCHDOG" in m]
    alive = True
    await asyncio.to_thread(listener.wait_for, lambda m: "WATCHDOG" in m, 20.0, "a ping once alive")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watchdog_loop_rejects_a_non_positive_interval() -> None:
    """An interval of 0 is a configuration bug, not a busy loop."""
    with pytest.raises(ValueError):
        await watchdog_loop(Notifier(None), 0)


def test_without_notify_socket_everything_is_a_noop(listener: NotifyListener) -> None:
    """No NOTIFY_SOCKET: disabled, no watchdog, every call succeeds and nothing is sent."""
    n = Notifier.from_env({"WATCHDOG_USEC": "200000"})
    assert not n.enabled
    assert n.watchdog_interval() is None
    assert all([n.ready("x"), n.status("y"), n.watchdog(), n.reloading(), n.extend_timeout(1), n.stopping()])
    probe = Notifier.from_env({"NOTIFY_SOCKET": listener.address})
    probe.ready()  # the listener works, and it received only this
    listener.wait_for(lambda m: "READY" in m)
    assert listener.messages == [{"READY": "1"}]
    probe.close()


@pytest.mark.parametrize("address", ["/nonexistent/dir/notify.sock", "@sglang-supervisor-nobody-listens"])
def test_unreachable_socket_never_raises_and_logs_once(address: str, caplog: pytest.LogCaptureFixture) -> None:
    """A socket nobody listens on: calls return False, never raise, and one warning is logged."""
    n = Notifier.from_env({"NOTIFY_SOCKET": address})
    with caplog.at_level(logging.WARNING, logger="supervisor.adapters.sdnotify"):
        results = [n.ready(), n.status("a"), n.watchdog(), n.stopping()]
    assert results == [False, False, False, False]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_full_receive_queue_drops_instead_of_blocking(tmp_path: Path) -> None:
    """A receiver that never reads fills up: sends then fail fast instead of blocking the loop."""
    path = str(tmp_path / "full.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(path)
        n = Notifier.from_env({"NOTIFY_SOCKET": path})
        results = [n.watchdog() for _ in range(2000)]
        n.close()
    assert results[0] is True
    assert False in results


@pytest.mark.parametrize("value", ["vsock:2:1234", "relative/notify.sock", "@"])
def test_unsupported_notify_socket_disables_quietly(value: str) -> None:
    """A NOTIFY_SOCKET that is neither a path nor an abstract name disables notifications."""
    n = Notifier.from_env({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "200000"})
    assert not n.enabled
    assert n.ready() and n.watchdog_interval() is None


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "200000"}, 0.1),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}, 0.1),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "not-a-pid"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_the_period_for_our_pid_only(env: dict[str, str], expected: float | None) -> None:
    """WATCHDOG_USEC/2 in seconds, only when WATCHDOG_PID is unset or names this process."""
    n = Notifier.from_env({"NOTIFY_SOCKET": "/run/unused.sock", **env})
    assert n.watchdog_interval() == (pytest.approx(expected) if expected is not None else None)
