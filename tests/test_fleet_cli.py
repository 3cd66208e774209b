"""``sglang-supervisor fleet list|reset`` against a real etcd (tests/etcdlib.py): every record
with its rung and OOMs, a one-line confirmation of what was deleted; bad input is one line
and exit 2, etcd unreachable one line and exit 1, never a traceback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.adapters.etcd import EtcdClient
from supervisor.core.fleet import FleetOom, merge
from tests.conftest import free_port
from tests.etcdlib import EtcdServer, etcd_server  # noqa: F401 - a fixture
from tests.harness import REPO

pytestmark = pytest.mark.integration

PREFIX = "/cli-fleet"
KEY_A = f"{PREFIX}/Qwen_Qwen3-8B/0.5.6/NVIDIA_H100_80GB_HBM3-81559MiB/tp8-dp1-pp1-ep1-n1/0123456789ab"
KEY_B = f"{PREFIX}/Qwen_Qwen3-8B/0.5.23/NVIDIA_H100_80GB_HBM3-81559MiB/tp8-dp1-pp1-ep1-n1/ba9876543210"


def config(tmp: Path, endpoint: str | None) -> Path:
    path = tmp / "kimi.toml"
    etcd = f'[etcd]\nendpoints = ["{endpoint}"]\ntimeout_s = 2.0\n' if endpoint else ""
    path.write_text(f'[server]\nmodel_path = "m"\n{etcd}[fleet]\nprefix = "{PREFIX}"\n[state]\ndir = "{tmp}/state"\n')
    path.chmod(0o644)
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def seed(endpoint: str) -> None:
    """Two records as daemons would leave them, and a key of someone else's outside the prefix."""
    a = merge(None, KEY_A, [FleetOom(0.93, 0.88, "2026-01-02T03:04:05.000Z", "cuda_oom_runtime", "tp8", "qwen",
                                     host="gpu-3")], "2026-01-02T03:04:06.000Z")
    b = merge(None, KEY_B, [FleetOom(0.88, 0.85, "2026-01-03T00:00:00.000Z", "headroom_low", "tp8", "qwen",
                                     host="gpu-9")], "2026-01-03T00:00:01.000Z")

    async def go() -> None:
        client = EtcdClient([endpoint], timeout_s=5.0)
        try:
            await client.put(KEY_A, a.to_json())
            await client.put(KEY_B, b.to_json())
            await client.put("/elsewhere/keep-me", b"1")
        finally:
            await client.aclose()

    asyncio.run(go())


def keys_left(endpoint: str) -> list[str]:
    async def go() -> list[str]:
        client = EtcdClient([endpoint], timeout_s=5.0)
        try:
            found, _ = await client.get_prefix("/")
            return sorted(kv.key for kv in found)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_list_shows_every_record_with_its_rung_and_ooms(tmp_path, etcd_server):  # noqa: F811
    cfg = config(tmp_path, etcd_server.endpoint)
    empty = cli("fleet", "list", "--config", str(cfg))
    assert empty.returncode == 0 and f"no fleet records under {PREFIX}/" in empty.stdout
    seed(etcd_server.endpoint)
    text = cli("fleet", "list", "--config", str(cfg))
    assert text.returncode == 0, text.stderr
    assert KEY_A in text.stdout and KEY_B in text.stdout and "/elsewhere" not in text.stdout
    assert "lowest fraction: 0.88" in text.stdout and "0.93 -> 0.88  cuda_oom_runtime  on gpu-3/tp8 (qwen)" in text.stdout
    assert "2026-01-02T03:04:05.000Z" in text.stdout
    data = json.loads(cli("fleet", "list", "--config", str(cfg), "--json").stdout)
    by_key = {r["key"]: r for r in data["records"]}
    assert by_key[KEY_B]["rung"] == 0.85 and by_key[KEY_B]["ooms"][0]["host"] == "gpu-9"


def test_reset_one_key_then_all_says_what_it_deleted(tmp_path, etcd_server):  # noqa: F811
    cfg = config(tmp_path, etcd_server.endpoint)
    seed(etcd_server.endpoint)
    one = cli("fleet", "reset", "--config", str(cfg), "--key", KEY_A)
    assert one.returncode == 0 and one.stdout == f"fleet reset: deleted the record {KEY_A}\n"
    assert keys_left(etcd_server.endpoint) == sorted(["/elsewhere/keep-me", KEY_B])
    again = cli("fleet", "reset", "--config", str(cfg), "--key", KEY_A)
    assert again.returncode == 1 and "no record at" in one_line(again)
    everything = cli("fleet", "reset", "--config", str(cfg), "--all")
    assert everything.returncode == 0 and everything.stdout == f"fleet reset: deleted 1 record(s) under {PREFIX}/\n"
    assert keys_left(etcd_server.endpoint) == ["/elsewhere/keep-me"]  # nothing outside the prefix


def test_bad_input_is_one_line_and_exit_2(tmp_path, etcd_server):  # noqa: F811
    cfg = config(tmp_path, etcd_server.endpoint)
    for args, says in (
        (("--key", "/elsewhere/keep-me"), "not a fleet record's key"),
        (("--key", PREFIX + "/"), "not a fleet record's key"),
        (("--key", KEY_A, "--all"), "not allowed with argument"),
        ((), "one of the arguments --key --all is required"),
    ):
        r = cli("fleet", "reset", "--config", str(cfg), *args)
        assert r.returncode == 2 and says in one_line(r), (args, r.stderr)
    (tmp_path / "none").mkdir()
    r = cli("fleet", "list", "--config", str(config(tmp_path / "none", None)))
    assert r.returncode == 2 and "[etcd] endpoints: missing" in one_line(r)
    r = cli("fleet", "--config", str(cfg))
    assert r.returncode == 2 and one_line(r)
    assert keys_left(etcd_server.endpoint) == []


def test_etcd_unreachable_is_one_line_and_exit_1(tmp_path):
    cfg = config(tmp_path, f"127.0.0.1:{free_port()}")
    for args in (("list",), ("list", "--json"), ("reset", "--all"), ("reset", "--key", KEY_A)):
        r = cli("fleet", args[0], "--config", str(cfg), *args[1:])
        assert r.returncode == 1 and r.stdout == "", (args, r.stdout)
        line = one_line(r)
        assert f"fleet {args[0]}:" in line and "127.0.0.1" in line, line


def test_list_and_reset_into_a_closed_pipe_end_quietly(tmp_path, etcd_server):  # noqa: F811
    """``fleet list | head -1``: exit 141, nothing on stderr (tests/test_cli_pipe.py for the rest)."""
    from tests.test_cli_pipe import assert_quiet, into_closed_pipe

    cfg = config(tmp_path, etcd_server.endpoint)
    seed(etcd_server.endpoint)
    assert_quiet(into_closed_pipe("fleet", "list", "--config", str(cfg)))
    assert_quiet(into_closed_pipe("fleet", "list", "--config", str(cfg), "--json"))
    assert_quiet(into_closed_pipe("fleet", "reset", "--config", str(cfg), "--all"))
    assert keys_left(etcd_server.endpoint) == ["/elsewhere/keep-me"]  # the reset was done before its line failed
