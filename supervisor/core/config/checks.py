"""The rules that tie keys together, checked on a whole ``Config`` once its sections are
built; among them, no ``extra_args`` flag that the supervisor sets itself (``MANAGED_FLAGS``)."""

from __future__ import annotations

from supervisor.core.config.hosts import PLACEHOLDER_SUFFIXES, bare_host_problem, placeholder_host
from supervisor.core.config.rules import ConfigError, _show
from supervisor.core.config.units import Config

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
    _mqtt_host(where, cfg)
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


def _mqtt_host(where: str, cfg: Config) -> None:
    """``[mqtt] host``: a bare host (no ``mqtt://``, no ``:1883``); with MQTT on, not a name
    reserved for examples left in from the sample config."""
    host = cfg.mqtt.host
    if (problem := bare_host_problem(host)) is not None:
        raise ConfigError(f"{where}: [mqtt] host = {_show(host)}: must be {problem}")
    if cfg.mqtt.enabled and placeholder_host(host):
        family = ", ".join(f".{s}" if "." not in s else s for s in PLACEHOLDER_SUFFIXES)
        raise ConfigError(
            f"{where}: [mqtt] host = {_show(host)}: a placeholder (a name reserved for examples by "
            f"RFC 2606/6761: {family}): set your broker's host, or [mqtt] enabled = false"
        )
