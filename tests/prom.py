"""A real Prometheus server for tests: started on a free port, queried over its HTTP API,
always stopped (SIGTERM, then SIGKILL) and reaped.

Blocking by design (urllib, Popen): async tests call it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.conftest import free_port

JOB = "sglang-supervisor"  # the job name alerts.yml's SGLangSupervisorDown expects


class PrometheusServer:
    """``/usr/bin/prometheus`` scraping ``targets`` every second, with optional rule files."""

    def __init__(
        self,
        binary: str,
        workdir: Path,
        targets: Sequence[str],
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval: str = "1s",
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self.config_path = workdir / "prometheus.yml"
        config = {  # JSON is YAML: no YAML library needed
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": list(targets)}]}],
        }
        self.config_path.write_text(json.dumps(config, indent=2))
        self.process: subprocess.Popen[bytes] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        """Start Prometheus and wait until it scrapes its targets; on failure stop it and raise."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self.wait_for(self._ready, timeout, "Prometheus to become ready")
            # Ready is not scraping: the scrape manager applies targets up to 5 s later.
            # Every attempt records `up` (0 while the target is not there yet).
            self.wait_for(lambda: self.query("up"), timeout, "Prometheus's first scrape")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, up to 30 s to shut down, then SIGKILL; always reaped."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- HTTP API --------------------------------------------------------------------------

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"Prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the ``data`` of a successful answer."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus API {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result list."""
        return self.api("query", query=expr)["result"]

    def history(self, selector: str, window: str = "30m") -> list[float]:
        """The raw scraped values of ``selector`` over ``window``, oldest first, all series merged."""
        samples = [(float(t), float(v)) for series in self.query(f"{selector}[{window}]") for t, v in series["values"]]
        return [v for _, v in sorted(samples)]

    def wait_for(
        self,
        predicate: Callable[[], Any],
        timeout: float,
        what: str,
        *,
        abort: Callable[[], str | None] = lambda: None,
        interval: float = 0.5,
    ) -> Any:
        """Poll ``predicate`` until truthy; fail at the deadline or when ``abort`` returns a reason
        (``abort`` is checked before each poll, so one last poll follows it)."""
        deadline = time.monotonic() + timeout
        while True:
            reason = abort()
            value = predicate()
            if value:
                return value
            if reason is not None:
                raise AssertionError(f"gave up waiting for {what}: {reason}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.log_tail()}")
            time.sleep(interval)


def rose(values: Sequence[float], start: float = 0.0) -> bool:
    """The series was at ``start`` and later above it."""
    return start in values and values[-1] > start and values.index(start) < len(values) - 1


def went(values: Sequence[float], first: float, then: float) -> bool:
    """The series read ``first`` and, at a later sample, ``then``."""
    return first in values and then in values[values.index(first) + 1 :]
