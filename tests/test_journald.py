"""journald's native protocol against a fake journal: a SOCK_DGRAM Unix socket in tmp whose
datagrams (and memfds) are parsed here as journald parses them.

The real journald: tests/systemd_real/test_unit_under_systemd.py (a booted systemd 252)."""

from __future__ import annotations

import array
import io
import json
import os
import socket
import struct
from pathlib import Path

import pytest

from supervisor.adapters.journald import JournalSocket, encode, stderr_is_journal
from supervisor.core import events as ev
from supervisor.core.model import Cause
from supervisor.sinks import logs

Entry = dict[str, str]


def parse(data: bytes) -> Entry:
    """One native-protocol datagram as journald reads it (``KEY=value\\n``, or ``KEY\\n`` +
    a 64-bit little-endian length + the bytes + ``\\n``)."""
    out: Entry = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            out[key.decode()] = value.decode()
            i = nl + 1
        else:
            (size,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            start = nl + 9
            out[line.decode()] = data[start:start + size].decode()
            assert data[start + size:start + size + 1] == b"\n"
            i = start + size + 1
    return out


class FakeJournal:
    """journald's end of /run/systemd/journal/socket, bound at a path in tmp."""

    def __init__(self, path: Path, rcvbuf: int | None = None) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

    def entries(self) -> list[Entry]:
        """Every entry queued so far (a passed memfd read as journald reads it)."""
        out = []
        while True:
            fds = array.array("i")
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(fds.itemsize))
            except BlockingIOError:
                return out
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if fds:
                assert data == b"", "journald reads a passed fd only from an empty datagram"
                try:  # from offset 0, as journald maps it (the sender's offset is at the end)
                    data = os.pread(fds[0], os.fstat(fds[0]).st_size, 0)
                finally:
                    os.close(fds[0])
            out.append(parse(data))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def journal(tmp_path):
    fake = FakeJournal(tmp_path / "journal.sock")
    yield fake
    fake.close()


def test_stderr_is_journal_only_when_journal_stream_names_that_fd(tmp_path):
    with (tmp_path / "stream").open("w") as f, (tmp_path / "other").open("w") as g:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stderr_is_journal(env, f.fileno())
        assert not stderr_is_journal(env, g.fileno())  # stderr redirected elsewhere
    assert not stderr_is_journal({}, 2)
    assert not stderr_is_journal({"JOURNAL_STREAM": "garbage"}, 2)
    assert not stderr_is_journal({"JOURNAL_STREAM": "1:x"}, 2)
    assert JournalSocket.from_env({}) is None


def test_multi_line_values_are_binary_safe_and_bad_keys_are_left_out():
    data = encode({"MESSAGE": "line one\nline two=x", "PRIORITY": "3", "bad key": "x", "_PID": "1"})
    assert parse(data) == {"MESSAGE": "line one\nline two=x", "PRIORITY": "3"}
    assert data.startswith(b"MESSAGE\n" + struct.pack("<Q", len("line one\nline two=x")))


def test_an_entry_goes_out_as_one_datagram(journal):
    sender = JournalSocket(journal.path)
    assert sender.send({"MESSAGE": "hello", "PRIORITY": "6", "SGLANG_SUPERVISOR_EVENT": "x"})
    assert journal.entries() == [{"MESSAGE": "hello", "PRIORITY": "6", "SGLANG_SUPERVISOR_EVENT": "x"}]
    sender.close()


def test_an_entry_too_big_for_a_datagram_goes_as_a_sealed_memfd(journal):
    big = "x" * (4 << 20)  # far over a datagram's limit (the socket's send buffer)
    sender = JournalSocket(journal.path)
    assert sender.send({"MESSAGE": big, "PRIORITY": "3"})
    assert journal.entries() == [{"MESSAGE": big, "PRIORITY": "3"}]
    sender.close()


def test_no_socket_is_a_false_send_not_an_exception(tmp_path):
    sender = JournalSocket(str(tmp_path / "nobody-here.sock"))
    assert sender.send({"MESSAGE": "lost?"}) is False
    assert sender.send({"MESSAGE": "still no"}) is False


def configured(journal_port, stream, server="kimi"):
    return logs.configure("json", "debug", stream, journal=journal_port, server=server)


def gave_up(**kw) -> ev.GaveUp:
    return ev.GaveUp(reason="the model cannot be loaded", cause=Cause.MODEL_LOAD_ERROR, mem_fraction_static=0.88,
                     restarts=1, crashes=0, instance="kimi", **kw)


def test_a_give_up_is_crit_with_its_event_server_and_cause_as_fields(journal):
    stream = io.StringIO()
    sink = logs.LogSink(configured(JournalSocket(journal.path), stream))
    sink.emit(gave_up())
    (entry,) = journal.entries()
    assert entry["PRIORITY"] == "2"  # journalctl -p err shows it (crit <= err)
    assert entry["SYSLOG_IDENTIFIER"] == "sglang-supervisor"
    assert entry["SGLANG_SUPERVISOR_EVENT"] == "gave_up"
    assert entry["SGLANG_SUPERVISOR_CAUSE"] == "model_load_error"
    assert entry["SGLANG_SUPERVISOR_SERVER"] == "kimi"  # a single [server]: the default name
    assert entry["SGLANG_SUPERVISOR_INSTANCE"] == "kimi"
    line = json.loads(entry["MESSAGE"])  # the message is the JSON line, as on stderr: -o cat | jq works
    assert line["event"] == "gave_up" and line["level"] == "critical" and line["cause"] == "model_load_error"
    assert stream.getvalue() == ""


def test_levels_map_to_syslog_priorities_and_a_bound_server_wins(journal):
    log = configured(JournalSocket(journal.path), io.StringIO())
    tp4a = log.bind(server="tp4-a")
    tp4a.debug("probe")
    tp4a.info("launch")
    log.warning("headroom_low")
    tp4a.error("crash", cause="cuda_oom_runtime")
    log.critical("gave_up")
    got = [(e["SGLANG_SUPERVISOR_EVENT"], e["PRIORITY"], e["SGLANG_SUPERVISOR_SERVER"]) for e in journal.entries()]
    assert got == [("probe", "7", "tp4-a"), ("launch", "6", "tp4-a"), ("headroom_low", "4", "kimi"),
                   ("crash", "3", "tp4-a"), ("gave_up", "2", "kimi")]


def test_secrets_stay_out_of_the_journal_entry(journal):
    sink = logs.LogSink(configured(JournalSocket(journal.path), io.StringIO()))
    sink.emit(ev.ServerLaunched(argv=("sglang", "--api-key", "s3cr3t", "--hf-token=hf_abc"), mem_fraction_static=0.9,
                                hicache_size_gb=None, attempt=1, pid=1, rung=0, launch_id="l1"))
    (entry,) = journal.entries()
    raw = repr(entry)
    assert "s3cr3t" not in raw and "hf_abc" not in raw
    assert json.loads(entry["MESSAGE"])["argv"] == ["sglang", "--api-key", "***", "--hf-token=***"]


def test_a_traceback_reaches_the_journal_whole(journal):
    log = configured(JournalSocket(journal.path), io.StringIO())
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("task_failed")
    (entry,) = journal.entries()
    assert entry["PRIORITY"] == "3"
    assert "RuntimeError: boom" in json.loads(entry["MESSAGE"])["exception"]


def test_without_the_socket_every_line_goes_to_stderr_with_its_priority_prefix(tmp_path):
    stream = io.StringIO()
    sink = logs.LogSink(configured(JournalSocket(str(tmp_path / "gone.sock")), stream))
    sink.emit(gave_up())
    sink.emit(ev.ServerLaunched(argv=("sglang",), mem_fraction_static=0.9, hicache_size_gb=None, attempt=1, pid=1,
                                rung=0, launch_id="l1"))
    lines = stream.getvalue().splitlines()
    assert [line[:3] for line in lines] == ["<2>", "<6>"]
    assert [json.loads(line[3:])["event"] for line in lines] == ["gave_up", "launch"]


def test_a_full_journal_queue_loses_no_line(tmp_path):
    """journald not reading: the non-blocking send fails (EAGAIN) and the line goes to
    stderr; every line is in one place or the other, none blocked the caller."""
    fake = FakeJournal(tmp_path / "slow.sock", rcvbuf=4096)
    stream = io.StringIO()
    log = configured(JournalSocket(fake.path), stream)
    total = 2000
    for i in range(total):
        log.info("probe", n=i)
    fallen = [json.loads(line[3:])["n"] for line in stream.getvalue().splitlines()]
    sent = [json.loads(e["MESSAGE"])["n"] for e in fake.entries()]
    fake.close()
    assert fallen, "the queue never filled: the test did not test the fallback"
    assert sorted(sent + fallen) == list(range(total))
