"""The package passes ruff (pyflakes, bugbear, import order, no shell=True)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_package_is_lint_clean() -> None:
    """`ruff check supervisor` reports nothing: unused names, shadowed bugs and shell=True fail CI."""
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "supervisor"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# --- cancellation is never swallowed (supervisor/aio.py says why) ---------------------------

_SWALLOWS = {"CancelledError", "BaseException"}


def _names(node: ast.expr | None) -> set[str]:
    """The terminal names an exception spec mentions: ``asyncio.CancelledError`` -> CancelledError."""
    if node is None:
        return {"BaseException"}  # a bare except
    if isinstance(node, ast.Tuple):
        return {n for elt in node.elts for n in _names(elt)}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    return set()


def cancellation_findings(source: str, path: str) -> list[str]:
    """Where ``source`` may lose a cancellation: ``asyncio.wait_for`` (it swallows one on
    Python 3.11), ``suppress`` of ``CancelledError`` or ``BaseException``, and an ``except``
    that catches them (or a bare one) without re-raising as its last statement."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name) \
                and node.value.id == "asyncio":
            found.append(f"{where}: asyncio.wait_for (use supervisor.aio.within)")
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio" and any(a.name == "wait_for" for a in node.names):
            found.append(f"{where}: from asyncio import wait_for (use supervisor.aio.within)")
        elif isinstance(node, ast.Call) and _names(node.func) & {"suppress"} and any(
            _names(arg) & _SWALLOWS for arg in node.args
        ):
            found.append(f"{where}: suppress() of a cancellation (await a cancelled child with "
                         "supervisor.aio.cancel_and_wait or settled)")
        elif isinstance(node, ast.ExceptHandler) and _names(node.type) & _SWALLOWS:
            last = node.body[-1]
            if not (isinstance(last, ast.Raise) and last.exc is None):
                found.append(f"{where}: catches a cancellation without re-raising it last")
    return found


def test_no_cancellation_is_swallowed_in_the_package() -> None:
    """Every module of the package: no asyncio.wait_for, no suppressed CancelledError, and an
    except that catches one cleans up and re-raises (a child cancelled on purpose is awaited
    with supervisor.aio's helpers)."""
    findings = [f for path in sorted((REPO / "supervisor").rglob("*.py"))
                for f in cancellation_findings(path.read_text(), str(path.relative_to(REPO)))]
    assert not findings, "\n".join(findings)


def test_the_cancellation_check_finds_each_way_to_swallow_one() -> None:
    """The check itself: each pattern that once lost a cancellation is found; the allowed
    ones (clean up, then re-raise; an ordinary exception) are not."""
    bad = {
        "wait_for": "async def f(e):\n    await asyncio.wait_for(e.wait(), 1)\n",
        "from import": "from asyncio import wait_for\n",
        "suppress": "async def f(t):\n    with contextlib.suppress(asyncio.CancelledError):\n        await t\n",
        "suppress base": "async def f(t):\n    with suppress(ValueError, BaseException):\n        await t\n",
        "except": "async def f(t):\n    try:\n        await t\n    except asyncio.CancelledError:\n        pass\n",
        "bare": "def f():\n    try:\n        g()\n    except:\n        log()\n",
        "tuple": "async def f(t):\n    try:\n        await t\n    except (OSError, CancelledError):\n        return 1\n",
        "raise other": "async def f(t):\n    try:\n        await t\n    except BaseException:\n        raise RuntimeError\n",
    }
    for name, source in bad.items():
        assert cancellation_findings(source, name), name
    good = (
        "async def f(t):\n    try:\n        await t\n    except asyncio.CancelledError:\n        t.cancel()\n        raise\n",
        "async def f(t):\n    with contextlib.suppress(TimeoutError):\n        await within(t, 1)\n",
        "def f():\n    try:\n        g()\n    except Exception:\n        pass\n",
    )
    for source in good:
        assert not cancellation_findings(source, "good"), source
