"""The whole config (``Config``: one of each section) and the servers it holds: with several
``[[server]]`` entries one whole ``Config`` per server (``units``), else the one ``[server]``;
each server's name, its MQTT instance, and ``--server NAME``'s choice."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.core.config.rules import ConfigError
from supervisor.core.config.sections import (
    DiagnosisConfig,
    EtcdConfig,
    FleetConfig,
    GpuConfig,
    GroupConfig,
    HealthConfig,
    LoggingConfig,
    MetricsConfig,
    MqttConfig,
    PolicyConfig,
    ReportConfig,
    RouterConfig,
    ServerConfig,
    StateConfig,
)


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
