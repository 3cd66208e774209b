"""Preflight: the pure checks, and the real facts of this host (RAM, a real listener, simulated GPUs)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tomllib
from pathlib import Path

import psutil
import pytest
from conftest import free_port
from test_cleanup import Spawn, spawn  # noqa: F401 - the fixture, shared rather than copied

from supervisor import TESTED_SGLANG
from supervisor.adapters.cleanup import listeners
from supervisor.adapters.ports import GpuProbeError
from supervisor.cli.preflight import add_arguments, run
from supervisor.core.config import Config, GpuConfig, ServerConfig, StateConfig
from supervisor.services.preflight import (
    GB,
    Check,
    check_gpu_count,
    check_host_ram,
    check_model_path,
    check_port,
    failed_fields,
    format_table,
    permanent_failure,
    ranks_on_host,
    run_preflight,
)
from supervisor.sim import simgpu
from supervisor.sim.gpuprobe import SimulatedProbe

REPO = Path(__file__).resolve().parent.parent
SEED_HOST_AVAILABLE = 449 * GB
SEED_HOST_TOTAL = 503 * GB


def test_hicache_300_times_8_is_refused_with_the_arithmetic() -> None:
    """The seed's --hicache-size 300 with tp 8 is refused, showing 300 GB × 8 ranks = 2400 GB against 449 GB."""
    c = check_host_ram(300, 8, SEED_HOST_AVAILABLE, 32, SEED_HOST_TOTAL)
    assert not c.ok and c.permanent  # 2400 GB can never fit in 503 GB
    assert "hierarchical cache asks 300 GB × 8 ranks = 2400 GB; this host has 449 GB available" in c.detail
    assert "2432 GB are needed with the 32 GB margin" in c.detail
    assert "lower hicache_size_gb to at most 52" in c.detail


def test_hicache_48_times_8_fits() -> None:
    """The size that worked in the seed (48 GB × 8 = 384 GB) passes on the same host."""
    c = check_host_ram(48, 8, SEED_HOST_AVAILABLE, 32, SEED_HOST_TOTAL)
    assert c.ok and "48 GB × 8 ranks = 384 GB" in c.detail


def test_hicache_that_fits_total_but_not_available_ram_is_retryable() -> None:
    """An ask below total RAM but above what is available now may pass later: not permanent."""
    c = check_host_ram(60, 8, SEED_HOST_AVAILABLE, 32, 1000 * GB)
    assert not c.ok and not c.permanent


def test_hicache_off_passes() -> None:
    """With no fixed hierarchical cache there is nothing to check."""
    assert check_host_ram(0, 8, 1 * GB, 32).ok


def test_gpu_count() -> None:
    """tp × dp GPUs are needed; fewer is a permanent failure naming the numbers."""
    assert check_gpu_count(8, 8, 1).ok
    c = check_gpu_count(4, 4, 2)
    assert not c.ok and c.permanent and "tp 4 × dp 2 needs 8 GPUs; only 4 visible" in c.detail
    assert check_gpu_count(4, 8, 1, ranks_on_host=4).ok


def test_ranks_on_host_divides_over_nodes() -> None:
    """--nnodes in extra_args spreads the ranks over the nodes; the default is one node."""
    assert ranks_on_host(ServerConfig(model_path="m", tp_size=8)) == 8
    assert ranks_on_host(ServerConfig(model_path="m", tp_size=16, extra_args=("--nnodes", "2"))) == 8
    assert ranks_on_host(ServerConfig(model_path="m", tp_size=8, dp_size=2, extra_args=("--nnodes=4",))) == 4


def test_model_path() -> None:
    """A Hugging Face id passes unchecked; a missing local path fails for good (the daemon gives
    up with model_load_error; mounts are ordered by systemd); an empty one is permanent."""
    assert check_model_path("moonshotai/Kimi-K2.5", exists=False).ok
    missing = check_model_path("/models/kimi", exists=False)
    assert not missing.ok and missing.permanent and "does not exist" in missing.detail
    assert not check_model_path("~/models/kimi", exists=False).ok
    assert check_model_path("./kimi", exists=True).ok
    assert check_model_path("", exists=False).permanent


def test_port_check_verdicts() -> None:
    """A free port passes, one held by our stale server passes, a foreign holder fails, an unbindable host is permanent."""
    assert check_port("127.0.0.1", 30000, False, bindable=True).ok
    assert check_port("127.0.0.1", 30000, True, bindable=False, holder="pid 7 python").ok
    foreign = check_port("127.0.0.1", 30000, False, bindable=False, holder="pid 7 nginx")
    assert not foreign.ok and not foreign.permanent and "pid 7 nginx" in foreign.detail
    assert check_port("10.9.9.9", 30000, False, bindable=False, error="Cannot assign requested address").permanent


def test_table_and_event_fields() -> None:
    """The table has one line per check and a summary; the event carries the checks and permanence."""
    checks = [Check("gpu_count", True, "8 GPUs"), Check("host_ram", False, "too big", permanent=True)]
    table = format_table(checks).splitlines()
    assert table[0].split() == ["CHECK", "RESULT", "DETAIL"]
    assert table[2].split()[:2] == ["host_ram", "FAIL"]
    assert "1 cannot pass by waiting" in table[3]
    assert permanent_failure(checks)
    fields = failed_fields(checks)
    assert fields["permanent"] is True and fields["checks"][1] == {"name": "host_ram", "ok": False, "detail": "too big"}


def _config(tmp_path: Path, *, gpus: int = 8, **server: object) -> Config:
    sim = tmp_path / "gpus"
    simgpu.ensure_gpus(sim, gpus, 141)
    args: dict[str, object] = {"model_path": str(tmp_path), "port": free_port(), **server}
    return Config(
        server=ServerConfig(**args),  # type: ignore[arg-type]
        gpu=GpuConfig(backend="simulated", sim_dir=str(sim)),
        state=StateConfig(dir=str(tmp_path)),
    )


async def test_this_host_refuses_hicache_300_times_tp_8(tmp_path: Path) -> None:
    """On this machine, hicache 300 with tp 8 fails preflight with the arithmetic and this host's real RAM."""
    cfg = _config(tmp_path, tp_size=8, hicache_size_gb=300)
    checks = {c.name: c for c in await run_preflight(cfg, SimulatedProbe(cfg.gpu.sim_dir), listeners=listeners)}
    assert checks["gpu_count"].ok and checks["port"].ok and checks["model_path"].ok
    ram = checks["host_ram"]
    available = round(psutil.virtual_memory().available / GB)
    assert not ram.ok and ram.permanent  # 2400 GB is more than this host has in total
    assert "hierarchical cache asks 300 GB × 8 ranks = 2400 GB; this host has " in ram.detail
    assert abs(float(ram.detail.split("this host has ")[1].split(" GB")[0]) - available) <= 1


async def test_foreign_listener_fails_the_port_check(tmp_path: Path) -> None:
    """A port held by a listener that is not a stale server of ours fails, naming the holder."""
    cfg = _config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.server.port))
        s.listen()
        checks = {c.name: c for c in await run_preflight(cfg, SimulatedProbe(cfg.gpu.sim_dir), listeners=listeners)}
    assert not checks["port"].ok and not checks["port"].permanent
    assert "in use by another process" in checks["port"].detail
    assert f"pid {psutil.Process().pid}" in checks["port"].detail


async def test_too_few_and_lost_gpus(tmp_path: Path) -> None:
    """Fewer simulated GPUs than tp × dp fail permanently; a lost GPU fails permanently too."""
    cfg = _config(tmp_path, gpus=2, tp_size=4)
    checks = {c.name: c for c in await run_preflight(cfg, SimulatedProbe(cfg.gpu.sim_dir), listeners=listeners)}
    assert not checks["gpu_count"].ok and checks["gpu_count"].permanent

    class LostProbe:
        async def sample(self) -> list:
            raise GpuProbeError("nvml: GPU 0: NVMLError_GpuIsLost: GPU is lost", lost=True)

        async def aclose(self) -> None:
            return None

    checks = {c.name: c for c in await run_preflight(cfg, LostProbe(), listeners=listeners)}
    assert checks["gpu_count"].permanent and "GpuIsLost" in checks["gpu_count"].detail


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def fake_python(where: Path, sglang: str | None) -> Path:
    """An executable ``python`` in ``where`` that is this interpreter with a ``sglang``
    distribution of version ``sglang`` in its metadata (None: no sglang at all)."""
    where.mkdir(parents=True, exist_ok=True)
    site = where / "site"
    if sglang is not None:
        info = site / f"sglang-{sglang}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {sglang}\n")
    python = where / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def _cmd(python: Path | str) -> tuple[str, ...]:
    return (str(python), "-m", "sglang.launch_server")


def test_cli_passes_and_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`preflight` prints one table line per check and exits 0 when everything passes."""
    python = fake_python(tmp_path / "venv", TESTED_SGLANG)
    cfg = _config(tmp_path, gpus=1, model_path="moonshotai/Kimi-K2.5", command=_cmd(python))
    assert run(_args(), cfg) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["gpu_count", "host_ram", "port", "model_path",
                                                     "server_command", "sglang"]
    assert all(line.split()[1] == "ok" for line in out[1:])
    assert out[-1].split(None, 2)[2] == f"SGLang {TESTED_SGLANG} (the release tested)"


def _checks(cfg: Config, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, dict[str, object]]]:
    code = run(_args("--json"), cfg)
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}


@pytest.mark.parametrize(
    ("command", "words"),
    [(("/nonexistent/venv/bin/python", "-m", "sglang.launch_server"), "/nonexistent/venv/bin/python: does not exist"),
     (("no-such-sglang-launcher-here",), "no-such-sglang-launcher-here: is not on PATH")],
)
def test_cli_fails_on_a_server_command_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: tuple[str, ...], words: str,
) -> None:
    """A command that does not exist (a path) or is not on PATH (a name) fails, permanently,
    and its SGLang is not asked for."""
    code, checks = _checks(_config(tmp_path, gpus=1, command=command), capsys)
    assert code == 1
    assert checks["server_command"]["ok"] is False and checks["server_command"]["permanent"] is True
    assert checks["server_command"]["detail"] == f"[server] command {words}"
    assert "sglang" not in checks


def test_cli_fails_on_a_server_command_that_is_not_executable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A command file without the execute bit fails, naming the file."""
    python = fake_python(tmp_path / "venv", TESTED_SGLANG)
    python.chmod(0o644)
    code, checks = _checks(_config(tmp_path, gpus=1, command=_cmd(python)), capsys)
    assert code == 1 and checks["server_command"]["detail"] == f"[server] command {python}: not an executable file"


def test_cli_fails_when_the_server_python_has_no_sglang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's Python cannot import sglang's metadata: a permanent failure naming that Python."""
    python = fake_python(tmp_path / "venv", None)
    code, checks = _checks(_config(tmp_path, gpus=1, command=_cmd(python)), capsys)
    assert code == 1 and checks["server_command"]["ok"] is True
    assert checks["sglang"] == {"name": "sglang", "ok": False, "detail": f"sglang is not installed for {python}",
                                "permanent": True, "warning": False}


def test_cli_warns_about_an_sglang_release_not_tested(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another SGLang release passes with a warning that names the tested one."""
    python = fake_python(tmp_path / "venv", "0.5.20")
    cfg = _config(tmp_path, gpus=1, model_path="moonshotai/Kimi-K2.5", command=_cmd(python))
    assert run(_args(), cfg) == 0
    row = capsys.readouterr().out.splitlines()[-1].split(None, 2)
    assert row[:2] == ["sglang", "warn"]
    assert row[2].startswith(f"SGLang 0.5.20: not the release tested with this supervisor ({TESTED_SGLANG})")


def test_cli_does_not_ask_a_simulator_for_sglang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``python -m`` command whose module is not SGLang's (the simulator) is not asked for SGLang."""
    cfg = _config(tmp_path, gpus=1, command=(sys.executable, "-m", "supervisor.sim.simulator"))
    code, checks = _checks(cfg, capsys)
    assert checks["sglang"]["ok"] is True
    assert checks["sglang"]["detail"] == "not checked: the command runs supervisor.sim.simulator, not SGLang's module"


def test_the_tested_sglang_is_the_pin_and_the_real_tiers_default() -> None:
    """TESTED_SGLANG is the one version: the [sglang] extra pins it and the real tier's setup
    installs it by default."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={TESTED_SGLANG}"]
    assert f'VERSION="${{SGLANG_VERSION:-{TESTED_SGLANG}}}"' in (REPO / "scripts" / "setup-real-sglang").read_text()


def test_cli_json_fails_on_hicache_arithmetic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`preflight --json` exits 1 and carries the host_ram arithmetic when the cache cannot fit."""
    cfg = _config(tmp_path, tp_size=8, hicache_size_gb=300)
    assert run(_args("--json"), cfg) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    ram = next(c for c in report["checks"] if c["name"] == "host_ram")
    assert ram["ok"] is False and ram["permanent"] is True and "= 2400 GB" in ram["detail"]


@pytest.mark.usefixtures("no_leftovers")
def test_cli_port_held_by_our_stale_server_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spawn: Spawn  # noqa: F811
) -> None:
    """A stale server process of ours (it carries this config's mark) listening on the port does
    not fail preflight: it is cleared before launch."""
    from supervisor.adapters.cleanup import instance_id

    cfg = _config(tmp_path, gpus=1, command=_cmd(fake_python(tmp_path / "venv", TESTED_SGLANG)))
    stale = spawn("", port=cfg.server.port, mark=instance_id(cfg.state.dir))
    assert run(_args("--json"), cfg) == 0
    port = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "port")
    assert port["ok"] and f"pid {stale.pid}" in port["detail"] and "stale server of ours" in port["detail"]
