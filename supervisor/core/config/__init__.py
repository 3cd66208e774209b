"""The configuration: one TOML file, validated into frozen dataclasses.

Every section is a dataclass whose fields are the TOML keys; a field's type and its
``rule`` metadata define what is accepted. Unknown keys and bad values raise
``ConfigError`` with one line naming the key, the value and the rule.

The package, module by module (importers use this package's names, listed in ``__all__``):

- ``rules``: ``ConfigError``, a field's ``rule`` metadata and the value checks;
- ``windows``: the time rules (``in_window`` for ``[policy] climb_window``, ``daily_at``, zones);
- ``sections``: one dataclass per TOML section, and the defaults they start from;
- ``units``: ``Config`` (one of each section) and the servers it holds, with their names;
- ``urls``: a local listener's URL and the router's URL for this daemon's server;
- ``schema``: a section's table validated into its dataclass (``[[diagnosis.rule]]`` too);
- ``checks``: the rules that tie keys together, ``MANAGED_FLAGS``;
- ``hosts``: a bare host name, and the names reserved for examples (RFC 2606/6761);
- ``servers``: ``[[server]]`` entries expanded into one ``Config`` each, and what they must not share;
- ``overrides``: ``--set SECTION.KEY=VALUE``;
- ``load``: ``build_config``, ``load_config`` (with the secret files' checks) and ``config_from_overrides``.
"""

from __future__ import annotations

from supervisor.core.config.checks import MANAGED_FLAGS, managed_flag
from supervisor.core.config.hosts import PLACEHOLDER_SUFFIXES, placeholder_host
from supervisor.core.config.load import (
    build_config,
    check_file_mode,
    check_secret_files,
    config_from_overrides,
    load_config,
)
from supervisor.core.config.overrides import parse_override
from supervisor.core.config.rules import ConfigError
from supervisor.core.config.sections import (
    DEFAULT_COMMAND,
    DEFAULT_LADDER,
    DEFAULT_PASS_ENV,
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
from supervisor.core.config.servers import PER_SERVER
from supervisor.core.config.units import Config, alert_instance, select_server, server_configs, unit_name
from supervisor.core.config.urls import WILDCARDS, http_url, url_host, worker_url
from supervisor.core.config.windows import in_window

__all__ = [
    "DEFAULT_COMMAND",
    "DEFAULT_LADDER",
    "DEFAULT_PASS_ENV",
    "MANAGED_FLAGS",
    "PER_SERVER",
    "PLACEHOLDER_SUFFIXES",
    "WILDCARDS",
    "Config",
    "ConfigError",
    "DiagnosisConfig",
    "EtcdConfig",
    "FleetConfig",
    "GpuConfig",
    "GroupConfig",
    "HealthConfig",
    "LoggingConfig",
    "MetricsConfig",
    "MqttConfig",
    "PolicyConfig",
    "ReportConfig",
    "RouterConfig",
    "ServerConfig",
    "StateConfig",
    "alert_instance",
    "build_config",
    "check_file_mode",
    "check_secret_files",
    "config_from_overrides",
    "http_url",
    "in_window",
    "load_config",
    "managed_flag",
    "parse_override",
    "placeholder_host",
    "select_server",
    "server_configs",
    "unit_name",
    "url_host",
    "worker_url",
]
