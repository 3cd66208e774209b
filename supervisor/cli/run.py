"""``sglang-supervisor run``: the daemon's composition root.

The only place that knows the concrete adapters and sinks: it builds them, puts them in a
``Ports`` and runs a ``Daemon`` over them. ``next_argv`` is ``run --dry-run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from supervisor.aio import cancel_and_wait
from supervisor.core.config import Config, ConfigError, alert_instance, load_config, server_configs, unit_name

if TYPE_CHECKING:
    from supervisor.adapters.mqtt import MqttTransport
    from supervisor.adapters.router import RouterClient
    from supervisor.adapters.store import StateStore
    from supervisor.sinks.alerts import AlertSink
    from supervisor.sinks.metrics import Metrics


async def run_daemon_async(
    cfg: Config,
    *,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    extra_sinks: Sequence[Any] = (),
    log_stream: IO[str] | None = None,
    on_daemon: Any = None,
    install_signals: bool = True,
) -> int:
    """Build the real adapters around a ``Daemon`` and run it to the end."""
    from prometheus_client import CollectorRegistry

    from supervisor.adapters import cleanup, control, gpu, reaper
    from supervisor.adapters.cgroup import cgroup_oom_kills
    from supervisor.adapters.health import HealthProber, KvMetricsReader
    from supervisor.adapters.journald import JournalSocket
    from supervisor.adapters.output import RotatingLog
    from supervisor.adapters.ports import Ports, UnitPorts
    from supervisor.adapters.process import ServerProcess
    from supervisor.adapters.sdnotify import Notifier
    from supervisor.adapters.store import StateStore
    from supervisor.cli import registry
    from supervisor.daemon import Daemon
    from supervisor.services import preflight
    from supervisor.sinks import logs

    reexec_port = ReexecAdapter(cfg, config_path, overrides)  # first: what a re-exec handed over, if one did
    router = router_client(cfg)  # a bad token file stops here, before anything is started
    group_etcd = etcd_client(cfg, "[group]") if cfg.group.enabled else None
    # [fleet]: etcd's client, not connected (the first call connects; an etcd away is the
    # fleet's error, not the daemon's). Without [fleet] its library is never imported.
    fleet_store = etcd_client(cfg, "[fleet]") if cfg.fleet.enabled else None
    # stderr is the journal (systemd's JOURNAL_STREAM): each line goes to journald natively,
    # with its priority and the event, server and cause as fields (docs/systemd.md).
    journal = JournalSocket.from_env() if log_stream is None else None
    logger = logs.configure(cfg.logging.format, cfg.logging.level, log_stream, journal=journal,
                            server="" if cfg.units else unit_name(cfg))
    host = socket.gethostname()
    metrics_server = None
    alerters: list[MqttTransport] = []
    registries: dict[str, CollectorRegistry] = {}
    server_sinks: dict[str, list[Any]] = {}
    for unit in server_configs(cfg):
        # Each server its own metrics (served under a `server` label) and, with several
        # servers, its own MQTT instance ("kimi-tp4-a"): its state topic and Last Will.
        name = unit_name(unit)
        own: list[Any] = server_sinks.setdefault(name, [])
        metrics = None
        if cfg.metrics.enabled:
            from supervisor.sinks.metrics import Metrics

            registries[name] = CollectorRegistry(auto_describe=True)
            metrics = Metrics(
                registries[name], fraction_ladder=unit.policy.fraction_ladder,
                headroom_min_gb=unit.gpu.headroom_min_gb, hostname=host, gpu_indices=unit.gpu.indices,
            )
            own.append(metrics)
            metrics.restore_counters(reexec_port.counters_of(name))  # a re-exec: counts go on
            reexec_port.metrics[name] = metrics
        if cfg.report.enabled:
            own.extend(report_sinks(unit, logger))
        if cfg.mqtt.enabled:
            alerts, alerter = build_alerter(unit, host=host, instance=alert_instance(cfg, unit),
                                            logger=logger, metrics=metrics)
            await alerter.start()
            alerters.append(alerter)
            own.append(alerts)
    if cfg.metrics.enabled:
        from supervisor.sinks.metrics_endpoint import MetricsError, labelled_registry, start_metrics_server

        try:
            metrics_server = await start_metrics_server(cfg.metrics.listen, labelled_registry(registries))
        except MetricsError as exc:
            logger.error("metrics_unavailable", error=str(exc))
        else:
            logger.info("metrics_listening", listen=metrics_server.url)
    sinks: list[Any] = [logs.LogSink(logger), *extra_sinks]

    def reload() -> Config:
        if config_path is None:
            raise ConfigError("no config file to reload")
        return load_config(config_path, overrides)

    # One store per state directory: a single [server]'s is the daemon's own (its lock).
    stores = {cfg.state.dir: StateStore(cfg.state.dir, inherited_lock=reexec_port.lock_of(cfg.state.dir))}
    reexec_port.stores, reexec_port.alerters = stores, alerters

    def unit_ports(unit: Config) -> UnitPorts:
        """A server's own ports (its store, a probe of its GPUs, its sinks) and the shared ones."""
        if unit.state.dir not in stores:
            stores[unit.state.dir] = StateStore(unit.state.dir, inherited_lock=reexec_port.lock_of(unit.state.dir))
        return UnitPorts(
            store=stores[unit.state.dir], logger=logger, cleanup=cleanup,
            preflight=preflight.HostPreflight(cleanup), spawner=ServerProcess, prober=HealthProber, gpu_monitor=gpu.GpuMonitor,
            open_log=RotatingLog, oom_kills=cgroup_oom_kills, gpu_probe=registry.make_probe(unit.gpu),
            sinks=server_sinks.get(unit_name(unit), ()), router=router, group_etcd=group_etcd, fleet_store=fleet_store,
            sglang_version=read_sglang_version, kv_reader=KvMetricsReader,
            host=host,
        )

    ports = Ports(
        store=stores[cfg.state.dir],
        sinks=sinks,
        logger=logger,
        start_control=control.serve,
        units=unit_ports,
        notifier=Notifier.from_env(),
        reload=reload,
        host=host,
        install_signals=install_signals,
        # A daemon that owns its process's signals owns its children too: it reaps orphans.
        # One embedded in another program (install_signals=False) leaves them to it.
        reaper=reaper.start if install_signals else None,
        publish_offline=lambda timeout_s: publish_offline(alerters, timeout_s),
        # Past the shutdown's deadline a daemon that owns its process ends it at once.
        hard_exit=os._exit if install_signals else None,
        # Re-exec in place: only a daemon that owns its process (the CLI's) replaces its program.
        reexec=reexec_port if install_signals else None,
    )
    daemon = Daemon(cfg, ports)
    if on_daemon is not None:
        on_daemon(daemon)
    summaries = start_daily_summaries(daemon, logger)
    try:
        return await daemon.run()
    finally:
        await cancel_and_wait([summaries])
        if router is not None:
            await router.aclose()
        if group_etcd is not None:
            await group_etcd.aclose()
        if fleet_store is not None:
            await fleet_store.aclose()
        for alerter in alerters:
            await alerter.aclose()
        if metrics_server is not None:
            await metrics_server.close()
        daemon.disarm()


class ReexecAdapter:
    """The daemon's ``ReexecPort`` (``adapters.reexec``): what this program was handed over
    by the one it replaced, if any, and how it replaces itself in turn. Built first, before
    any descriptor is opened: a hand-over it cannot read has what it inherited closed."""

    def __init__(self, cfg: Config, config_path: str | None, overrides: Sequence[str]) -> None:
        from supervisor.adapters import reexec
        from supervisor.services.reexec import HANDOVER_VERSION

        self._cfg, self._config_path, self._overrides = cfg, config_path, list(overrides)
        self.stores: Mapping[str, StateStore] = {}
        self.metrics: dict[str, Metrics] = {}  # each server's, whose counters the exec carries
        self.alerters: Sequence[MqttTransport] = ()
        self.inherited: Mapping[str, Any] | None = None
        self.inherited_error: str | None = None
        path = reexec.inherited_path()
        if path is None:
            return
        why = None
        try:
            doc = reexec.read(path)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        else:
            if doc.get("version") != HANDOVER_VERSION:
                why = f"format {doc.get('version')!r}, this program reads {HANDOVER_VERSION}"
            elif doc.get("pid") != os.getpid():
                why = f"written by pid {doc.get('pid')}, not this one ({os.getpid()})"
            else:
                self.inherited = doc
        if why is not None:
            self.inherited_error = f"the hand-over {path} cannot be read ({why}): its servers are relaunched"[:300]
            reexec.close_inherited()  # what it names cannot be adopted: no pipe left open and unread

    def counters_of(self, server: str) -> list[Any]:
        values = ((self.inherited or {}).get("metrics") or {}).get(server)
        return values if isinstance(values, list) else []

    def lock_of(self, state_dir: str) -> int | None:
        locks = (self.inherited or {}).get("locks") or {}
        fd = locks.get(str(state_dir))
        return fd if isinstance(fd, int) else None

    async def check(self) -> str | None:
        from supervisor.adapters import reexec

        return await reexec.check_new_code(reexec.entry_prefix(), self._config_path, self._overrides, os.environ)

    async def before_exec(self) -> None:
        await asyncio.gather(*(a.aclose(offline=False) for a in self.alerters), return_exceptions=True)

    async def after_failed_exec(self) -> None:
        await asyncio.gather(*(a.restart() for a in self.alerters), return_exceptions=True)

    def exec(self, doc: Mapping[str, Any], keep_fds: Sequence[int]) -> None:
        from supervisor.adapters import reexec

        for store in self.stores.values():
            store.flushed()  # the last state on the disk before the exec ends the flusher thread
        locks = {d: s.lock_fd for d, s in self.stores.items() if s.lock_fd is not None}
        path = reexec.path_in(self._cfg.state.dir)
        counters = {name: m.counter_values() for name, m in self.metrics.items()}
        reexec.write(path, {**doc, "locks": locks, "metrics": counters})
        reexec.exec_in_place([*keep_fds, *locks.values()], path)


async def publish_offline(alerters: Sequence[MqttTransport], timeout_s: float) -> None:
    """Each MQTT transport's retained ``offline`` at once, over fresh connections (a shutdown overdue)."""
    results = await asyncio.gather(*(a.offline_now(timeout_s) for a in alerters), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


def start_daily_summaries(daemon: Any, logger: Any) -> asyncio.Task[None]:
    """``[report] daily_at``: the task that emits each server's daily summary through that
    server's sinks (its alerter publishes it). It follows the config in force, so a reload can
    set, move or clear ``daily_at``; without one it wakes once a minute to look."""
    import time

    from supervisor.services import daily
    from supervisor.sinks.gpuring import read_ring
    from supervisor.sinks.journal import read_journal

    def emit(name: str, event: Any) -> None:
        daemon.unit(name).emit(event)

    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("task_failed", task="daily-summary", error=repr(task.exception())[:300])

    readers = daily.Readers(journal=read_journal, ring=read_ring)
    task = asyncio.create_task(daily.run(lambda: daemon.cfg, emit, clock=time.time, readers=readers),
                               name="daily-summary")
    task.add_done_callback(done)
    return task


def report_sinks(unit: Config, logger: Any) -> list[Any]:
    """A server's journal and GPU memory ring (``[report]``, docs/report.md), in its state dir."""
    from supervisor.sinks.gpuring import GpuRingSink
    from supervisor.sinks.journal import JournalSink

    r = unit.report
    return [
        JournalSink(unit.state.dir, max_bytes=r.journal_max_bytes, backups=r.journal_backups,
                    on_error=lambda error: logger.warning("journal_write_failed", error=error)),
        GpuRingSink(unit.state.dir, sample_s=r.gpu_sample_s, keep_days=r.keep_days,
                    on_error=lambda error: logger.warning("gpu_ring_write_failed", error=error)),
    ]


def read_sglang_version(command: Sequence[str], env: Mapping[str, str]) -> str:
    """The SGLang version ``command`` runs: its Python's package metadata, read in a child
    process with the server's environment (blocking; never imports sglang here)."""
    from supervisor.adapters.versions import server_python, sglang_version

    return sglang_version(server_python(command), env=env)


def _no_health(kind: str, value: Any) -> None:
    """The alerter's health hook when metrics are off: nothing to count."""


def alerting_health_callback(metrics: Metrics | None) -> Callable[[str, Any], None]:
    """The MQTT alerter's ``on_health``: the metrics sink's own hook, or a no-op without metrics.

    There is one mapping from the alerter's health reports to metrics, ``Metrics.alerting_health``;
    a copy here once left out ``mqtt_connect_failed``.
    """
    return _no_health if metrics is None else metrics.alerting_health


def build_alerter(cfg: Config, *, host: str, instance: str, logger: Any,
                  metrics: Metrics | None) -> tuple[AlertSink, MqttTransport]:
    """The daemon's MQTT alerts: the sink that words them, and the transport (not started)
    that delivers them and reports its health to ``metrics``."""
    from supervisor.adapters.mqtt import MqttTransport
    from supervisor.sinks.alerts import AlertSink, Topics, client_id

    m = cfg.mqtt
    transport = MqttTransport(m, client_id=client_id(m, host, instance),
                              status_topic=Topics.of(m.topic_prefix, host, instance).status, logger=logger,
                              on_health=alerting_health_callback(metrics))
    return AlertSink(m, host=host, instance=instance, outbox=transport, logger=logger), transport


def dry_run(cfg: Config) -> object:
    """``run --dry-run``'s answer: the next argv of a single ``[server]``, or of each of
    several ``[[server]]`` entries by name."""
    if not cfg.units:
        return list(next_argv(cfg))
    return {unit_name(u): list(next_argv(u)) for u in cfg.units}


def next_argv(cfg: Config) -> tuple[str, ...]:
    """The argv the daemon would launch next: the learned rung if the state dir has one."""
    from supervisor.adapters.store import StateStore
    from supervisor.core.argv import build_argv
    from supervisor.core.state import Learned

    data, _warning = StateStore(cfg.state.dir).load(move_aside=False)
    learned = Learned.initial(cfg)
    if data and isinstance(data.get("learned"), dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            learned = Learned.from_dict(data["learned"]).rebased(cfg)
    return build_argv(cfg, learned.fraction, learned.hicache_size_gb)


def router_client(cfg: Config) -> RouterClient | None:
    """SGLang's router's client when ``[router] enabled``; its token read once from
    ``token_file`` (an unreadable file is a config error: one line, no daemon)."""
    if not cfg.router.enabled:
        return None
    from supervisor.adapters.router import RouterClient

    token = None
    if cfg.router.token_file:
        try:
            token = Path(cfg.router.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ConfigError(f"[router] token_file {cfg.router.token_file}: cannot read: {why}") from None
        if not token:
            raise ConfigError(f"[router] token_file {cfg.router.token_file}: empty")
    return RouterClient(cfg.router.url, token, cfg.router.timeout_s)


def etcd_client(cfg: Config, why: str) -> Any:
    """The etcd client of ``[etcd]`` for ``why`` ("[group]", "[fleet]"), not connected; a
    missing endpoint list or an unreadable password file is a config error (one line). The
    etcd client library is imported here, only when something needs it."""
    from supervisor.adapters.etcd import EtcdClient

    e = cfg.etcd
    if not e.endpoints:
        raise ConfigError(f'[etcd] endpoints: missing: {why} needs etcd (e.g. endpoints = ["127.0.0.1:2379"])')
    password = None
    if e.username:
        try:
            password = Path(e.password_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ConfigError(f"[etcd] password_file {e.password_file}: cannot read: {what}") from None
    return EtcdClient(
        e.endpoints, timeout_s=e.timeout_s, ca_file=e.ca_file or None, cert_file=e.cert_file or None,
        key_file=e.key_file or None, user=e.username or None, password=password,
    )
