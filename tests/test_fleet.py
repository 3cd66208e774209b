"""The fleet-memory key (supervisor/core/fleet.py) and the SGLang version probe
(supervisor/adapters/versions.py) that feeds it.

Servers share a record only when everything that decides their memory use is equal: any
such difference must give another key, anything else (a log level, a port) the same one.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.adapters.versions import VersionError, server_python, sglang_version
from supervisor.core.fleet import FLEET_PREFIX, fleet_identity, fleet_key, parse_flags

H100 = 85_520_809_984  # NVML's total for an H100 80GB HBM3: 81559 MiB
BASE: dict[str, Any] = {
    "model": "/models/Qwen/Qwen3-8B",
    "sglang_version": "0.5.6",
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "gpu_memory_bytes": H100,
    "tp": 8,
    "dp": 1,
    "extra_args": ("--context-length", "32768", "--kv-cache-dtype", "fp8_e5m2", "--log-level", "info"),
}


def key(**changes: Any) -> str:
    return fleet_key(fleet_identity(**{**BASE, **changes}))


def test_the_same_configuration_gives_the_same_readable_key() -> None:
    assert key() == key()
    assert re.fullmatch(
        r"/sglang-supervisor/fleet/models_Qwen_Qwen3-8B/0\.5\.6/NVIDIA_H100_80GB_HBM3-81559MiB/"
        r"tp8-dp1-pp1-ep1-n1/[0-9a-f]{12}", key()), key()


RELEVANT = {
    "model": {"model": "Qwen/Qwen3-8B"},
    "sglang version": {"sglang_version": "0.5.7"},
    "gpu name": {"gpu_name": "NVIDIA H200"},
    "gpu memory": {"gpu_memory_bytes": H100 // 2},
    "tp": {"tp": 4},
    "dp": {"dp": 2},
    "pp": {"pp": 2},
    "ep": {"ep": 8},
    "nnodes": {"nnodes": 2},
    "host cache": {"hicache_size_gb": 64},
}
FLAGS = [
    ("--quantization", "fp8"), ("--kv-cache-dtype", "auto"), ("--context-length", "8192"),
    ("--max-running-requests", "64"), ("--chunked-prefill-size", "4096"), ("--cuda-graph-bs", "1 2 4 8"),
    ("--cuda-graph-max-bs", "160"), ("--disable-cuda-graph", ""), ("--speculative-algorithm", "EAGLE3"),
    ("--speculative-num-steps", "3"), ("--speculative-num-draft-tokens", "4"), ("--speculative-eagle-topk", "1"),
    ("--speculative-draft-model-path", "/models/draft"), ("--attention-backend", "fa3"),
    ("--hicache-ratio", "2"), ("--max-total-tokens", "100000"), ("--dtype", "bfloat16"),
    ("--enable-dp-attention", ""), ("--pp-size", "2"), ("--ep-size", "8"), ("--nnodes", "2"),
]


@pytest.mark.parametrize("change", RELEVANT.values(), ids=RELEVANT.keys())
def test_each_relevant_difference_gives_another_key(change: dict[str, Any]) -> None:
    assert key(**change) != key()


@pytest.mark.parametrize(("flag", "value"), FLAGS, ids=[f for f, _ in FLAGS])
def test_each_memory_flag_gives_another_key(flag: str, value: str) -> None:
    assert key(extra_args=(*BASE["extra_args"], flag, *value.split())) != key()


def test_flags_that_do_not_change_memory_keep_the_key() -> None:
    noise = ("--log-level", "debug", "--enable-metrics", "--served-model-name", "qwen", "--api-key", "k",
             "--trust-remote-code", "--watchdog-timeout", "600", "--random-seed", "1")
    assert key(extra_args=(*noise, *BASE["extra_args"], "--log-requests")) == key()


def test_a_flag_spelled_differently_is_the_same_flag() -> None:
    """``--flag=value``, argparse abbreviations, batch-size order, and the last occurrence
    winning: each says the same to SGLang, so each gives the same key."""
    plain = key(extra_args=("--context-length", "8192", "--cuda-graph-bs", "1", "2", "8", "--kv-cache-dtype",
                            "fp8_e5m2"))
    assert key(extra_args=("--context-length=8192", "--cuda-graph-bs", "8", "2", "1", "--kv-cache-dtype",
                           "fp8_e5m2")) == plain
    assert key(extra_args=("--context-len", "8192", "--cuda-graph-bs", "2", "1", "8", "--kv-cache-d",
                           "fp8_e5m2")) == plain
    assert key(extra_args=("--context-length", "4096", "--kv-cache-dtype", "fp8_e5m2", "--cuda-graph-bs", "1",
                           "2", "8", "--context-length", "8192")) == plain


def test_layout_in_extra_args_equals_layout_given() -> None:
    assert key(extra_args=(*BASE["extra_args"], "--pp-size", "2", "--nnodes", "2")) == key(pp=2, nnodes=2)
    assert "/tp8-dp1-pp2-ep1-n2/" in key(pp=2, nnodes=2)


def test_parse_flags_reads_only_known_flags() -> None:
    assert parse_flags(["--speculative-algorithm", "EAGLE", "--disable-cuda-graph", "--port", "30000",
                        "--quantization=fp8", "positional", "--"]) == {
        "speculative-algorithm": "EAGLE", "disable-cuda-graph": "true", "quantization": "fp8"}


@given(model=st.text(max_size=300), version=st.text(max_size=40), gpu=st.text(max_size=80))
def test_every_key_is_one_etcd_path_of_safe_segments(model: str, version: str, gpu: str) -> None:
    k = key(model=model, sglang_version=version, gpu_name=gpu)
    assert k.startswith(FLEET_PREFIX + "/")
    segments = k[len(FLEET_PREFIX) + 1:].split("/")
    assert len(segments) == 5
    assert all(re.fullmatch(r"[A-Za-z0-9._-]{1,80}", s) for s in segments), k


# -- the SGLang version, read from the server's Python ---------------------------------------


def test_a_python_without_sglang_is_one_clear_line() -> None:
    """The daemon's own venv has no SGLang: the probe says so and names the Python."""
    with pytest.raises(VersionError) as caught:
        sglang_version(sys.executable)
    assert str(caught.value) == f"sglang is not installed for {sys.executable}"


def test_a_missing_python_and_a_slow_one_fail_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(VersionError, match=r"^reading the sglang version with /nonexistent/python: "):
        sglang_version("/nonexistent/python")
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(VersionError, match=r"no answer within 0\.5 s$"):
        sglang_version(str(slow), timeout_s=0.5)


def test_the_version_comes_from_the_package_metadata(tmp_path: Path) -> None:
    """A Python whose path holds an sglang distribution (metadata only, nothing importable)
    reports its version: sglang is never imported."""
    dist = tmp_path / "site" / "sglang-9.8.7.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.8.7\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    assert sglang_version(sys.executable, env=env) == "9.8.7"


def test_server_python_reads_the_command(tmp_path: Path) -> None:
    assert server_python(["/venv/bin/python3", "-m", "sglang.launch_server"]) == "/venv/bin/python3"
    script = tmp_path / "sglang"
    script.write_text("#!/opt/venv/bin/python3.11\nimport sys\n")
    assert server_python([str(script), "serve"]) == "/opt/venv/bin/python3.11"
    script.write_text("#!/usr/bin/env python3\n")
    assert server_python([str(script)]) == "python3"
    script.write_bytes(b"\x7fELF")
    with pytest.raises(VersionError, match="neither a Python nor a script"):
        server_python([str(script)])
    with pytest.raises(VersionError, match="not on PATH"):
        server_python(["no-such-sglang-launcher"])
