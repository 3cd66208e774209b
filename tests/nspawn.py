"""A real systemd (252, Debian 12) booted as PID 1 of a systemd-nspawn container, for the tests.

``rootfs()`` builds a minimal Debian root file system once (``debootstrap --variant=minbase``
with systemd, dbus and python3, plus the unit's ``sglang`` user) and caches it under
``${SGLANG_SUPERVISOR_CACHE:-~/.cache/sglang-supervisor}/nspawn/ROOTFS_VERSION``: a second
run finds it and builds nothing. ``Machine`` boots it from a cgroup of its own
(``--register=no --keep-unit``: no machined or host systemd needed), runs ``systemctl`` and
``journalctl`` inside with ``nsenter``, and on ``close()`` powers it off, waits for nspawn
and removes its cgroups. The recipe and what it costs: /work/shared/systemd-nspawn.md and
docs/systemd.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

# Bump when the recipe below changes: a new directory is built, the old one is left alone.
ROOTFS_VERSION = "bookworm-minbase-systemd-dbus-python3-procps-sglang-v3"
# procps: /bin/kill, which the unit's ExecReload= runs (minbase has none; every real host has it)
PACKAGES = ("systemd", "dbus", "python3", "procps")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CGROUP_HIERARCHIES = ("systemd", "unified")


def cache_dir() -> Path:
    root = os.environ.get("SGLANG_SUPERVISOR_CACHE") or os.path.expanduser("~/.cache/sglang-supervisor")
    return Path(root) / "nspawn"


def apt_mirror() -> str:
    """The Debian mirror apt already uses here (``URIs:`` of a deb822 source, or a one-line
    ``deb URI bookworm main``), the public one otherwise."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    for path in candidates:
        with contextlib.suppress(OSError):
            text = path.read_text()
            for match in re.finditer(r"^URIs:\s*(\S+)|^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
                uri = match.group(1) or match.group(2)
                if "security" not in uri:
                    return uri.rstrip("/")
    return DEFAULT_MIRROR


def run(argv: Sequence[str], *, timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check, **kw)


def rootfs(debootstrap: str, *, timeout: float = 900.0) -> Path:
    """The cached root file system, built first if it is not there (under a lock, so two
    runs do not build it twice)."""
    base = cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    target = base / ROOTFS_VERSION
    with (base / f"{ROOTFS_VERSION}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "etc" / "os-release").exists():
            return target
        work = base / f"{ROOTFS_VERSION}.building"
        shutil.rmtree(work, ignore_errors=True)
        run([debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm", str(work),
             apt_mirror()], timeout=timeout)
        # The unit's user, as docs/systemd.md creates it on a host.
        run(["chroot", str(work), "useradd", "--system", "--user-group", "--home-dir",
             "/var/cache/sglang-supervisor", "--shell", "/usr/sbin/nologin", "sglang"], timeout=60)
        # The test binds the host's Python at its own path, which may be under /root: the
        # service user must be able to traverse it (the host's /root is not in here).
        (work / "root").chmod(0o711)
        (work / "etc" / "machine-id").write_text("")  # a fresh one at every boot
        work.rename(target)
    return target


def own_cgroups(name: str) -> list[Path]:
    """Where the container's own cgroup goes: ``name`` under the hybrid layout's ``systemd``
    and ``unified`` hierarchies (this kind of machine), or at the root of a pure cgroup v2."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base / name]
    return [base / h / name for h in CGROUP_HIERARCHIES if (base / h).is_dir()]


class Machine:
    """One booted container (see the module docstring). Use as a context manager."""

    def __init__(self, root: Path, *, binds_ro: Sequence[str] = (), log: Path, nspawn: str = "systemd-nspawn",
                 boot_timeout: float = 60.0) -> None:
        self.root = root
        self.name = "sgls-" + uuid.uuid4().hex[:8]
        self.log = log
        self.cgroups = own_cgroups(self.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader: int | None = None
        binds = [f"--bind-ro={b}" for b in binds_ro]
        # --volatile=overlay: every write goes to a tmpfs over the cached root, gone at power-off
        # (the cache stays clean, and each boot starts with an empty journal and state).
        argv = [nspawn, "-D", str(root), "-M", self.name, "--boot", "--register=no", "--keep-unit",
                "--console=passive", "--volatile=overlay", *binds]
        for cg in self.cgroups:
            cg.mkdir(exist_ok=True)
        cgroup_procs = [str(cg / "cgroup.procs") for cg in self.cgroups]

        def enter_cgroup() -> None:  # in the child, before exec: nspawn starts in its own cgroups
            for procs in cgroup_procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        self._log_file = log.open("wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                                         preexec_fn=enter_cgroup)  # before exec: no thread of ours runs in the child
            self.leader = self._find_leader(boot_timeout)
            self._wait_running(boot_timeout)
        except BaseException:
            self.close()
            raise

    def _find_leader(self, timeout: float) -> int:
        """The container's PID 1 (nspawn's child process named ``systemd``)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                        return int(child)
            time.sleep(0.05)
        raise RuntimeError(f"no systemd in the container after {timeout:.0f} s: {self.log.read_text()[-2000:]}")

    def _wait_running(self, timeout: float) -> None:
        """Until the boot is done (``offline``: PID 1 does not answer on its bus yet)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.sh(["systemctl", "is-system-running", "--wait"], check=False, timeout=timeout)
            state = out.stdout.strip()
            if state in ("running", "degraded"):
                return
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                raise RuntimeError(f"the container's systemd is {state!r}: {out.stderr} {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def sh(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (all its namespaces)."""
        assert self.leader is not None
        return run(["nsenter", "-t", str(self.leader), "-a", *argv], timeout=timeout, check=check)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return self.sh(["systemctl", *args], check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> str:
        return self.sh(["journalctl", "--no-pager", "-b", *args], check=False).stdout

    def close(self) -> None:
        """Power off (bounded), then kill what is left, and remove the cgroups."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                if self.leader is not None:
                    with contextlib.suppress(subprocess.SubprocessError, OSError):
                        self.sh(["systemctl", "poweroff", "--no-block"], check=False, timeout=10)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.send_signal(signal.SIGKILL)
                    self.proc.wait(timeout=10)
        finally:
            self._log_file.close()
            for cg in reversed(self.cgroups):
                self._remove_cgroup(cg)

    @staticmethod
    def _remove_cgroup(cg: Path, timeout: float = 10.0) -> None:
        """Remove ``cg`` and what is under it, killing any process still in it."""
        deadline = time.monotonic() + timeout
        while cg.exists() and time.monotonic() < deadline:
            for sub in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                _kill_and_rmdir(sub)
            _kill_and_rmdir(cg)
            if cg.exists():
                time.sleep(0.1)

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_and_rmdir(cg: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(OSError):
        cg.rmdir()


@contextlib.contextmanager
def machine(root: Path, **kw) -> Iterator[Machine]:
    m = Machine(root, **kw)
    try:
        yield m
    finally:
        m.close()
