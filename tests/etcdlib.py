"""A real etcd server for the tests (Debian's ``etcd-server``, etcd 3.4).

``EtcdServer`` runs the ``etcd`` binary as a one-member cluster on free 127.0.0.1 ports
with its data in a temporary directory, optionally serving TLS. ``stop`` and ``start``
play an outage: it comes back on the same ports with the same data, as a restarted
etcd does. The ``etcd_server`` fixture always stops and reaps it.

A missing ``etcd`` binary fails the test (``scripts/install-system-deps`` installs it):
it never skips.
"""

from __future__ import annotations

import os
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.mosquitto import TlsFiles
from tests.servicelib import LocalService

SEARCH = ("/usr/bin", "/usr/sbin")  # where Debian puts them, should PATH be thin


def etcd_binary(name: str = "etcd") -> str:
    """``etcd`` or ``etcdctl``; a failure naming the install script when missing."""
    path = shutil.which(name) or shutil.which(name, path=os.pathsep.join(SEARCH))
    if path is None:
        package = "etcd-server" if name == "etcd" else "etcd-client"
        pytest.fail(f"{name} is not installed: scripts/install-system-deps installs it (Debian's {package}); "
                    "tests/test_etcd.py runs a real etcd", pytrace=False)
    return path


class EtcdServer(LocalService):
    """One etcd member on 127.0.0.1; ``endpoint`` is what clients connect to."""

    what = "etcd"

    def __init__(self, directory: Path, *, tls: TlsFiles | None = None, client_cert_auth: bool = False) -> None:
        self.binary = etcd_binary()
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        scheme = "https" if tls else "http"
        # The server certificate names "localhost" (tests/mosquitto.make_tls_files).
        host = "localhost" if tls else "127.0.0.1"
        self.endpoint = f"{scheme}://{host}:{self.client_port}"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary, "--name", "test", "--data-dir", str(directory / "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"test={peer_url}", "--logger", "zap", "--log-outputs", "stderr",
        ]
        if tls:
            argv += ["--cert-file", str(tls.server_cert), "--key-file", str(tls.server_key)]
            if client_cert_auth:
                argv += ["--client-cert-auth", "--trusted-ca-file", str(tls.ca_cert)]
        super().__init__(argv, directory / "etcd.log", output_to_log=True, own_session=True)

    def ready(self) -> bool:
        """``/health`` says true."""
        url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}/health"
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
            context.check_hostname = False
            context.load_cert_chain(str(self.tls.server_cert), str(self.tls.server_key))
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                return b'"health":"true"' in resp.read()
        except (OSError, urllib.error.URLError, ValueError):
            return False


@pytest.fixture
def etcd_server(tmp_path: Path, no_leftovers: str) -> Iterator[EtcdServer]:
    """A running etcd on free ports; stopped and reaped after the test whatever happened."""
    server = EtcdServer(tmp_path / "etcd")
    try:
        server.start()
        yield server
    finally:
        server.stop()
