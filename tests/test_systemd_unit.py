"""The systemd template unit: verified by systemd-analyze, and the directives the daemon relies on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_binary

from supervisor.core.config import ServerConfig

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "sglang-supervisor@.service"
INSTALLED_BINARY = "/opt/sglang-supervisor/venv/bin/sglang-supervisor"
# systemd-analyze security's 0-10 scale; --threshold takes tenths. The unit measures 2.3.
MAX_EXPOSURE_TENTHS = 30


def directives(text: str) -> dict[str, list[str]]:
    """``Key -> [values]`` over every section (keys do not repeat across our sections)."""
    found: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def one(unit: dict[str, list[str]], key: str) -> str:
    """The single value of ``key``."""
    values = unit.get(key, [])
    assert len(values) == 1, f"{key}= should appear once, found {values}"
    return values[0]


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    """Run systemd-analyze (failing in CI when it is missing)."""
    binary = require_binary("systemd-analyze")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)


def seconds(span: str) -> float:
    """A systemd time span ("120s", "2min 30s") in seconds, as systemd itself parses it."""
    result = analyze("timespan", span)
    assert result.returncode == 0, result.stderr
    match = re.search(r"μs:\s*(\d+)", result.stdout)
    assert match, result.stdout
    return int(match.group(1)) / 1e6


def install_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit copied into tmp_path with ExecStart pointing at a binary that exists here."""
    text = UNIT.read_text() if text is None else text
    assert INSTALLED_BINARY in text
    target = tmp_path / UNIT.name
    target.write_text(text.replace(INSTALLED_BINARY, sys.executable))
    return target


def verify_problems(unit_dir: Path) -> tuple[int, list[str]]:
    """systemd-analyze verify on instance ``test``: exit status and the lines about our unit."""
    result = analyze("verify", "--man=no", "--generators=no", str(unit_dir / "sglang-supervisor@test.service"))
    lines = (result.stdout + result.stderr).splitlines()
    return result.returncode, [ln for ln in lines if "sglang-supervisor" in ln or str(unit_dir) in ln]


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    """systemd-analyze verify accepts the unit (instance "test") with no warning about it."""
    install_copy(tmp_path)
    rc, problems = verify_problems(tmp_path)
    assert (rc, problems) == (0, [])


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    """The verify check is not blind: a misspelled key and a bad boolean are reported."""
    broken = UNIT.read_text().replace("KillMode=mixed", "KillMode=mixed\nKilMode=mixed\nNoNewPrivileges=maybe")
    install_copy(tmp_path, broken)
    _, problems = verify_problems(tmp_path)
    assert any("KilMode" in p for p in problems)
    assert any("maybe" in p for p in problems)


def test_security_exposure_stays_low(tmp_path: Path) -> None:
    """systemd-analyze security --offline rates the unit at most 3.0 (it measured 2.3 "OK")."""
    unit = install_copy(tmp_path).with_name("sglang-supervisor@kimi.service")
    result = analyze("security", "--offline=true", "--no-pager", f"--threshold={MAX_EXPOSURE_TENTHS}", str(unit))
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout + result.stderr)
    assert match, result.stdout + result.stderr
    assert result.returncode == 0, f"exposure {match.group(1)} is above {MAX_EXPOSURE_TENTHS / 10}"


def test_service_runs_the_daemon_as_a_notify_service() -> None:
    """Type=notify from the main process only, one config per instance, SIGHUP on reload."""
    unit = directives(UNIT.read_text())
    assert one(unit, "Type") == "notify"
    assert one(unit, "NotifyAccess") == "main"
    assert one(unit, "ExecStart") == f"{INSTALLED_BINARY} run --config /etc/sglang-supervisor/%i.toml"
    assert one(unit, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(unit, "User") == "sglang"
    assert one(unit, "StateDirectory") == "sglang-supervisor/%i"
    assert one(unit, "LogsDirectory") == "sglang-supervisor/%i"
    assert one(unit, "WantedBy") == "multi-user.target"


def test_systemd_restarts_a_failed_or_wedged_daemon() -> None:
    """Restart=on-failure with a watchdog long enough for ordinary pauses, and a start limit."""
    unit = directives(UNIT.read_text())
    assert one(unit, "Restart") == "on-failure"
    assert 10 <= seconds(one(unit, "WatchdogSec")) <= 120
    assert seconds(one(unit, "RestartSec")) > 0
    assert int(one(unit, "StartLimitBurst")) >= 1


def test_stop_leaves_the_daemon_time_to_stop_sglang_itself() -> None:
    """KillMode=mixed and a TimeoutStopSec beyond the daemon's default stop grace plus a margin."""
    unit = directives(UNIT.read_text())
    assert one(unit, "KillMode") == "mixed"
    assert seconds(one(unit, "TimeoutStopSec")) >= ServerConfig().stop_grace_s + 30


def test_a_kernel_oom_kill_of_sglang_does_not_stop_the_unit() -> None:
    """OOMPolicy=continue leaves a host OOM to the daemon; no OOMScoreAdjust for SGLang to inherit."""
    unit = directives(UNIT.read_text())
    assert one(unit, "OOMPolicy") == "continue"
    assert "OOMScoreAdjust" not in unit


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("PrivateDevices", "hides /dev/nvidia*"),
        ("DevicePolicy", "an explicit device list hides /dev/nvidia* unless it names them"),
        ("DeviceAllow", "any DeviceAllow= closes every device not listed"),
        ("ProtectClock", "implies DeviceAllow=char-rtc r, which closes /dev/nvidia*"),
        ("MemoryDenyWriteExecute", "breaks CUDA/Triton JIT and ctypes callbacks"),
        ("PrivateNetwork", "SGLang serves clients; NCCL and MQTT need the network"),
        ("DynamicUser", "state, caches and GPU groups need a stable user"),
    ],
)
def test_no_directive_that_breaks_gpu_serving(key: str, why: str) -> None:
    """Hardening that would break CUDA, NCCL or serving stays out of the unit."""
    assert key not in directives(UNIT.read_text()), why


def test_hardening_that_keeps_gpu_access_is_on() -> None:
    """The chosen sandboxing directives are present with the intended values."""
    unit = directives(UNIT.read_text())
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
    }
    assert {k: one(unit, k) for k in expected} == expected
