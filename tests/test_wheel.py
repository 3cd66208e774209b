"""The package as a user installs it (issue 33, item 9): ``python -m build`` makes an sdist and
a wheel from it; the wheel, installed into a fresh virtualenv with its ``[sim]`` extra (nothing
of this checkout on its path), answers ``--version``, passes ``check-config`` on the shipped
example and runs the demo.

The built venv is cached by a hash of the sources under
``${SGLANG_SUPERVISOR_CACHE:-~/.cache/sglang-supervisor}/wheel-test/``: the first run builds
and installs (PyPI, through pip's own cache), later runs of the same sources reuse it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from supervisor import __version__
from tests.harness import REPO

# A cold cache builds (isolated: setuptools from PyPI) and installs the dependencies: about 2 min here.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CACHE = Path(os.environ.get("SGLANG_SUPERVISOR_CACHE", Path.home() / ".cache" / "sglang-supervisor")) / "wheel-test"
SOURCES = ("pyproject.toml", "MANIFEST.in", "README.md")


def _source_hash() -> str:
    h = hashlib.sha256()
    files = [REPO / name for name in SOURCES]
    files += sorted(p for p in (REPO / "supervisor").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    files += sorted((REPO / "etc").rglob("*")) + sorted((REPO / "systemd").rglob("*"))
    for path in files:
        if path.is_file():
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _run(*argv: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the venv, the wheel, the sdist): built from these sources, or found in the cache."""
    root = CACHE / _source_hash()
    venv, dist, stamp = root / "venv", root / "dist", root / "installed"
    if not stamp.exists():
        shutil.rmtree(root, ignore_errors=True)
        work = tmp_path_factory.mktemp("build")
        src = work / "src"  # a copy: the build writes *.egg-info and build/ next to the sources
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                                                  "dist", ".pytest_cache", ".hypothesis", ".chaos",
                                                                  ".soak", "bench"))
        _run(sys.executable, "-m", "build", "--outdir", dist, src, cwd=work, timeout=600)
        _run(sys.executable, "-m", "venv", venv, cwd=work)
        wheel = next(dist.glob("*.whl"))
        _run(venv / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}[sim]", cwd=work, timeout=600)
        stamp.write_text("ok\n")
    return venv, next(dist.glob("*.whl")), next(dist.glob("*.tar.gz"))


def test_the_wheel_and_sdist_carry_the_data(installed: tuple[Path, Path, Path]) -> None:
    """The wheel has the catalogue's data and the demo's config; the sdist also has the
    example configs and the systemd unit an operator installs beside it."""
    _, wheel, sdist = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (REPO / "supervisor" / "core" / "diagnosis" / "data").iterdir():
        assert f"supervisor/core/diagnosis/data/{data.name}" in names
    assert "supervisor/sim/demo.toml" in names
    assert f"sglang_supervisor-{__version__}.dist-info/entry_points.txt" in names
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"etc/supervisor.example.toml", "systemd/sglang-supervisor@.service", "etc/grafana/sglang-supervisor.json",
            "etc/prometheus/alerts.yml", "supervisor/sim/demo.toml"} <= members


def test_the_installed_wheel_runs_version_check_config_and_the_demo(
    installed: tuple[Path, Path, Path], tmp_path: Path, no_leftovers: str,
) -> None:
    """From a directory outside the checkout: the installed console script answers --version,
    check-config passes on the shipped example, and the demo's night ends as promised."""
    venv, _, _ = installed
    cli = venv / "bin" / "sglang-supervisor"
    assert _run(cli, "--version", cwd=tmp_path).stdout.strip() == f"sglang-supervisor {__version__}"
    example = tmp_path / "kimi.toml"
    shutil.copyfile(REPO / "etc" / "supervisor.example.toml", example)
    example.chmod(0o644)
    assert _run(cli, "check-config", "--config", example, cwd=tmp_path).stdout.strip() == f"{example}: ok"
    test_id = os.environ.get("SGLANG_SUPERVISOR_TEST_ID", "")
    env_set = f'server.env={{SGLANG_SUPERVISOR_TEST_ID="{test_id}"}}'
    demo = _run(cli, "demo", "--report", "none", "--set", env_set, cwd=tmp_path)
    assert "demo: the supervisor handled the night as promised" in demo.stdout
    assert str(venv) in _run(venv / "bin" / "python", "-c", "import supervisor; print(supervisor.__file__)",
                             cwd=tmp_path).stdout
