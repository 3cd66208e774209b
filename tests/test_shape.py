"""The house's shape, kept (issue 32): no product module over 600 lines outside the simulator
and the generated data, no function of the core over 80 lines, no room (folder) holding more
than a quarter of the package's lines, every task of the shell started in a task scope, and
``ServerLife`` small. Each check is shown to find what it is for on a planted example."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from supervisor.unit.life import LaunchLife, ServerLife

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "supervisor"
MODULE_LINES = 600
CORE_FUNCTION_LINES = 80
ROOM_SHARE = 0.25
LIFE_ATTRIBUTES = 15


def product_modules() -> list[Path]:
    """The package's Python modules outside the simulator (generated data is not Python)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "sim" not in p.relative_to(PACKAGE).parts)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def long_functions(source: str, path: str, limit: int) -> list[str]:
    """``path:line name (n lines)`` of each def longer than ``limit`` lines."""
    return [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source, path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno
        and node.end_lineno - node.lineno + 1 > limit
    ]


def room_shares(modules: list[Path]) -> dict[str, float]:
    """Each folder's share of the lines (its own files, not its subfolders': a subfolder is a
    room of its own)."""
    rooms: Counter[str] = Counter()
    for path in modules:
        rooms[str(path.parent.relative_to(REPO))] += lines(path)
    total = sum(rooms.values())
    return {room: n / total for room, n in rooms.items()}


def unscoped_tasks(source: str, path: str) -> list[str]:
    """Where ``source`` starts a task itself (``create_task``, ``ensure_future``) instead of in
    a ``TaskScope``; a line that says ``# outside any scope:`` (and why) is allowed."""
    text = source.splitlines()
    return [
        f"{path}:{node.lineno} {node.func.attr if isinstance(node.func, ast.Attribute) else ''}"
        for node in ast.walk(ast.parse(source, path))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("create_task", "ensure_future")
        and "# outside any scope:" not in text[node.lineno - 1]
    ]


def test_no_product_module_is_over_600_lines() -> None:
    over = [f"{p.relative_to(REPO)} ({lines(p)})" for p in product_modules() if lines(p) > MODULE_LINES]
    assert not over, over


def test_no_function_of_the_core_is_over_80_lines() -> None:
    found = [f for p in PACKAGE.joinpath("core").rglob("*.py")
             for f in long_functions(p.read_text(), str(p.relative_to(REPO)), CORE_FUNCTION_LINES)]
    assert not found, found


def test_no_room_holds_more_than_a_quarter_of_the_package() -> None:
    shares = room_shares(product_modules())
    over = {room: f"{share:.0%}" for room, share in shares.items() if share > ROOM_SHARE}
    assert not over, over


def test_every_task_of_the_shell_is_started_in_a_task_scope() -> None:
    """The daemon, the units, the launches and the services start tasks only through
    ``supervisor.aio.TaskScope`` (which alone calls ``create_task``)."""
    paths = [PACKAGE / "daemon.py", *PACKAGE.joinpath("unit").rglob("*.py"), *PACKAGE.joinpath("services").rglob("*.py")]
    found = [f for p in paths for f in unscoped_tasks(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, found


def test_server_life_is_small_and_tracks_no_task_by_hand() -> None:
    """``ServerLife`` keeps 15 attributes or fewer; what a launch holds is its ``LaunchLife``,
    whose task scope ends its probes and watch, so no list of them is kept by hand."""
    init = next(n for n in ast.walk(ast.parse(PACKAGE.joinpath("unit/life.py").read_text()))
                if isinstance(n, ast.ClassDef) and n.name == "ServerLife")
    attributes = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert len(attributes) <= LIFE_ATTRIBUTES, sorted(attributes)
    assert "tasks" in LaunchLife.__dataclass_fields__ and ServerLife.begin
    for word in ("_probes", "_launching"):
        hits = [str(p.relative_to(REPO)) for p in product_modules() if word in p.read_text()]
        assert not hits, (word, hits)


def test_the_checks_find_what_they_are_for() -> None:
    """Planted: a long function, a task started outside a scope, and an allowed one."""
    body = "\n".join(f"    x = {i}" for i in range(81))
    assert long_functions(f"def f():\n{body}\n", "planted.py", CORE_FUNCTION_LINES) == ["planted.py:1 f (82 lines)"]
    assert long_functions("def f():\n    return 1\n", "planted.py", CORE_FUNCTION_LINES) == []
    planted = "import asyncio\nasyncio.create_task(f())\nloop.create_task(g())  # outside any scope: why\n"
    assert unscoped_tasks(planted, "planted.py") == ["planted.py:2 create_task"]
    shares = room_shares([PACKAGE / "daemon.py", PACKAGE / "unit" / "life.py"])
    assert set(shares) == {"supervisor", "supervisor/unit"} and abs(sum(shares.values()) - 1.0) < 1e-9
