"""What a host name in the config must not be: a URL or ``HOST:PORT`` where a bare host is
asked for, or a name reserved for examples and documentation left in from a sample file.

The reserved family (``PLACEHOLDER_SUFFIXES``) is RFC 2606's and RFC 6761's: the top-level
names ``example``, ``test`` and ``invalid``, and the second-level ``example.com``,
``example.net`` and ``example.org``, each with every name under it (``mqtt.internal.example``,
``broker.example.com``). ``localhost`` is reserved too, but it names this host: a broker
there is real.
"""

from __future__ import annotations

import ipaddress

PLACEHOLDER_SUFFIXES = ("example", "test", "invalid", "example.com", "example.net", "example.org")


def placeholder_host(host: str) -> bool:
    """True for a name reserved for examples (RFC 2606/6761), e.g. ``broker.example``."""
    name = host.strip().rstrip(".").lower()
    return any(name == s or name.endswith("." + s) for s in PLACEHOLDER_SUFFIXES)


def bare_host_problem(host: str) -> str | None:
    """Why ``host`` is not a bare host name or address (a scheme, a port, a path), or None."""
    if "://" in host:
        return f'without a scheme ("{host.split("://", 1)[0]}://"): a bare host name or address'
    if any(c.isspace() for c in host) or "/" in host:
        return "a bare host name or address (no spaces, no path)"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            name, _, port = host.rpartition(":")
            hint = f" (host = {name!r}, port = {port})" if port.isdigit() and name else ""
            return f"a bare host name or address, without a port: the port goes in port{hint}"
    return None
