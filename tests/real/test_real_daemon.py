"""The daemon owning a real SGLang 0.5.23 on this CPU, through its normal config.

The night (tests/real/nights.py) runs once for the module on one daemon; the tests below
each check one scenario of it. Further tests run their own short daemons (bad flag,
missing model, KV-pool failure, injected exception, a foreign server on the port). Real
servers run one at a time (the host-wide lock) and everything started is reaped.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor.core.argv import redact_argv
from tests.harness import DaemonRun
from tests.real import nights

real_config = nights.real_config


def crash(night: nights.Night, i: int) -> dict:
    assert len(night.crashes) > i, f"only {len(night.crashes)} crashes: {night.crashes}"
    return night.crashes[i]


def test_start_to_ready_with_the_startup_facts_read_from_the_real_lines(night: nights.Night) -> None:
    """The first launch reaches READY; the facts come from SGLang's own lines, including the
    fraction SGLang chose (the config sets none) and the KV pool's size."""
    facts = [e for e in night.events if e.get("event") == "startup_facts"]
    assert facts, "no startup_facts event"
    assert facts[0]["max_total_num_tokens"] and facts[0]["max_total_num_tokens"] > 0
    learned = [e for e in night.events if e.get("event") == "fraction_learned"]
    assert learned and 0 < learned[0]["mem_fraction_static"] < 1
    first = next(e for e in night.events if e.get("event") == "launch")
    assert "--mem-fraction-static" not in first["argv"]
    assert night.states[:3] == ["PREPARING", "STARTING", "READY"]


def test_sigkilled_scheduler_is_noticed_read_as_other_and_relaunched(night: nights.Night) -> None:
    """A scheduler SIGKILLed from outside with no OOM-killer record: noticed through the
    scheduler's own death (not when SGLang's main process ends after its diagnostics; how
    soon is measured in bench/bench_real.py), read as `other` with the evidence, relaunched
    and READY again, no process of the old tree left."""
    c = crash(night, 0)
    assert c["cause"] == "other", c
    assert "SIGKILL" in " ".join(c["evidence"]) and "no OOM-killer record" in " ".join(c["evidence"]), c
    assert c["part_died"] and c["part_died"].startswith("sglang::scheduler")
    downs = [e for e in night.events if e.get("event") == "server_down"]
    assert downs[0]["title"].startswith("sglang::scheduler"), downs[0]
    assert night.leftovers["sigkill"] == []


def test_sigkilled_scheduler_with_a_cgroup_oom_kill_record_is_host_oom(night: nights.Night) -> None:
    """The same death with the cgroup's memory.events oom_kill raised while it ran is host_oom."""
    c = crash(night, 1)
    assert c["cause"] == "host_oom", c
    assert any("oom_kill" in line for line in c["evidence"]), c
    assert night.leftovers["oom"] == []


def test_planned_restart_drains_requests_in_flight(night: nights.Night) -> None:
    """`sglang-supervisor restart` with 4 requests in flight: all finish with 200, READY again."""
    assert night.results["restart"] and len(night.results["restart"]) == nights.IN_FLIGHT
    assert night.failed["restart"] == 0, night.results["restart"]
    assert "ready again" in night.restart_output
    restarts = [e for e in night.events if e.get("event") == "restart_scheduled" and e.get("cause") == "operator_restart"]
    assert restarts and restarts[0]["delay_s"] == 0


def test_hang_is_quit_killed_and_relaunched_keeping_the_log(night: nights.Night) -> None:
    """A SIGSTOPped scheduler fails health; SGLang gets SIGQUIT first, then the group dies;
    what the log said is kept beside our own reading."""
    c = crash(night, 2)
    assert c["cause"] == "hang", c
    assert "log_cause" in c and c["log_evidence"] is not None
    stopping = [e for e in night.events if e.get("event") == "server_stopping" and e.get("reason") == "hang"]
    assert stopping and stopping[0]["mode"] == "dump"
    assert night.leftovers["hang"] == []


def test_planned_stop_drains_requests_in_flight(night: nights.Night) -> None:
    """SIGTERM to the daemon with 4 requests in flight: all 200, exit 0, nothing left."""
    assert len(night.results["stop"]) == nights.IN_FLIGHT
    assert night.failed["stop"] == 0, night.results["stop"]
    assert night.exit_code == 0
    assert night.leftovers["stop"] == []


def test_the_morning_report_of_the_real_night(night: nights.Night, tmp_path) -> None:
    """`sglang-supervisor report` over the real night's state directory: the journal the daemon
    kept holds every launch and crash, the report counts each crash by its cause, reads the
    KV pool from SGLang's own startup lines, and the launch argv is kept redacted (a
    secret flag's value is ``***``: the report's header shows the command). HTML and text, through the CLI as a user runs it."""
    assert night.config is not None
    state = Path(nights.config_of(night.config)["state"]["dir"])
    journal = [json.loads(line) for line in (state / "journal.jsonl").read_text().splitlines()]
    launches = [r for r in journal if r["kind"] == "launch"]
    assert [r["attempt"] for r in launches] == [1, 2, 3, 4, 5]
    assert all(r["argv"] and redact_argv(r["argv"]) == r["argv"] for r in launches), launches
    assert [r["cause"] for r in journal if r["kind"] == "crash"] == [c["cause"] for c in night.crashes]

    def report(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "supervisor.cli", "report", "--config", str(night.config), *args],
                           cwd=nights.REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    text = report("--format", "text", "--since", "2h")
    causes = collections.Counter(c["cause"] for c in night.crashes)
    for cause, n in causes.items():
        assert f"{cause} × {n}" in text, text
    tokens = next(e for e in night.events if e.get("event") == "startup_facts")["max_total_num_tokens"]
    assert f"{tokens:,} at " in text, text  # the KV pool of a rung, as SGLang's log said it
    assert "launch #5" in text and "state now" in text and "STOPPED" in text and "None GB" not in text
    page = Path(report("-o", str(tmp_path / "night.html"), "--since", "2h").strip())
    source = page.read_text()
    assert "data:image/png;base64," in source and "host_oom" in source and "hang" in source


# --- short daemons of their own -----------------------------------------------------------------


@pytest.fixture
def locked() -> Iterator[None]:
    import fcntl

    with open("/tmp/real-sglang.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def test_bad_flag_is_config_error_and_the_daemon_gives_up(real_sglang, tmp_path, locked, no_leftovers) -> None:
    """An invalid flag value: SGLang's argparse error, exit 2, config_error, GAVE_UP."""
    cfg = real_config(tmp_path, real_sglang, {"server": {"extra_args": ["--max-running-requests", "lots"]}})
    with DaemonRun(cfg) as d:
        c = d.wait_for("crash", timeout=120)
        assert (c["cause"], c["exit_code"]) == ("config_error", 2), c
        d.wait_for("gave_up", timeout=10)
        assert d.stop() == 0


def test_missing_model_is_model_load_error_and_the_daemon_gives_up(real_sglang, tmp_path, locked, no_leftovers) -> None:
    """A model directory with no model in it: SGLang's own error, model_load_error, GAVE_UP.
    A model path that does not exist at all is caught before launch with the same cause."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    cfg = real_config(tmp_path, real_sglang, {"server": {"model_path": str(empty)}})
    with DaemonRun(cfg) as d:
        c = d.wait_for("crash", timeout=120)
        assert c["cause"] == "model_load_error", c
        d.wait_for("gave_up", timeout=10)
        assert d.stop() == 0
    cfg = real_config(tmp_path, real_sglang, {"server": {"model_path": str(tmp_path / "no-such-model")}}, name="missing")
    with DaemonRun(cfg) as d:
        g = d.wait_for("gave_up", timeout=60)
        assert g["cause"] == "model_load_error", g
        assert not d.find("launch")
        assert d.stop() == 0


def test_kv_pool_failure_raises_the_fraction_past_sglangs_minimum(real_sglang, tmp_path, locked, no_leftovers) -> None:
    """At 0.0001 SGLang says the weights leave no room for the KV cache and names a minimum;
    the fraction goes up to the next rung above it and the server comes up."""
    cfg = real_config(tmp_path, real_sglang, {"server": {"mem_fraction_static": 0.0001},
                                               "policy": {"fraction_ladder": [0.10, 0.05, 0.0001]}})
    with DaemonRun(cfg) as d:
        c = d.wait_for("crash", timeout=120)
        assert c["cause"] == "kv_pool_too_small", c
        assert c["min_fraction"] and c["min_fraction"] > 0.0001
        assert c["next_mem_fraction_static"] == 0.05, c
        ready = d.wait_for("server_ready", timeout=200)
        assert ready["mem_fraction_static"] == 0.05
        assert d.stop() == 0


def test_injected_scheduler_exception_is_read_from_the_real_traceback(real_sglang, tmp_path, locked, no_leftovers) -> None:
    """SGLang's own crash hook raises in the scheduler: cause, evidence and location come from
    the real traceback; the server is relaunched."""
    cfg = real_config(tmp_path, real_sglang, env={"SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS": "1"})
    port = int(nights.config_of(cfg)["server"]["port"])
    with DaemonRun(cfg) as d:
        deadline = time.monotonic() + 200
        sent = False
        while not d.find("crash"):  # SGLang's own warm-up request may trip the hook first
            assert time.monotonic() < deadline, "no crash"
            if d.find("server_ready") and not sent:
                nights.Requests(port, n=1, tokens=16)
                sent = True
            time.sleep(0.2)
        c = d.wait_for("crash", timeout=60)
        assert c["cause"] == "other", c
        assert c["evidence"] and c["location"], c
        assert c["exc_type"], c
        d.wait_for("launch", attempt=2, timeout=60)
        assert d.stop() == 0


def test_a_foreign_server_on_our_port_is_reported_and_never_killed(real_sglang, tmp_path, locked, no_leftovers) -> None:
    """Another user's real SGLang holds the port: port_in_use is reported, the daemon retries
    on backoff, and the other server is alive and serving afterwards."""
    cfg = real_config(tmp_path, real_sglang)
    port = int(nights.config_of(cfg)["server"]["port"])
    env = {k: v for k, v in real_sglang.environ().items() if not k.startswith("SGLANG_SUPERVISOR")}
    other = subprocess.Popen(real_sglang.launch_args(port), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not _healthy(port):
            assert other.poll() is None, "the foreign server died"
            assert time.monotonic() < deadline, "the foreign server never came up"
            time.sleep(0.5)
        with DaemonRun(cfg) as d:
            held = d.wait_for("port_in_use", timeout=60)
            assert [h["pid"] for h in held["holders"]] and all(h["pid"] != d.proc.pid for h in held["holders"])
            d.wait_for("preflight_retry", timeout=30)
            time.sleep(2.0)
            assert not d.find("launch") and not d.find("orphans_killed")
            assert d.stop() == 0
        assert other.poll() is None and _healthy(port)
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(30)
        nights.all_gone([p for p in psutil.process_iter() if _in_session(p, other.pid)], 15)


def _healthy(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid
    except OSError:
        return False
