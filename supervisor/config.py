"""The configuration: one TOML file, validated into frozen dataclasses.

Every section is a dataclass whose fields are the TOML keys; a field's type and its
``rule`` metadata define what is accepted. Unknown keys and bad values raise
``ConfigError`` with one line naming the key, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_COMMAND = ("python", "-m", "sglang.launch_server")
DEFAULT_LADDER = (0.93, 0.88, 0.85, 0.82, 0.80)


class ConfigError(ValueError):
    """A config that cannot be used; ``str()`` is the one line shown to the user."""


def _rule(text: str, check: Any = None) -> dict[str, Any]:
    return {"rule": text, "check": check}


def _port(v: int) -> bool:
    return 0 <= v <= 65535


def _positive(v: float) -> bool:
    return v > 0 and math.isfinite(v)


def _non_negative(v: float) -> bool:
    return v >= 0 and math.isfinite(v)


def _fraction(v: float) -> bool:
    return 0.0 < v < 1.0


def _share(v: float) -> bool:
    return 0.0 <= v <= 1.0


def _listen(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return bool(sep and host and port.isdigit() and _port(int(port)))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    command: tuple[str, ...] = field(
        default=DEFAULT_COMMAND,
        metadata=_rule("a non-empty list of strings (argv prefix)", lambda v: len(v) > 0),
    )
    model_path: str = field(default="", metadata=_rule("a non-empty string", lambda v: bool(v)))
    host: str = field(default="127.0.0.1", metadata=_rule("a host name or address", bool))
    port: int = field(default=30000, metadata=_rule("an integer 1..65535", lambda v: 1 <= v <= 65535))
    tp_size: int = field(default=1, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    dp_size: int = field(default=1, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    mem_fraction_static: float | None = field(
        default=None, metadata=_rule("a number between 0 and 1 (exclusive)", _fraction)
    )
    hicache_size_gb: int = field(
        default=0, metadata=_rule("an integer >= 0 (GB per TP rank; 0 = off)", lambda v: v >= 0)
    )
    extra_args: tuple[str, ...] = field(default=(), metadata=_rule("a list of strings"))
    env: dict[str, str] = field(default_factory=dict, metadata=_rule("a table of strings"))
    # Names of variables passed through from the daemon's environment (besides `env`).
    pass_env: tuple[str, ...] = field(
        default=("PATH", "HOME", "LANG", "LC_ALL", "TZ", "CUDA_VISIBLE_DEVICES", "HF_HOME",
                 "HF_HUB_OFFLINE", "TRANSFORMERS_CACHE", "VIRTUAL_ENV", "PYTHONPATH"),
        metadata=_rule("a list of environment variable names"),
    )
    cwd: str = field(default="", metadata=_rule("a directory path (empty = the state dir)"))
    stop_grace_s: float = field(
        default=60.0, metadata=_rule("a number of seconds > 0", _positive)
    )


@dataclass(frozen=True, slots=True)
class HealthConfig:
    path: str = field(default="/health", metadata=_rule("a path starting with /", lambda v: v.startswith("/")))
    interval_s: float = field(default=10.0, metadata=_rule("seconds > 0", _positive))
    # SGLang's own /health timeout is 20 s and a healthy answer takes ~1 s: stay above 20.
    timeout_s: float = field(default=30.0, metadata=_rule("seconds > 0", _positive))
    failures: int = field(default=3, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    startup_timeout_s: float = field(default=1800.0, metadata=_rule("seconds > 0", _positive))
    startup_poll_s: float = field(default=2.0, metadata=_rule("seconds > 0", _positive))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    fraction_ladder: tuple[float, ...] = field(
        default=DEFAULT_LADDER,
        metadata=_rule(
            "a non-empty, strictly decreasing list of numbers between 0 and 1",
            lambda v: len(v) > 0
            and all(_fraction(x) for x in v)
            and all(a > b for a, b in zip(v, v[1:], strict=False)),
        ),
    )
    backoff_initial_s: float = field(default=10.0, metadata=_rule("seconds >= 0", _non_negative))
    backoff_factor: float = field(default=2.0, metadata=_rule("a number >= 1", lambda v: v >= 1 and math.isfinite(v)))
    backoff_max_s: float = field(default=300.0, metadata=_rule("seconds >= 0", _non_negative))
    backoff_jitter: float = field(default=0.1, metadata=_rule("a share between 0 and 1", _share))
    stable_after_s: float = field(default=600.0, metadata=_rule("seconds > 0", _positive))
    max_crashes: int = field(default=5, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    crash_window_s: float = field(default=3600.0, metadata=_rule("seconds > 0", _positive))
    hicache_min_gb: int = field(default=8, metadata=_rule("an integer >= 1", lambda v: v >= 1))


@dataclass(frozen=True, slots=True)
class GpuConfig:
    backend: str = field(
        default="none",
        metadata=_rule('one of "nvml", "simulated", "none"', lambda v: v in ("nvml", "simulated", "none")),
    )
    indices: tuple[int, ...] = field(default=(), metadata=_rule("a list of GPU indices >= 0", lambda v: all(i >= 0 for i in v)))
    sim_dir: str = field(default="", metadata=_rule("a directory path (for backend = simulated)"))
    interval_s: float = field(default=2.0, metadata=_rule("seconds > 0", _positive))
    call_timeout_s: float = field(default=5.0, metadata=_rule("seconds > 0", _positive))
    # After a crash a GPU counts as free when this share of its memory is free again.
    free_share_min: float = field(default=0.9, metadata=_rule("a share between 0 and 1", _share))
    release_timeout_s: float = field(default=120.0, metadata=_rule("seconds > 0", _positive))
    kill_foreign: bool = field(default=False, metadata=_rule("true or false"))
    low_free_warn_gb: float = field(default=1.0, metadata=_rule("GB >= 0", _non_negative))
    headroom_min_gb: float = field(default=2.0, metadata=_rule("GB >= 0", _non_negative))
    headroom_action: str = field(
        default="step_down",
        metadata=_rule('one of "step_down", "warn"', lambda v: v in ("step_down", "warn")),
    )
    host_ram_margin_gb: float = field(default=32.0, metadata=_rule("GB >= 0", _non_negative))


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    enabled: bool = field(default=True, metadata=_rule("true or false"))
    listen: str = field(default="127.0.0.1:9188", metadata=_rule('"HOST:PORT"', _listen))


@dataclass(frozen=True, slots=True)
class MqttConfig:
    enabled: bool = field(default=False, metadata=_rule("true or false"))
    host: str = field(default="127.0.0.1", metadata=_rule("a host name or address", bool))
    port: int = field(default=1883, metadata=_rule("an integer 1..65535", lambda v: 1 <= v <= 65535))
    client_id: str = field(default="", metadata=_rule("a string (empty = sglang-supervisor-HOST-INSTANCE)"))
    username: str = field(default="", metadata=_rule("a string"))
    password_file: str = field(default="", metadata=_rule("a file path (never an inline password)"))
    tls: bool = field(default=False, metadata=_rule("true or false"))
    tls_ca_file: str = field(default="", metadata=_rule("a file path"))
    tls_cert_file: str = field(default="", metadata=_rule("a file path"))
    tls_key_file: str = field(default="", metadata=_rule("a file path"))
    tls_insecure: bool = field(default=False, metadata=_rule("true or false"))
    keepalive_s: int = field(default=30, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    qos: int = field(default=1, metadata=_rule("0, 1 or 2", lambda v: v in (0, 1, 2)))
    topic_prefix: str = field(
        default="sglang-supervisor",
        metadata=_rule("a topic without wildcards", lambda v: bool(v) and not any(c in v for c in "+#")),
    )
    instance: str = field(default="", metadata=_rule("a name (empty = the config file's stem)"))
    outbox_size: int = field(default=1000, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    connect_timeout_s: float = field(default=10.0, metadata=_rule("seconds > 0", _positive))
    reconnect_initial_s: float = field(default=1.0, metadata=_rule("seconds > 0", _positive))
    reconnect_max_s: float = field(default=60.0, metadata=_rule("seconds > 0", _positive))
    evidence_max_chars: int = field(default=2000, metadata=_rule("an integer >= 80", lambda v: v >= 80))


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    format: str = field(
        default="auto",
        metadata=_rule('one of "auto", "json", "console"', lambda v: v in ("auto", "json", "console")),
    )
    level: str = field(
        default="info",
        metadata=_rule('one of "debug", "info", "warning", "error"', lambda v: v in ("debug", "info", "warning", "error")),
    )
    server_log: str = field(default="", metadata=_rule("a file path (empty = STATE_DIR/server.log)"))
    server_log_max_bytes: int = field(default=256 * 1024 * 1024, metadata=_rule("bytes >= 4096", lambda v: v >= 4096))
    server_log_backups: int = field(default=5, metadata=_rule("an integer >= 0", lambda v: v >= 0))
    tail_bytes: int = field(default=4 * 1024 * 1024, metadata=_rule("bytes >= 4096", lambda v: v >= 4096))
    kernel_log: str = field(default="", metadata=_rule("a file path with kernel messages (empty = none)"))


@dataclass(frozen=True, slots=True)
class StateConfig:
    dir: str = field(default="/var/lib/sglang-supervisor", metadata=_rule("a directory path", bool))


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    state: StateConfig = field(default_factory=StateConfig)
    # Not a TOML key: the stem of the file it came from ("kimi" for kimi.toml).
    name: str = "supervisor"
