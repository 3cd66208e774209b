"""Perturbation: the corpus logs with timestamps, rank prefixes, '> ' quoting or CRLF added
on every line give the same cause as the logs as found.

Logs reach the daemon through journald, docker, kubectl and chat quotes; the diagnosis must
not depend on how the lines are framed. The result per perturbation is printed.
"""

from __future__ import annotations

from collections.abc import Callable

import diagnosis_corpus
import pytest


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


@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_perturbed_corpus_logs_keep_their_cause(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every corpus log gives the same cause with the perturbation applied."""
    perturb = PERTURBATIONS[name]
    changed = []
    entries = diagnosis_corpus.entries()
    for e in entries:
        text = e.path.read_text(errors="replace")
        before = e.diagnose(text).cause
        after = e.diagnose(perturb(text)).cause
        if after is not before:
            changed.append(f"{e.name}: {before} -> {after}")
    with capsys.disabled():
        print(f"\nperturbation {name!r}: {len(entries) - len(changed)}/{len(entries)} same cause; changed: {changed or 'none'}")
    assert not changed
