"""``sglang-supervisor reexec``'s verdict (``supervisor.cli.reexec._said``): each server is
compared with what the old program handed over at the safe point, not with what stood when
the CLI asked, since a launch or stop under way then ends first."""

from __future__ import annotations

import io
from typing import Any

from supervisor.cli.reexec import _said


def _hello(pid: int, started: float, *servers: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "pid": pid, "version": "0.1.0", "program_started": started, "servers": list(servers)}


def _server(pid: int, attempt: int, *, adopted: bool = True, handed: tuple[int, int] | None = None,
            state: str = "READY") -> dict[str, Any]:
    s: dict[str, Any] = {"name": "a", "state": state, "pid": pid, "attempt": attempt, "adopted": adopted}
    if handed is not None:
        s["handed_over"] = {"pid": handed[0], "attempt": handed[1]}
    return s


def test_a_restart_under_way_when_asked_ends_first_and_its_server_is_adopted(capsys: Any) -> None:
    out = io.StringIO()
    before = _hello(10, 1.0, _server(100, 1, adopted=False, state="RESTARTING"))
    after = _hello(10, 2.0, _server(200, 2, handed=(200, 2)))
    assert _said(before, after, out) == 0
    assert "a: READY, pid 200, launch 2: adopted (launch 1, under way when asked, ended first)" in out.getvalue()
    assert capsys.readouterr().err == ""


def test_a_server_that_is_not_the_one_handed_over_is_relaunched(capsys: Any) -> None:
    out = io.StringIO()
    before = _hello(10, 1.0, _server(100, 1, adopted=False))
    after = _hello(10, 2.0, _server(300, 3, handed=(200, 2)))
    assert _said(before, after, out) == 1
    assert "launch 3: relaunched" in out.getvalue()
    assert "not adopted, relaunched: a" in capsys.readouterr().err


def test_an_older_daemon_without_the_hand_over_is_compared_with_what_stood_when_asked(capsys: Any) -> None:
    before = _hello(10, 1.0, _server(100, 1, adopted=False))
    assert _said(before, _hello(10, 2.0, _server(100, 1)), io.StringIO()) == 0
    assert _said(before, _hello(10, 2.0, _server(200, 2)), io.StringIO()) == 1
    assert "not adopted, relaunched: a" in capsys.readouterr().err


def test_a_new_pid_is_not_in_place(capsys: Any) -> None:
    before = _hello(10, 1.0, _server(100, 1, adopted=False))
    out = io.StringIO()
    assert _said(before, _hello(11, 2.0, _server(100, 1, handed=(100, 1))), out) == 1
    assert "pid 11 (CHANGED)" in out.getvalue()
