"""Perturbations of a log: timestamps, rank prefixes, '> ' quoting, CRLF or docker columns
added on every line. ``tests/test_diagnosis.py`` checks that the corpus logs give the same
cause with each (logs reach the daemon through journald, docker, kubectl and chat quotes).
"""

from __future__ import annotations

from collections.abc import Callable


def _per_line(transform: Callable[[str], str]) -> Callable[[str], str]:
    def apply(text: str) -> str:
        return "".join(transform(line) + "\n" for line in text.split("\n"))

    return apply


PERTURBATIONS: dict[str, Callable[[str], str]] = {
    "iso timestamps": _per_line(lambda line: f"2025-04-06T07:44:23.512Z {line}"),
    "bracketed timestamps": _per_line(lambda line: f"[2025-11-06T02:10:00.702Z] {line}"),
    "rank prefix": _per_line(lambda line: f"[2026-01-01 10:00:00 DP1 ATTN_CP0 TP3 EP3] {line}"),
    "quoted": _per_line(lambda line: f"> {line}"),
    "crlf": lambda text: text.replace("\n", "\r\n"),
    "docker column": _per_line(lambda line: f"sglang-1  | {line}"),
    "quoted + timestamps + crlf": lambda text: _per_line(lambda line: f"> 2025-04-06 07:44:23 {line}")(text).replace("\n", "\r\n"),
}
