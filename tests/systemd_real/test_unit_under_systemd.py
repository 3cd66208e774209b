"""The shipped unit under a real systemd (252, Debian 12, PID 1 of a systemd-nspawn container).

Its own tier in ``make test`` (scripts/run-tiers): it needs root, systemd-nspawn and
debootstrap (scripts/install-system-deps installs them; missing in CI: a failure). The root
file system is built once and cached (tests/nspawn.py); each run boots it with a tmpfs
overlay, binds the project and its Python in read-only at their own paths, binds
``systemd/sglang-supervisor@.service`` itself as the installed unit, and adapts it with one
drop-in only: the paths (ExecStart= names this checkout's virtualenv, PYTHONPATH this
checkout) and, to keep the waits short, WatchdogSec=/RestartSec= (TEST_TIMINGS).

What an operator relies on, each with a simulated server: ``systemctl start`` returns at
READY=1 and ``systemctl status`` shows STATUS=; ``reload`` is a SIGHUP the daemon applies;
``stop`` drains and ends with Result=success and nothing left in the unit's cgroup; a daemon
that stops pinging (SIGSTOP) is killed by the watchdog and restarted; a SIGKILLed daemon is
brought back by Restart= with the fraction it learned; ``journalctl -p err`` finds a
give-up, and the journal fields select a server; ``systemctl kill --kill-whom=main -s USR2``
re-execs the daemon in place (same MainPID, active throughout, no watchdog kill).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w
from conftest import IN_CI, free_port, require_binary, wait_until
from harness import write_config
from nspawn import Machine, rootfs

REPO = Path(__file__).resolve().parent.parent.parent
UNIT = REPO / "systemd" / "sglang-supervisor@.service"
UNIT_DIR = "/etc/systemd/system"
VENV = Path(sys.executable).parent.parent  # this checkout's .venv (a symlink, maybe)
# Only to keep the waits short; test_systemd_unit.py holds the shipped values (30 s, 10 s).
TEST_TIMINGS = {"WatchdogSec": "8s", "RestartSec": "1s"}  # pings every 4 s
WAIT_S = 90.0  # any one wait: two shared CPU cores

# the first test's setup may build the root file system (tests/nspawn.py: debootstrap, ~2-4 min)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


def dropin() -> str:
    binary = VENV / "bin" / "sglang-supervisor"
    timings = "".join(f"{k}={v}\n" for k, v in TEST_TIMINGS.items())
    return ("[Service]\n"
            "ExecStart=\n"
            f"ExecStart={binary} run --config /etc/sglang-supervisor/%i.toml\n"
            f"Environment=PYTHONPATH={REPO}\n" + timings)


class Box:
    """The booted container with the unit installed; ``config`` writes an instance's config."""

    def __init__(self, machine: Machine, etc: Path, scratch: Path) -> None:
        self.m = machine
        self.etc = etc
        self.scratch = scratch

    def config(self, name: str, *, sim_args: tuple[str, ...] = (), servers: tuple[str, ...] = (),
               sections: dict | None = None) -> None:
        """``/etc/sglang-supervisor/NAME.toml``: a simulated server (or ``[[server]]``
        entries named ``servers``, the first healthy, the others failing with ``sim_args``),
        its state, log and simulated GPUs where the unit lets it write."""
        gpus = f"/var/cache/sglang-supervisor/gpus-{name}"
        self.m.sh(["install", "-d", "-o", "sglang", "-g", "sglang", gpus])
        self.m.sh([str(VENV / "bin" / "python"), "-c",
                   f"import sys; sys.path.insert(0, {str(REPO)!r}); from supervisor.sim import simgpu; "
                   f"simgpu.ensure_gpus({gpus!r}, 8, 96)"])
        self.m.sh(["chown", "-R", "sglang:sglang", gpus])
        env = {"SGLANG_SIM_GPU_DIR": gpus, "PYTHONPATH": str(REPO), "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
               "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
        base = {
            "server": {"env": env},
            "gpu": {"sim_dir": gpus},
            "state": {"dir": f"/var/lib/sglang-supervisor/{name}"},
            "logging": {"format": "auto", "server_log": f"/var/log/sglang-supervisor/{name}/server.log"},
        }
        for section, keys in (sections or {}).items():
            base.setdefault(section, {}).update(keys)
        path = write_config(self.scratch / name, base, sim_args=() if servers else sim_args, name=name)
        if servers:
            import tomllib

            doc = tomllib.loads(path.read_text())
            single = doc.pop("server")
            doc["server"] = []
            for i, server in enumerate(servers):
                entry = {**single, "name": server, "gpu": {"indices": [2 * i, 2 * i + 1]}, "port": free_port(),
                         "logging": {"server_log": f"/var/log/sglang-supervisor/{name}/{server}.log"}}
                if i:
                    entry["command"] = [*single["command"], *sim_args]
                doc["server"].append(entry)
            path.write_text(tomli_w.dumps(doc))
        shutil.copy(path, self.etc / f"{name}.toml")
        (self.etc / f"{name}.toml").chmod(0o644)

    def unit(self, name: str) -> str:
        return f"sglang-supervisor@{name}.service"

    def show(self, name: str, *props: str) -> dict[str, str]:
        return self.m.show(self.unit(name), *props)

    def events(self, name: str, *args: str) -> list[dict]:
        """The daemon's JSON lines in the journal (``journalctl -o cat`` | jq, as the docs say)."""
        out = []
        for line in self.m.journal("-u", self.unit(name), "-o", "cat", *args).splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_event(self, name: str, event: str, what: str = "", **match) -> dict:
        def found():
            for e in self.events(name):
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            return None

        return wait_until(found, timeout=WAIT_S, interval=0.5, what=what or f"{event} {match} in the journal")

    def wait_status(self, name: str, prefix: str) -> str:
        return wait_until(lambda: (s := self.show(name, "StatusText")["StatusText"]).startswith(prefix) and s,
                          timeout=WAIT_S, interval=0.3, what=f"STATUS={prefix}...")

    def start(self, name: str) -> None:
        """``systemctl start``: returns once the daemon sent READY=1 (a failure shows the journal)."""
        r = self.m.systemctl("start", self.unit(name), timeout=WAIT_S, check=False)
        assert r.returncode == 0, f"{r.stderr}\n{self.m.journal('-u', self.unit(name), '-o', 'cat')[-4000:]}"

    def stop(self, name: str) -> None:
        self.m.systemctl("stop", self.unit(name), timeout=WAIT_S + 60)


def processes_of(unit: str) -> list[int]:
    """Host pids of every process in ``unit``'s cgroup (the container shares the host's
    /proc: its processes are ours to see)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"/{unit}" in (entry / "cgroup").read_text():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def need_root() -> None:
    if os.geteuid() == 0:
        return
    if IN_CI:
        pytest.fail("the real-systemd tier needs root (systemd-nspawn)")
    pytest.skip("the real-systemd tier needs root (systemd-nspawn); not in CI")


def outside_tmp() -> None:
    """The shipped unit has PrivateTmp=yes: the daemon sees a /tmp of its own, so a checkout or
    a virtualenv under /tmp (or /var/tmp) is not there for it (status=203/EXEC), in this test
    as on a host. One line instead of every test failing at its first start."""
    for what, path in (("the checkout", REPO), ("its virtualenv", VENV.resolve()), ("its Python", Path(sys.base_prefix))):
        if path == Path("/tmp") or Path("/tmp") in path.parents or Path("/var/tmp") in path.parents:
            pytest.fail(f"{what} is under a temporary directory ({path}); the unit's PrivateTmp=yes hides it from "
                        "the daemon: clone the project elsewhere (CI's clone is not under /tmp)", pytrace=False)


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Iterator[Box]:
    need_root()
    outside_tmp()
    nspawn = require_binary("systemd-nspawn")
    require_binary("nsenter")
    root = rootfs(require_binary("debootstrap"))
    tmp = tmp_path_factory.mktemp("nspawn")
    etc, drop, scratch = tmp / "etc", tmp / "dropin", tmp / "scratch"
    for d in (etc, drop, scratch):
        d.mkdir()
        d.chmod(0o755)
    (drop / "10-this-checkout.conf").write_text(dropin())
    venv_real = VENV.resolve()
    binds = [str(REPO), sys.base_prefix, f"{UNIT}:{UNIT_DIR}/{UNIT.name}", f"{drop}:{UNIT_DIR}/{UNIT.name}.d",
             f"{etc}:/etc/sglang-supervisor"]
    if not str(venv_real).startswith(str(REPO) + "/"):
        binds.append(str(venv_real))
    with Machine(root, binds_ro=binds, log=tmp / "nspawn.log", nspawn=nspawn) as machine:
        machine.systemctl("daemon-reload")
        verify = machine.sh(["systemd-analyze", "verify", f"{UNIT_DIR}/sglang-supervisor@x.service"], check=False)
        assert verify.returncode == 0, verify.stderr
        yield Box(machine, etc, scratch)


def test_start_returns_at_ready_status_reload_and_a_clean_stop(box):
    """start blocks until READY=1 (the unit is active/running when it returns), status shows
    STATUS=, reload is SIGHUP (RELOADING=1 then READY=1; the config re-read), stop drains:
    Result=success, exit 0, and nothing of the unit left in its cgroup."""
    box.config("alpha")
    box.start("alpha")
    state = box.show("alpha", "ActiveState", "SubState", "MainPID", "Type", "NotifyAccess")
    assert (state["ActiveState"], state["SubState"], state["Type"]) == ("active", "running", "notify")
    assert box.wait_status("alpha", "READY")
    status = box.m.systemctl("status", "--no-pager", box.unit("alpha"), check=False).stdout
    assert "Status: \"READY" in status

    pid = state["MainPID"]
    box.m.systemctl("reload", box.unit("alpha"), timeout=WAIT_S)
    reloaded = box.wait_event("alpha", "config_reloaded")
    assert reloaded["ok"] is True
    assert box.show("alpha", "MainPID")["MainPID"] == pid  # a reload, not a restart
    assert box.show("alpha", "ActiveState")["ActiveState"] == "active"

    ready = box.events("alpha")
    assert any(e.get("event") == "server_ready" for e in ready)
    box.stop("alpha")
    after = box.show("alpha", "ActiveState", "Result", "ExecMainStatus")
    assert (after["ActiveState"], after["Result"], after["ExecMainStatus"]) == ("inactive", "success", "0")
    assert processes_of(box.unit("alpha")) == []
    journal = box.m.journal("-u", box.unit("alpha"))
    assert "timed out" not in journal and "Killing process" not in journal, journal[-3000:]
    # the daemon's own ordered stop: SIGTERM reached it alone (KillMode=mixed), it drained SGLang
    stops = [e for e in box.events("alpha") if e.get("event") in ("daemon_stopping", "server_stopping",
                                                                  "server_stopped")]
    by_event = {e["event"]: e for e in stops}
    assert set(by_event) == {"daemon_stopping", "server_stopping", "server_stopped"}, stops
    assert by_event["daemon_stopping"]["reason"] == "SIGTERM"
    assert (by_event["server_stopping"]["mode"], by_event["server_stopping"]["reason"]) == ("drain", "SIGTERM")
    assert by_event["server_stopped"]["exit_code"] == 0  # SGLang's main process drained and exited by itself


def test_a_daemon_that_stops_pinging_is_killed_by_the_watchdog_and_restarted(box):
    box.config("wd")
    box.start("wd")
    box.wait_status("wd", "READY")
    first = box.show("wd", "MainPID")["MainPID"]
    box.m.systemctl("kill", "--kill-whom=main", "--signal=SIGSTOP", box.unit("wd"))
    wait_until(lambda: "Watchdog timeout" in box.m.journal("-u", box.unit("wd")), timeout=WAIT_S, interval=0.5,
               what="systemd's watchdog timeout")
    wait_until(lambda: (s := box.show("wd", "ActiveState", "MainPID", "NRestarts"))["ActiveState"] == "active"
               and s["MainPID"] not in ("0", first) and int(s["NRestarts"]) >= 1, timeout=WAIT_S, interval=0.5,
               what="the unit restarted with a new daemon")
    box.wait_status("wd", "READY")
    box.stop("wd")
    assert processes_of(box.unit("wd")) == []


def test_restart_brings_a_killed_daemon_back_with_the_fraction_it_learned(box):
    """The headroom guard steps 0.93 down to 0.88 (no crash needed); the daemon is SIGKILLed;
    Restart=on-failure starts a new one, which launches at 0.88 from the state directory."""
    box.config("learn", sections={"gpu": {"headroom_action": "step_down", "headroom_min_gb": 2.0}})
    box.start("learn")
    box.wait_event("learn", "launch", mem_fraction_static=0.88)
    box.wait_status("learn", "READY")
    first = box.show("learn", "MainPID")["MainPID"]
    box.m.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", box.unit("learn"))
    wait_until(lambda: (s := box.show("learn", "ActiveState", "MainPID", "NRestarts"))["ActiveState"] == "active"
               and s["MainPID"] not in ("0", first) and int(s["NRestarts"]) >= 1, timeout=WAIT_S, interval=0.5,
               what="Restart= bringing the daemon back")
    second = box.show("learn", "MainPID")["MainPID"]
    launches = wait_until(lambda: [e for e in box.events("learn", f"_PID={second}") if e.get("event") == "launch"],
                          timeout=WAIT_S, interval=0.5, what="the new daemon's launch")
    assert launches[0]["mem_fraction_static"] == 0.88
    box.stop("learn")
    assert processes_of(box.unit("learn")) == []


def test_journalctl_p_err_finds_a_give_up_and_the_fields_select_a_server(box):
    """Two servers in one daemon; tp4-b's model cannot load, so it gives up (crit). The
    journal's own filters find it: the priority, and the event, server and cause fields."""
    box.config("pair", servers=("tp4-a", "tp4-b"), sim_args=("--sim-fail", "model_load"))
    box.start("pair")
    box.wait_event("pair", "gave_up", server="tp4-b")
    # tp4-b may give up before tp4-a is READY (its load fails at once): neither order is promised
    box.wait_event("pair", "server_ready", server="tp4-a")
    unit = ["-u", box.unit("pair"), "-o", "cat"]
    errors = [json.loads(line) for line in box.m.journal(*unit, "-p", "err").splitlines() if line.startswith("{")]
    assert any(e["event"] == "gave_up" and e["server"] == "tp4-b" for e in errors)
    assert all(e["level"] in ("error", "critical") for e in errors), errors  # no info line passes -p err
    by_event = box.m.journal(*unit, "SGLANG_SUPERVISOR_EVENT=gave_up").splitlines()
    assert [json.loads(line)["server"] for line in by_event] == ["tp4-b"]
    by_cause = box.m.journal(*unit, "SGLANG_SUPERVISOR_CAUSE=model_load_error").splitlines()
    assert by_cause and all(json.loads(line).get("cause") == "model_load_error" for line in by_cause)
    tp4a = [json.loads(line) for line in box.m.journal(*unit, "SGLANG_SUPERVISOR_SERVER=tp4-a").splitlines()]
    assert tp4a and {e["server"] for e in tp4a} == {"tp4-a"}
    assert any(e["event"] == "server_ready" for e in tp4a)
    fields = json.loads(box.m.journal("-u", box.unit("pair"), "-o", "json", "SGLANG_SUPERVISOR_EVENT=gave_up").splitlines()[0])
    assert (fields["PRIORITY"], fields["SYSLOG_IDENTIFIER"], fields["SGLANG_SUPERVISOR_SERVER"]) == ("2", "sglang-supervisor", "tp4-b")
    box.stop("pair")
    assert processes_of(box.unit("pair")) == []


def test_the_native_protocol_reaches_the_real_journald_multi_line_and_memfd(box):
    """supervisor.adapters.journald against journald itself: a multi-line value (the
    binary-safe form) and an entry far over a datagram's size (a sealed memfd) arrive whole."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from supervisor.adapters.journald import JournalSocket\n"
            "j = JournalSocket()\n"
            "assert j.send({'MESSAGE': 'one\\ntwo', 'SGLANG_SUPERVISOR_EVENT': 'nspawn_multi', 'PRIORITY': '6'})\n"
            "assert j.send({'MESSAGE': 'x' * (1 << 20), 'SGLANG_SUPERVISOR_EVENT': 'nspawn_big', 'PRIORITY': '6'})\n")
    box.m.sh([str(VENV / "bin" / "python"), "-c", code, str(REPO)])

    def entry(event: str) -> dict | None:
        lines = box.m.journal("-o", "json", "--all", f"SGLANG_SUPERVISOR_EVENT={event}").splitlines()
        return json.loads(lines[0]) if lines else None

    multi = wait_until(lambda: entry("nspawn_multi"), timeout=WAIT_S, interval=0.3, what="the multi-line entry")
    big = wait_until(lambda: entry("nspawn_big"), timeout=WAIT_S, interval=0.3, what="the memfd entry")
    as_text = lambda v: v if isinstance(v, str) else bytes(v).decode()  # journalctl -o json: a list of bytes when not plain text
    assert as_text(multi["MESSAGE"]) == "one\ntwo"
    assert as_text(big["MESSAGE"]) == "x" * (1 << 20)


def test_usr2_reexecs_in_place_with_the_unit_active_the_same_mainpid_and_no_watchdog_kill(box):
    """``systemctl kill --kill-whom=main -s USR2`` (docs/upgrade.md): the daemon re-execs in
    place. Sampled through the exec, the unit is active (``reloading`` while RELOADING=1
    holds) with the same MainPID; the server is adopted (one launch); two watchdog intervals
    later no watchdog kill and no restart."""
    box.config("rx")
    box.start("rx")
    box.wait_status("rx", "READY")
    pid = box.show("rx", "MainPID")["MainPID"]
    box.wait_event("rx", "server_ready")
    box.m.systemctl("kill", "--kill-whom=main", "--signal=SIGUSR2", box.unit("rx"))
    seen: list[dict[str, str]] = []

    def reexecuted() -> dict | None:
        seen.append(box.show("rx", "ActiveState", "MainPID"))
        return next((e for e in box.events("rx") if e.get("event") == "reexec"), None)

    said = wait_until(reexecuted, timeout=WAIT_S, interval=0.2, what="the reexec line in the journal")
    assert said["adopted"] and not said.get("relaunching"), said
    assert {s["ActiveState"] for s in seen} <= {"active", "reloading"}, seen
    assert {s["MainPID"] for s in seen} == {pid}, seen
    box.wait_status("rx", "READY")
    time.sleep(2 * float(TEST_TIMINGS["WatchdogSec"].rstrip("s")))  # a missed ping would have killed it by now
    after = box.show("rx", "ActiveState", "MainPID", "NRestarts")
    assert after == {"ActiveState": "active", "MainPID": pid, "NRestarts": "0"}, after
    assert "Watchdog timeout" not in box.m.journal("-u", box.unit("rx"))
    assert len([e for e in box.events("rx") if e.get("event") == "launch"]) == 1, "relaunched"
    box.stop("rx")
    assert processes_of(box.unit("rx")) == []
