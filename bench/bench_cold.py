"""Cold start (issue 8, row 6): ``--version``, ``run`` to the first exec, no torch/sglang.

- ``sglang-supervisor --version`` against ``supervisord --version``: wall time of the
  whole process, interleaved.
- ``run`` -> first exec of the server: the bench stamps ``monotonic_ns`` just before it
  starts the supervisor; the trampoline stamps the server's exec. Ours clears the
  (simulated) GPUs and runs preflight first, with metrics served; supervisord just spawns.
- Imports: every module of the ``supervisor`` package is imported in a fresh interpreter
  (``pkgutil.walk_packages``); neither ``torch`` nor ``sglang`` may appear in
  ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import (
    BENCH,
    PY,
    Daemon,
    Row,
    Section,
    Settings,
    Stat,
    child_env,
    daemon_sections,
    free_port,
    interleaved,
    read_stamps,
    reap_tagged,
    server_argv,
    simulator,
    timed_run,
    trampoline,
    wait_until,
    write_toml,
)
from .supervisord import Supervisord, clean_env

FORBIDDEN = ("torch", "sglang")
IMPORT_ALL = f"""
import importlib, json, pkgutil, sys
import supervisor
mods = [m.name for m in pkgutil.walk_packages(supervisor.__path__, "supervisor.") if not m.name.endswith(".__main__")]
for name in mods:
    importlib.import_module(name)
bad = sorted(k for k in sys.modules if k.split(".")[0] in {FORBIDDEN!r})
print(json.dumps({{"modules": mods, "forbidden": bad, "file": supervisor.__file__}}))
"""


def _sections(settings: Settings, work: Path) -> dict[str, dict[str, object]]:
    sim = simulator("--sim-load-s", "0.2")
    return daemon_sections(settings, work, trampoline(work / "exec.stamps", sim), {
        "metrics": {"enabled": True, "listen": f"127.0.0.1:{free_port()}"},
    })


def _first_exec(started_ns: int, work: Path, alive: Callable[[], bool]) -> float:
    """Milliseconds from the supervisor's start to the server's first exec."""
    wait_until(lambda: read_stamps(work / "exec.stamps") or not alive(), 120, "the first exec")
    stamps = read_stamps(work / "exec.stamps")
    if not stamps:
        raise RuntimeError(f"the supervisor died before the first exec ({work})")
    return (stamps[0] - started_ns / 1e9) * 1e3


def _ours_first_exec(settings: Settings, work: Path) -> float:
    daemon = Daemon(settings, work, _sections(settings, work))
    try:
        return _first_exec(daemon.started_ns, work, lambda: daemon.proc.poll() is None)
    finally:
        daemon.stop()
        reap_tagged(settings.tag)


def _supervisord_first_exec(settings: Settings, exe: Path, work: Path) -> float:
    sections = _sections(settings, work)
    argv = server_argv(write_toml(work / "argv.toml", sections))
    sv = Supervisord(exe, work, argv, {**child_env(settings), **sections["server"]["env"]})
    try:
        return _first_exec(sv.started_ns, work, sv.alive)
    finally:
        sv.stop()
        reap_tagged(settings.tag)


def _imports() -> dict[str, Any]:
    done = subprocess.run([PY, "-c", IMPORT_ALL], capture_output=True, text=True, check=True, cwd=BENCH.parent)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(settings: Settings, exe: Path) -> Section:
    versions = 2 if settings.quick else 5
    ours_cli = str(Path(PY).parent / "sglang-supervisor")
    v: dict[str, list[float]] = {"ours": [], "supervisord": []}
    for r in range(versions):
        for who in interleaved(r):
            argv = [ours_cli, "--version"] if who == "ours" else [str(exe), "--version"]
            v[who].append(1e3 * timed_run(argv, env=clean_env()))
    first: dict[str, list[float]] = {"ours": [], "supervisord": []}
    for r in range(settings.repeats):
        for who in interleaved(r):
            work = settings.dir(f"cold-{who}-{r}")
            first[who].append(_ours_first_exec(settings, work) if who == "ours"
                              else _supervisord_first_exec(settings, exe, work))
    imports = _imports()
    bad: list[str] = imports["forbidden"]
    section = Section("cold", raw={"version_ms": v, "first_exec_ms": first, "imports": imports})
    section.rows += [
        Row("cold_version", "`--version`, whole process", "ms", Stat.of(v["ours"]), Stat.of(v["supervisord"])),
        Row("cold_first_exec", "`run` → first exec of the server", "ms", Stat.of(first["ours"]),
            Stat.of(first["supervisord"]), note="ours checks the GPUs (simulated), runs preflight, serves metrics"),
        Row("cold_imports", "torch / sglang in `sys.modules` after importing every module", "", None,
            goal="none", met=not bad, text=", ".join(bad) or f"none ({len(imports['modules'])} modules)"),
    ]
    return section
