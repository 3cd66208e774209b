"""The architecture is enforced: import-linter's contracts (``pyproject.toml``) hold on the
package, and each contract really fails when a module breaks it.

The second test copies the package, plants one forbidden import per case and checks that
``lint-imports`` names the broken contract and the planted line, so a contract that has
quietly stopped matching anything (a renamed package, a typo) fails here too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: import-linter comes with the [test] extra (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )


def test_every_contract_is_kept() -> None:
    """`lint-imports` on the package: every contract in pyproject.toml is kept."""
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and " BROKEN" not in r.stdout


# (module to plant the import in, the import, the contract that must break)
VIOLATIONS = [
    ("core/model.py", "import supervisor.adapters.ports", "layers: cli > daemon"),
    ("core/machine/__init__.py", "import supervisor.sim.simgpu", "the product never imports the simulator"),
    ("daemon.py", "import supervisor.adapters.process", None),  # allowed by the layers: must stay kept
    ("adapters/gpu.py", "import supervisor.adapters.cleanup", "adapters are independent"),
    ("adapters/etcd.py", "import supervisor.adapters.versions", "adapters are independent"),
    ("services/fleet_sync.py", "import supervisor.adapters.etcd", "fleet memory and groups reach etcd and the version probe through ports"),
    ("services/grouping.py", "import supervisor.adapters.etcd", "fleet memory and groups reach etcd and the version probe through ports"),
    ("sinks/logs.py", "import supervisor.sinks.metrics", "sinks are independent of each other"),
    ("sinks/alerts.py", "import supervisor.adapters.mqtt", "layers: cli > daemon"),  # the root wires them
    ("sinks/metrics_endpoint.py", "import supervisor.sinks.metrics", "sinks are independent of each other"),
    ("adapters/mqtt.py", "import supervisor.sinks.alerts", "layers: cli > daemon"),
    ("adapters/mqtt.py", "import supervisor.adapters.router", "adapters are independent"),
    ("services/rolling.py", "import supervisor.services.routing", "services are independent of each other"),
    ("unit/life.py", "import supervisor.core.policy", "the shell decides nothing"),
    ("services/routing.py", "from supervisor.core.policy import decide", "the shell decides nothing"),
    ("cli/run.py", "import supervisor.sim.simgpu", "the CLI reaches the simulator only through cli.registry"),
    ("sim/demo.py", "import supervisor.daemon", "the simulator never imports the daemon"),
    ("core/policy.py", "import asyncio", "the core does no I/O"),
    ("core/diagnosis/crash.py", "import psutil", "the core does no I/O"),
    ("sinks/journal.py", "import matplotlib", "the daemon never imports the report or matplotlib"),
    ("cli/run.py", "import supervisor.report.chart", "the daemon never imports the report or matplotlib"),
    ("services/preflight.py", "import supervisor.adapters.cleanup", "services reach adapters only through the ports"),
    ("services/preflight.py", "import supervisor.adapters.store", "services reach adapters only through the ports"),
    ("services/daily.py", "import supervisor.sinks.journal", "services reach adapters only through the ports, and no sink"),
    ("services/daily.py", "import supervisor.adapters.ports", None),  # the ports: allowed
    ("cli/registry.py", "import supervisor.cli.run", "the registry never imports the composition root"),
    ("cli/common.py", "import supervisor.cli.demo", "the CLI's modules import each other without a cycle"),
]


@pytest.mark.parametrize(("module", "line", "contract"), VIOLATIONS, ids=[f"{m}:{line}" for m, line, _ in VIOLATIONS])
def test_a_planted_import_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str | None) -> None:
    """A copy of the package with one planted import: lint-imports fails, on the contract that
    forbids it among others (or stays green for an import the layers allow)."""
    shutil.copytree(REPO / "supervisor", tmp_path / "supervisor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "supervisor" / module
    target.write_text(target.read_text() + f"\n{line}  # planted by tests/test_layers.py\n")
    r = lint_imports(tmp_path)
    if contract is None:
        assert r.returncode == 0, r.stdout + r.stderr
        return
    assert r.returncode != 0, f"planting {line!r} in {module} broke nothing:\n{r.stdout}"
    # Contracts also see indirect imports, so one planted line may break more than one.
    broken = [ln for ln in r.stdout.splitlines() if " BROKEN" in ln]
    assert any(ln.startswith(contract) for ln in broken), r.stdout
    planted = line.split()[-1]
    # acyclic_siblings names a module relative to its package ("- .common -> .demo (1 import)").
    assert planted in r.stdout or f"-> .{planted.rsplit('.', 1)[-1]} (" in r.stdout, r.stdout


def test_the_daemon_side_loads_no_simulator_torch_or_sglang() -> None:
    """Every module the daemon process can load (the CLI, the composition root, the daemon,
    the services, every adapter and sink) pulls in neither the simulator and its
    ``setproctitle`` and ``aiohttp`` (the ``[sim]`` extra; the daemon speaks HTTP by h11) nor
    torch or sglang, nor matplotlib (the ``[report]``
    extra); nor etcd's client (``aetcd``,
    ``grpc``): that is imported only when ``[fleet]`` (or ``[group]``) is on, by
    ``adapters.etcd``'s first connect (tests/test_fleet_e2e.py checks a running daemon)."""
    modules = [
        "supervisor.cli", "supervisor.cli.run", "supervisor.cli.status", "supervisor.cli.restart",
        "supervisor.cli.preflight", "supervisor.cli.drill", "supervisor.cli.explain", "supervisor.cli.registry",
        "supervisor.cli.fleet", "supervisor.cli.report", "supervisor.daemon", "supervisor.unit",
        *(f"supervisor.services.{p.stem}" for p in (REPO / "supervisor" / "services").glob("*.py")),
        *(f"supervisor.adapters.{p.stem}" for p in (REPO / "supervisor" / "adapters").glob("*.py")),
        *(f"supervisor.sinks.{p.stem}" for p in (REPO / "supervisor" / "sinks").glob("*.py")),
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'setproctitle', 'aiohttp', 'yarl', 'aetcd', 'grpc', 'matplotlib')"
        " or m.startswith(('supervisor.sim', 'supervisor.report')))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], f"the daemon side loaded: {r.stdout}"


def test_a_serving_daemon_loads_only_what_its_config_turns_on() -> None:
    """What ``sglang-supervisor run`` imports before it reads its config (the CLI's parser,
    which imports every command module, the composition root, the daemon) brings no MQTT
    client (aiomqtt, paho: loaded when [mqtt] is on, by ``cli/run.py``), no etcd client, and
    not importlib's resource readers or ``zipfile`` (the diagnosis reads its tables as files):
    each is RSS a daemon without them would hold all night (issue 36: <= 40 MB serving)."""
    code = (
        "import importlib, sys\n"
        "from supervisor.cli import build_parser\n"
        "build_parser()\n"
        "for m in ('supervisor.cli.run', 'supervisor.daemon', 'supervisor.core.diagnosis'): importlib.import_module(m)\n"
        "from supervisor.core.diagnosis import warm\n"
        "warm()\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('aiomqtt', 'paho', 'aetcd', 'grpc', 'zipfile')"
        " or m.startswith('importlib.readers') or m.startswith('importlib.resources'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], f"loaded before the config asked for it: {r.stdout}"
