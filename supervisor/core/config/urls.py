"""The URLs the daemon derives from its config: a local listener's, and the one the router
uses for this daemon's server."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.core.config.units import Config


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
