"""The configuration: one TOML file, validated into frozen dataclasses.

Every section is a dataclass whose fields are the TOML keys; a field's type and its
``rule`` metadata define what is accepted. Unknown keys and bad values raise
``ConfigError`` with one line naming the key, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.core.diagnosis.site_rules import SITE_CAUSES, pattern_problem
from supervisor.core.fleet import FLEET_PREFIX
from supervisor.core.model import Cause, Phase, SiteRule

DEFAULT_COMMAND = ("python", "-m", "sglang.launch_server")
DEFAULT_LADDER = (0.93, 0.88, 0.85, 0.82, 0.80)
# What SGLang and its libraries read from the environment: tokens, NCCL and SGLang knobs,
# the CUDA allocator and device selection, the dynamic loader. Nothing else leaks through.
DEFAULT_PASS_ENV = (
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN",
    "TRANSFORMERS_CACHE", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_*", "NCCL_*", "SGLANG_*",
)


class ConfigError(ValueError):
    """A config that cannot be used; ``str()`` is the one line shown to the user.

    Keys and values come from the user's file, so control characters are escaped here:
    whatever the input, the message stays one printable line.
    """

    def __init__(self, message: str) -> None:
        line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        super().__init__(line if len(line) <= 400 else line[:397] + "...")


def _rule(text: str, check: Any = None) -> dict[str, Any]:
    return {"rule": text, "check": check}


def _port(v: int) -> bool:
    return 0 <= v <= 65535


def _positive(v: float) -> bool:
    return v > 0 and math.isfinite(v)


def _non_negative(v: float) -> bool:
    return v >= 0 and math.isfinite(v)


def _url(v: str) -> bool:
    return v == "" or (v.startswith(("http://", "https://")) and len(v) > len("https://") and not any(c.isspace() for c in v))


WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def http_url(host: str, port: int, path: str = "") -> str:
    """The URL to reach a local listener bound to ``host``: a wildcard bind is reached on
    the loopback."""
    return f"http://{url_host('127.0.0.1' if host in WILDCARDS else host)}:{port}{path}"


def worker_url(cfg: Config) -> str:
    """The URL the router uses for this daemon's server."""
    if cfg.router.worker_url:
        return cfg.router.worker_url.rstrip("/")
    return http_url(cfg.server.host, cfg.server.port)


def _fraction(v: float) -> bool:
    return 0.0 < v < 1.0


def _share(v: float) -> bool:
    return 0.0 <= v <= 1.0


def _listen(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return bool(sep and host and port.isdigit() and _port(int(port)))


def _unit_name(v: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # The server's name in metrics (label ``server``), alerts, ``status`` and ``restart
    # --server``; with several ``[[server]]`` entries also its state directory's name.
    # Empty = the config file's stem.
    name: str = field(default="", metadata=_rule("a name of letters, digits, '.', '_' or '-' (at most 63)",
                                                 lambda v: v == "" or _unit_name(v)))
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
    # Shell-style patterns (``NCCL_*``) are matched against the daemon's own variables.
    pass_env: tuple[str, ...] = field(
        default=DEFAULT_PASS_ENV,
        metadata=_rule("a list of environment variable names or patterns such as NCCL_*"),
    )
    cwd: str = field(default="", metadata=_rule("a directory path (empty = the state dir)"))
    # A planned stop: SIGTERM to SGLang's main process only (it drains its requests), then the
    # whole group is killed after this many seconds. Also the bound on SGLang's own teardown
    # after one of its processes died (it sleeps 5 s before it kills its tree).
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
    # A hard cap on a start: a first boot with DeepGEMM JIT takes 10-20 min on its own.
    startup_timeout_s: float = field(default=7200.0, metadata=_rule("seconds > 0", _positive))
    # A start that still prints lines is making progress; this long without a new line is not.
    startup_silence_s: float = field(default=600.0, metadata=_rule("seconds > 0", _positive))
    # On a hang SGLang gets SIGQUIT first (it dumps its stacks into its log), this long to
    # exit, then the group is killed. SGLang waits 60 s for CUDA coredumps unless
    # SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0.
    hang_dump_wait_s: float = field(default=15.0, metadata=_rule("seconds >= 0", _non_negative))
    startup_poll_s: float = field(default=2.0, metadata=_rule("seconds > 0", _positive))


def _window(text: str) -> tuple[int, int] | None:
    """``[policy] climb_window`` as (start, end) minutes after local midnight; (0, 0) for ""
    (any time); None when malformed. An end before the start wraps past midnight."""
    if text == "":
        return (0, 0)
    parts = text.split("-")
    if len(parts) != 2:
        return None
    out = []
    for part in parts:
        hh, sep, mm = part.strip().partition(":")
        if not (sep and hh.isdigit() and mm.isdigit() and int(hh) < 24 and int(mm) < 60):
            return None
        out.append(int(hh) * 60 + int(mm))
    return (out[0], out[1]) if out[0] != out[1] else None


def in_window(text: str, minute: int) -> bool:
    """Whether ``minute`` (after local midnight) lies in ``[policy] climb_window``."""
    window = _window(text)
    if window is None or window == (0, 0):
        return window is not None
    start, end = window
    return start <= minute < end if start < end else minute >= start or minute < end


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
    # The climb back up (docs/capacity.md): off unless asked for.
    climb: bool = field(default=False, metadata=_rule("true or false"))
    climb_step: float = field(default=0.01, metadata=_rule("a share between 0.001 and 0.1", lambda v: 0.001 <= v <= 0.1))
    climb_margin_gb: float = field(default=1.0, metadata=_rule("GB >= 0", _non_negative))
    climb_ceiling: float = field(
        default=0.0, metadata=_rule("0 (the ladder's top) or a number between 0 and 1", lambda v: v == 0 or _fraction(v)),
    )
    climb_window: str = field(default="", metadata=_rule('"" (any time) or "HH:MM-HH:MM", local time', lambda v: _window(v) is not None))
    climb_interval_s: float = field(default=3600.0, metadata=_rule("seconds > 0", _positive))
    probation_s: float = field(default=1800.0, metadata=_rule("seconds > 0", _positive))
    kv_pressure_every_s: float = field(default=60.0, metadata=_rule("seconds > 0", _positive))
    kv_usage_high: float = field(default=0.95, metadata=_rule("a share between 0 and 1", _share))


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
    # After a crash a GPU counts as free when this share of its memory is free again. An idle
    # card shows < 1 % used and an orphan ~70 %; 5 % still hidden would come out of the KV pool.
    free_share_min: float = field(default=0.95, metadata=_rule("a share between 0 and 1", _share))
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
    # The last output kept in memory for diagnosis: ~10 s of a server logging 2,000 lines/s,
    # far more than the tracebacks of 8 ranks; the full log is on disk.
    tail_bytes: int = field(default=2 * 1024 * 1024, metadata=_rule("bytes >= 4096", lambda v: v >= 4096))
    kernel_log: str = field(default="", metadata=_rule("a file path with kernel messages (empty = none)"))
    # The cgroup v2 ``memory.events`` whose ``oom_kill`` count tells a host OOM kill from a
    # plain SIGKILL (readable under the hardened unit, unlike the kernel log). Empty = the
    # daemon's own cgroup's, found through /proc/self/cgroup; "off" = never read.
    memory_events: str = field(default="", metadata=_rule('a file path, "" (own cgroup) or "off"'))


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """SGLang's router (``sglang-router``) in front of the server: the daemon registers the
    server once it is READY and removes it the moment it dies, before any planned stop and
    before a hung server is killed (docs/router.md)."""

    enabled: bool = False
    url: str = field(default="", metadata=_rule("the router's URL, http(s)://HOST:PORT", _url))
    # A file holding the router's control-plane key (--control-plane-api-keys id:name:admin:KEY),
    # sent as a bearer token; read once at start, never logged.
    token_file: str = field(default="", metadata=_rule("a file path (empty = no token)"))
    # How the router reaches this server; empty = http://[server] host:port (0.0.0.0 -> 127.0.0.1).
    worker_url: str = field(default="", metadata=_rule("a URL, http(s)://HOST:PORT", _url))
    timeout_s: float = field(default=5.0, metadata=_rule("seconds > 0", _positive))
    # How long a planned stop waits for the removal before it signals the server anyway.
    remove_wait_s: float = field(default=5.0, metadata=_rule("seconds > 0", _positive))
    # How often the router's view is compared with ours (re-adding after a router restart,
    # removing what should not be there); failed calls retry sooner, on the backoff.
    reconcile_s: float = field(default=10.0, metadata=_rule("seconds > 0", _positive))


def _endpoints(v: tuple[str, ...]) -> bool:
    return all(bool(e) and not any(c.isspace() for c in e) for e in v)


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    """The etcd cluster that ``[group]`` and ``[fleet]`` use (the only coordinator between
    daemons). Not read, and its client never imported, unless one of them is on."""

    endpoints: tuple[str, ...] = field(
        default=(), metadata=_rule('a list of "HOST:PORT" or "http(s)://HOST:PORT"', _endpoints))
    timeout_s: float = field(default=5.0, metadata=_rule("seconds > 0", _positive))
    ca_file: str = field(default="", metadata=_rule("a file path (TLS: the CA that signed etcd's certificate)"))
    cert_file: str = field(default="", metadata=_rule("a file path (TLS client certificate)"))
    key_file: str = field(default="", metadata=_rule("a file path (TLS client key)"))
    username: str = field(default="", metadata=_rule("a string (etcd authentication)"))
    password_file: str = field(default="", metadata=_rule("a file path (never an inline password)"))


def _hostport(v: str) -> bool:
    host, sep, port = v.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535)


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """One node of SGLang across nodes (``--nnodes``): this daemon owns rank ``node_rank``;
    a leader among the group's daemons, elected in etcd (``[etcd]``), decides each
    generation's managed flags, and the group dies and relaunches as one (docs/group.md)."""

    name: str = field(default="", metadata=_rule("a group name of letters, digits, '.', '_' or '-'",
                                                 lambda v: v == "" or _unit_name(v)))
    node_rank: int = field(default=0, metadata=_rule("an integer >= 0", lambda v: v >= 0))
    nnodes: int = field(default=1, metadata=_rule("an integer >= 1", lambda v: v >= 1))
    dist_init_addr: str = field(default="", metadata=_rule('"HOST:PORT" of node 0\'s rendezvous', lambda v: v == "" or _hostport(v)))
    # A lease of at least 10 s: keep-alives compete with two spinning schedulers for 2 cores.
    lease_ttl_s: int = field(default=15, metadata=_rule("an integer >= 10 (seconds)", lambda v: v >= 10))

    @property
    def enabled(self) -> bool:
        return bool(self.name)


def _etcd_prefix(v: str) -> bool:
    return v.startswith("/") and len(v.rstrip("/")) > 0 and not any(c.isspace() for c in v)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Fleet memory (docs/fleet.md): the ladder's lessons shared in etcd (``[etcd]``) by
    every daemon running the same configuration on the same GPU and SGLang version."""

    enabled: bool = field(default=False, metadata=_rule("true or false"))
    prefix: str = field(default=FLEET_PREFIX, metadata=_rule('an etcd key prefix starting with "/"', _etcd_prefix))


def _time_of_day(v: str) -> bool:
    if v == "":
        return True
    hh, sep, mm = v.partition(":")
    return bool(sep) and hh.isdigit() and mm.isdigit() and len(mm) == 2 and int(hh) < 24 and int(mm) < 60


def _zone_name(v: str) -> bool:
    """"" (the host's zone) or an IANA zone this host's tz database knows."""
    if v == "":
        return True
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo(v)
    except (KeyError, ValueError, OSError):  # ZoneInfoNotFoundError is a KeyError
        return False
    return True


@dataclass(frozen=True, slots=True)
class ReportConfig:
    """The morning report's data (docs/report.md): the daemon's journal of notable events and
    a ring of GPU memory samples in each server's state directory, and the daily summary."""

    enabled: bool = field(default=True, metadata=_rule("true or false"))
    # One GPU memory record (the least free memory of each rank since the last one) per
    # gpu_sample_s, kept keep_days: 10,080 records of 8 ranks, 403 KB, by default.
    gpu_sample_s: float = field(default=60.0, metadata=_rule("seconds >= 1", lambda v: v >= 1))
    keep_days: float = field(default=7.0, metadata=_rule("days > 0 (at most 366)", lambda v: 0 < v <= 366))
    journal_max_bytes: int = field(default=4 * 1024 * 1024, metadata=_rule("bytes >= 65536", lambda v: v >= 65536))
    journal_backups: int = field(default=3, metadata=_rule("an integer >= 0", lambda v: v >= 0))
    # A daily summary alert over MQTT at this local time ("08:30"); "" = none.
    daily_at: str = field(default="", metadata=_rule('"HH:MM" (24 h, local time) or ""', _time_of_day))
    timezone: str = field(default="", metadata=_rule('an IANA zone this host knows ("Europe/Paris"); "" = the host\'s', _zone_name))


@dataclass(frozen=True, slots=True)
class DiagnosisConfig:
    """A site's own words (docs/diagnosis.md, "A site's own words"): ``[[diagnosis.rule]]``
    tables, each a bounded regex (``match``) and the ``cause`` it names, with an optional
    ``phase`` and ``certain``; tried on every line of a crash before anything else reads it.
    Built by ``_build_diagnosis`` (the TOML key is ``rule``, an array of tables)."""

    rules: tuple[SiteRule, ...] = ()


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
    router: RouterConfig = field(default_factory=RouterConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    # Not a TOML key: the stem of the file it came from ("kimi" for kimi.toml).
    name: str = "supervisor"
    # Not a TOML key: with several ``[[server]]`` entries, one whole config per server (its
    # own [server], [gpu], [policy], [health], its state directory STATE_DIR/NAME); empty
    # for a single ``[server]``. Read it through ``server_configs``.
    units: tuple[Config, ...] = ()


def server_configs(cfg: Config) -> tuple[Config, ...]:
    """The config of each server this daemon owns: ``[[server]]`` entries, or the one ``[server]``."""
    return cfg.units or (cfg,)


def unit_name(cfg: Config) -> str:
    """A server's name: ``[server] name``, else the config file's stem."""
    return cfg.server.name or cfg.name


def alert_instance(cfg: Config, unit: Config | None = None) -> str:
    """The MQTT instance alerts name: ``[mqtt] instance``, else the config's name; with several
    ``[[server]]`` entries, each server's own (``kimi-tp4-a``) for ``unit``."""
    base = cfg.mqtt.instance or cfg.name
    return f"{base}-{unit_name(unit)}" if unit is not None and cfg.units else base


def select_server(cfg: Config, name: str | None) -> tuple[Config, ...]:
    """The servers ``--server NAME`` picks (all of them for None); an unknown name is a
    ``ConfigError`` naming the known ones."""
    units = server_configs(cfg)
    if name is None:
        return units
    chosen = tuple(u for u in units if unit_name(u) == name)
    if not chosen:
        known = ", ".join(unit_name(u) for u in units)
        raise ConfigError(f"--server {name[:64]!r}: no such server in {cfg.name} (known: {known})")
    return chosen


# --- loading and validation -------------------------------------------------------------

_SECTIONS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(Config).items() if name not in ("name", "units")
}
# What a ``[[server]]`` entry may set for itself, over the top-level section of that name
# (``[server.gpu] indices = [0, 1, 2, 3]`` after ``[[server]]``); None = every key. The
# rest (metrics, MQTT, the state directory, the router's address) belongs to the daemon.
PER_SERVER: dict[str, frozenset[str] | None] = {
    "gpu": None,
    "policy": None,
    "health": None,
    "router": frozenset({"worker_url"}),
    "logging": frozenset({"server_log", "server_log_max_bytes", "server_log_backups", "tail_bytes"}),
}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "a table of strings"
    return {bool: "true/false", int: "integer", float: "number", str: "string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp``, or raise TypeError. No silent string->number casts."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except TypeError:
                continue
        raise TypeError
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise TypeError
        (item_type, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(v, item_type) for v in value)
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise TypeError
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise TypeError
            return float(value)
        raise TypeError
    if tp is str:
        if isinstance(value, str) and "\x00" not in value:
            return value
        raise TypeError
    raise TypeError


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a huge integer, a deeply nested array
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean(word: str, choices: typing.Iterable[str], form: str) -> str:
    """``"; did you mean 'mem_fraction_static'?"`` for the closest known name, else ``""``."""
    close = difflib.get_close_matches(word[:200], list(choices), n=1)
    return f"; did you mean {form.format(close[0])}?" if close else ""


def _build_section(where: str, section: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: [{section}] must be a table, not {_show(raw)}")
    if cls is DiagnosisConfig:
        return _build_diagnosis(where, raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            hint = _did_you_mean(key, fields, "'{}'")
            raise ConfigError(f"{where}: [{section}] {key}: unknown key{hint} (known: {known})")
        meta = fields[key].metadata
        rule = meta.get("rule") or _type_name(hints[key])
        try:
            converted = _coerce(value, hints[key])
        except TypeError:
            raise ConfigError(
                f"{where}: [{section}] {key} = {_show(value)}: must be {rule}"
            ) from None
        check = meta.get("check")
        if check is not None and converted is not None and not check(converted):
            raise ConfigError(f"{where}: [{section}] {key} = {_show(value)}: must be {rule}")
        kwargs[key] = converted
    return cls(**kwargs)


_RULE_KEYS = ("match", "cause", "phase", "certain")
_RULE_EXAMPLE = "e.g. match = 'MyKernelError: .{0,80} failed'"


def _build_diagnosis(where: str, raw: dict[str, Any]) -> DiagnosisConfig:
    """``[diagnosis]``: its one key ``rule``, an array of tables (``[[diagnosis.rule]]``)."""
    for key in raw:
        if key != "rule":
            hint = _did_you_mean(key, ("rule",), "'{}'")
            raise ConfigError(f"{where}: [diagnosis] {key}: unknown key{hint} (known: rule, as [[diagnosis.rule]] tables)")
    entries = raw.get("rule", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{where}: [diagnosis] rule = {_show(entries)}: must be an array of tables, "
                          "each written [[diagnosis.rule]] with match and cause")
    return DiagnosisConfig(rules=tuple(_site_rule(f"{where}: [[diagnosis.rule]] #{i}", entry)
                                       for i, entry in enumerate(entries, 1)))


def _site_rule(label: str, entry: dict[str, Any]) -> SiteRule:
    """One ``[[diagnosis.rule]]`` table; ``label`` names it ("kimi.toml: [[diagnosis.rule]] #2")."""
    for key in entry:
        if key not in _RULE_KEYS:
            hint = _did_you_mean(key, _RULE_KEYS, "'{}'")
            raise ConfigError(f"{label} {key}: unknown key{hint} (known: {', '.join(sorted(_RULE_KEYS))})")
    causes = ", ".join(str(c) for c in SITE_CAUSES)
    if "match" not in entry:
        raise ConfigError(f"{label} match: missing: a regex searched in each line of a crash ({_RULE_EXAMPLE})")
    match = entry["match"]
    if not isinstance(match, str):
        raise ConfigError(f"{label} match = {_show(match)}: must be a string, a regex ({_RULE_EXAMPLE})")
    if (problem := pattern_problem(match)) is not None:
        raise ConfigError(f"{label} match = {_show(match)}: {problem}")
    if "cause" not in entry:
        raise ConfigError(f"{label} cause: missing: the cause the line names, one of {causes}")
    value = entry["cause"]
    cause = next((c for c in SITE_CAUSES if isinstance(value, str) and value == str(c)), None)
    if cause is None:
        if isinstance(value, str) and value in {str(c) for c in Cause}:
            raise ConfigError(f"{label} cause = {_show(value)}: the daemon's own cause, never read from a log "
                              f"(one of {causes})")
        hint = _did_you_mean(value, [str(c) for c in SITE_CAUSES], "'{}'") if isinstance(value, str) else ""
        raise ConfigError(f"{label} cause = {_show(value)}: unknown cause{hint} (one of {causes})")
    phase: Phase | None = None
    if "phase" in entry:
        value = entry["phase"]
        phase = next((p for p in Phase if isinstance(value, str) and value == str(p)), None)
        if phase is None:
            hint = _did_you_mean(value, [str(p) for p in Phase], "'{}'") if isinstance(value, str) else ""
            raise ConfigError(f'{label} phase = {_show(value)}: must be "starting" or "serving"{hint}')
    certain = entry.get("certain", False)
    if not isinstance(certain, bool):
        raise ConfigError(f"{label} certain = {_show(certain)}: must be true or false")
    return SiteRule(match=match, cause=cause, phase=phase, certain=certain)


# The flags build_argv sets from [server] keys, with SGLang's aliases. extra_args must not set
# them again: SGLang's argparse keeps the last one, so the ladder would be silently ignored.
MANAGED_FLAGS: dict[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--host": "host",
    "--port": "port",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
    "--mem-fraction-static": "mem_fraction_static",
    "--enable-hierarchical-cache": "hicache_size_gb",
    "--enable-hicache": "hicache_size_gb",
    "--hicache-size": "hicache_size_gb",
    "--nnodes": "group.nnodes",
    "--node-rank": "group.node_rank",
    "--dist-init-addr": "group.dist_init_addr",
}


def _managed_key(key: str) -> str:
    """``[server] port`` for "port", ``[group] nnodes`` for "group.nnodes"."""
    section, _, name = key.rpartition(".")
    return f"[{section or 'server'}] {name}"


def managed_flag(arg: str) -> str | None:
    """The managed flag that ``arg`` would set, also as ``--flag=value`` or as an argparse
    abbreviation (``--mem-frac``, ``--tp``); None for any other argument."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--") or name == "--":
        return None
    return next((flag for flag in MANAGED_FLAGS if flag.startswith(name)), None)


def _cross_checks(where: str, cfg: Config) -> None:
    """Rules that tie keys together."""
    if not cfg.server.model_path:
        raise ConfigError(f'{where}: [server] model_path: missing: must be a non-empty string')
    for arg in cfg.server.extra_args:
        if (flag := managed_flag(arg)) is not None:
            raise ConfigError(
                f"{where}: [server] extra_args = {_show(list(cfg.server.extra_args))}: must not "
                f"contain {arg!r} (the supervisor sets {flag} from {_managed_key(MANAGED_FLAGS[flag])})"
            )
    frac = cfg.server.mem_fraction_static
    ladder = cfg.policy.fraction_ladder
    if frac is not None and frac < ladder[-1]:
        raise ConfigError(
            f"{where}: [server] mem_fraction_static = {frac}: must be >= the ladder's floor "
            f"{ladder[-1]} ([policy] fraction_ladder)"
        )
    if cfg.gpu.backend == "simulated" and not cfg.gpu.sim_dir:
        raise ConfigError(f'{where}: [gpu] sim_dir = "": must be set when backend = "simulated"')
    if cfg.health.timeout_s <= 0:
        raise ConfigError(f"{where}: [health] timeout_s: must be > 0")
    if cfg.mqtt.enabled and cfg.mqtt.username and not cfg.mqtt.password_file:
        raise ConfigError(
            f"{where}: [mqtt] password_file = \"\": must be set when username is "
            "(the password is read from a file, never written inline)"
        )
    if cfg.gpu.indices and "CUDA_VISIBLE_DEVICES" in cfg.server.env:
        raise ConfigError(
            f"{where}: [server] env CUDA_VISIBLE_DEVICES: must not be set with [gpu] indices "
            f"(the supervisor exports {','.join(map(str, cfg.gpu.indices))} from them)"
        )
    g = cfg.group
    if g.enabled:
        if g.nnodes < 2 or g.node_rank >= g.nnodes:
            raise ConfigError(f"{where}: [group] node_rank = {g.node_rank}, nnodes = {g.nnodes}: "
                              "must be 0 <= node_rank < nnodes, nnodes >= 2")
        if not g.dist_init_addr:
            raise ConfigError(f'{where}: [group] dist_init_addr = "": must be node 0\'s "HOST:PORT"')
        if not cfg.etcd.endpoints:
            raise ConfigError(f'{where}: [etcd] endpoints: missing: [group] needs etcd (e.g. endpoints = ["127.0.0.1:2379"])')
        if cfg.fleet.enabled:
            raise ConfigError(f"{where}: [fleet] with [group]: a group's fraction is its leader's, the same on "
                              "every node; fleet memory for groups is not supported yet")
        if cfg.router.enabled and g.node_rank != 0:
            raise ConfigError(f"{where}: [router] enabled on node {g.node_rank}: only node 0 serves requests")
    if cfg.fleet.enabled and not cfg.etcd.endpoints:
        raise ConfigError(f'{where}: [etcd] endpoints: missing: [fleet] enabled = true needs etcd '
                          '(e.g. endpoints = ["127.0.0.1:2379"])')
    if cfg.etcd.username and not cfg.etcd.password_file:
        raise ConfigError(f'{where}: [etcd] password_file = "": must be set when username is (read from a file, never inline)')
    if bool(cfg.etcd.cert_file) != bool(cfg.etcd.key_file):
        raise ConfigError(f"{where}: [etcd] cert_file and key_file: set both or neither")
    if cfg.router.enabled and not cfg.router.url:
        raise ConfigError(f'{where}: [router] url = "": must be set when enabled = true (e.g. "http://127.0.0.1:30080")')


def build_config(data: dict[str, Any], *, where: str = "config", name: str = "supervisor") -> Config:
    """Validate a parsed TOML document into a ``Config``; ``where`` prefixes every error.

    ``[server]`` may be an array of tables (``[[server]]``): one daemon, several servers,
    each built into a whole ``Config`` of its own (``units``)."""
    for section in data:
        if section not in _SECTIONS:
            known = ", ".join(f"[{s}]" for s in _SECTIONS)
            hint = _did_you_mean(section, _SECTIONS, "[{}]")
            raise ConfigError(f"{where}: [{section}]: unknown section{hint} (known: {known})")
    if isinstance(data.get("server"), list):
        return _build_units(data, where=where, name=name)
    sections = {section: _build_section(where, section, _SECTIONS[section], raw) for section, raw in data.items()}
    cfg = Config(**sections, name=name)
    _cross_checks(where, cfg)
    return cfg


def _build_units(data: dict[str, Any], *, where: str, name: str) -> Config:
    """``[[server]]``: the daemon's sections once, then one ``Config`` per entry, its
    per-server tables (``PER_SERVER``) laid key by key over the top-level ones."""
    entries = data["server"]
    if not entries:
        raise ConfigError(f"{where}: [[server]]: empty: at least one server is needed")
    top = {s: raw for s, raw in data.items() if s != "server"}
    for section, raw in top.items():
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: [{section}] must be a table, not {_show(raw)}")
    base = Config(
        **{s: _build_section(where, s, _SECTIONS[s], raw) for s, raw in top.items()}, name=name,
    )
    units: list[Config] = []
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: [[server]] #{i} must be a table, not {_show(entry)}")
        unit_where = f"{where}: [[server]] #{i}"
        label = entry.get("name")
        if isinstance(label, str) and label:
            unit_where = f"{where}: server {label[:64]!r}"
        if not label:
            raise ConfigError(f'{unit_where}: name: missing: each [[server]] needs a name (e.g. name = "tp4-a")')
        own = {k: v for k, v in entry.items() if k not in PER_SERVER}
        sections: dict[str, Any] = {"server": _build_section(unit_where, "server", ServerConfig, own)}
        for section, allowed in PER_SERVER.items():
            raw = entry.get(section, {})
            if not isinstance(raw, dict):
                raise ConfigError(f"{unit_where}: [server.{section}] must be a table, not {_show(raw)}")
            if allowed is not None:
                for key in raw:
                    if key not in allowed:
                        raise ConfigError(
                            f"{unit_where}: [server.{section}] {key}: not set per server "
                            f"(per server: {', '.join(sorted(allowed))}; the rest goes in [{section}])"
                        )
            merged = {**top.get(section, {}), **raw}
            sections[section] = _build_section(unit_where, section, _SECTIONS[section], merged)
        if base.group.enabled:
            raise ConfigError(f"{unit_where}: [group] with [[server]]: a group node's daemon owns one server")
        state = StateConfig(dir=str(Path(base.state.dir) / sections["server"].name))
        unit = dataclasses.replace(base, **sections, state=state)
        _cross_checks(unit_where, unit)
        units.append(unit)
    cfg = dataclasses.replace(base, units=tuple(units))
    _unit_checks(where, cfg)
    return cfg


def _unit_checks(where: str, cfg: Config) -> None:
    """What several servers in one daemon must not share: a name, a port, a GPU, a log."""
    seen: dict[tuple[str, object], str] = {}

    def claim(what: str, value: object, owner: str) -> None:
        other = seen.setdefault((what, value), owner)
        if other != owner:
            raise ConfigError(f"{where}: servers {other!r} and {owner!r} have the same {what} {value}")

    for unit in cfg.units:
        owner = unit.server.name
        claim("name", owner, f"#{cfg.units.index(unit) + 1}")
        claim("port", unit.server.port, owner)
        if unit.logging.server_log:
            claim("[logging] server_log", unit.logging.server_log, owner)
        for index in unit.gpu.indices:
            claim("GPU index", index, owner)
        if unit.gpu.backend != "none" and not unit.gpu.indices and len(cfg.units) > 1:
            raise ConfigError(
                f"{where}: server {owner!r}: [server.gpu] indices: missing: with several servers "
                "each names its GPUs (exported as its CUDA_VISIBLE_DEVICES)"
            )


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value). The value is read as TOML; a bare
    word that is not valid TOML is taken as a string (``state.dir=/tmp/x``)."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text[:80]!r}: expected SECTION.KEY=VALUE (e.g. server.port=30001)")
    if "\n" in raw or "\r" in raw:
        raise ConfigError(f"--set {path.strip()[:80]}: the value must be on one line")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        # Not TOML (or TOML Python refuses: a 5,000-digit integer, deep nesting): a string.
        value = raw
    return section, key, value


def check_file_mode(path: Path) -> None:
    """Refuse a config that users other than the owner may write: it holds a command line."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o022:
        raise ConfigError(
            f"{path}: writable by group or others (mode {mode & 0o777:04o}); it sets the command "
            f"line run as the service user: chmod go-w {path}"
        )


def load_config(path: str | os.PathLike[str], overrides: typing.Sequence[str] = ()) -> Config:
    """Read, override and validate a config file. Raises ``ConfigError`` (one line)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    check_file_mode(p)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    except ValueError as exc:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise ConfigError(f"{p}: unusable TOML value: {str(exc)[:120]}") from None
    except RecursionError:
        raise ConfigError(f"{p}: arrays or tables nested too deeply") from None
    for item in overrides:
        section, key, value = parse_override(item)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {item!r}: [{section}] is not a table in {p}")
        table[key] = value
    return build_config(data, where=str(p), name=p.stem)


def config_from_overrides(overrides: typing.Sequence[str], *, name: str = "demo") -> Config:
    """A config made of ``--set`` items alone (used by the demo on top of its own file)."""
    data: dict[str, Any] = {}
    for item in overrides:
        section, key, value = parse_override(item)
        data.setdefault(section, {})[key] = value
    return build_config(data, where="--set", name=name)
