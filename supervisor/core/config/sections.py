"""The TOML sections, one frozen dataclass each: a field per key, its type and its ``rule``
metadata (``rules._rule``) define what is accepted. ``units.Config`` holds one of each."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from supervisor.core.config.rules import (
    _endpoints,
    _etcd_prefix,
    _fraction,
    _hostport,
    _listen,
    _non_negative,
    _positive,
    _rule,
    _share,
    _unit_name,
    _url,
)
from supervisor.core.config.windows import _time_of_day, _window, _zone_name
from supervisor.core.fleet import FLEET_PREFIX
from supervisor.core.model import SiteRule

DEFAULT_COMMAND = ("python", "-m", "sglang.launch_server")
DEFAULT_LADDER = (0.93, 0.88, 0.85, 0.82, 0.80)
# What SGLang and its libraries read from the environment: tokens, NCCL and SGLang knobs,
# the CUDA allocator and device selection, the dynamic loader. Nothing else leaks through.
DEFAULT_PASS_ENV = (
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN",
    "TRANSFORMERS_CACHE", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_*", "NCCL_*", "SGLANG_*",
)


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


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Fleet memory (docs/fleet.md): the ladder's lessons shared in etcd (``[etcd]``) by
    every daemon running the same configuration on the same GPU and SGLang version."""

    enabled: bool = field(default=False, metadata=_rule("true or false"))
    prefix: str = field(default=FLEET_PREFIX, metadata=_rule('an etcd key prefix starting with "/"', _etcd_prefix))


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
