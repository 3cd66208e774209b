"""The pure core type-checks under mypy's strict flags, as configured in pyproject.toml, and
the rest of the package under mypy's default settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE_DIR = REPO / "supervisor" / "core"
CORE_PATHS = sorted(p for p in CORE_DIR.rglob("*.py") if p != CORE_DIR / "__init__.py")  # diagnosis/ included
CORE = [".".join(p.relative_to(CORE_DIR).with_suffix("").parts).removesuffix(".__init__") for p in CORE_PATHS]
CORE_FILES = [str(p.relative_to(REPO)) for p in CORE_PATHS]

mypy_main = pytest.importorskip("mypy.main", reason="mypy comes with the [test] extra")


def test_core_has_no_type_errors(tmp_path: Path) -> None:
    """`mypy` on the core modules, with the project's config, reports zero errors."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache"), *CORE_FILES],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert r.returncode == 0, f"mypy found type errors in the core:\n{r.stdout}{r.stderr}"


def test_whole_package_has_no_type_errors(tmp_path: Path) -> None:
    """`mypy supervisor`: the whole package at mypy's default settings (the core keeps its
    strict override from pyproject.toml) reports zero errors. A missing stub package
    (types-psutil, from the [test] extra) counts as an error too."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache"), "supervisor"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert r.returncode == 0, f"mypy found type errors in the package:\n{r.stdout}{r.stderr}"


def test_the_core_override_turns_on_everything_strict_does() -> None:
    """Each core module gets every per-module flag that ``--strict`` sets, so a mypy release
    that adds one to --strict fails here until pyproject.toml lists it too."""
    from mypy.options import PER_MODULE_OPTIONS, Options

    def options(*args: str) -> Options:
        _sources, opts = mypy_main.process_options([*args, "supervisor/core/model.py"])
        return opts

    cwd = os.getcwd()
    os.chdir(REPO)  # mypy finds pyproject.toml from the working directory
    try:
        strict = options("--strict", "--config-file", "")
        plain = options("--config-file", "")
        ours = options("--config-file", "pyproject.toml")
    finally:
        os.chdir(cwd)
    names = [k for k in dir(strict) if not k.startswith("_") and not callable(getattr(strict, k))]
    wanted = {k: getattr(strict, k) for k in names if getattr(strict, k) != getattr(plain, k)}
    assert wanted, "--strict changed no option: mypy's Options API moved"
    for name in CORE:
        module = ours.clone_for_module(f"supervisor.core.{name}")
        got = {k: getattr(module, k) for k in wanted}
        missing = {k: v for k, v in wanted.items() if got[k] != v}
        assert not missing, f"supervisor.core.{name} lacks these --strict flags: {missing}"
    # And nothing strict leaks onto the rest (mypy applies a per-module `strict = true` to all).
    assert not ours.clone_for_module("supervisor.daemon").disallow_untyped_defs
    global_only = {k for k in wanted if k not in PER_MODULE_OPTIONS}
    assert all(getattr(ours, k) == wanted[k] for k in global_only), f"set these in [tool.mypy]: {global_only}"
