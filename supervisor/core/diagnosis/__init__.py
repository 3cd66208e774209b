"""Crash diagnosis: read a dead SGLang server's log the way an experienced engineer does.

Pure: no I/O, no clock, no asyncio. ``diagnose`` takes the tail of the server's output (and,
when the daemon has them, the exit status, the phase it saw and kernel OOM-killer lines)
and returns a ``model.Diagnosis``: the cause, the evidence line(s) and their line number,
the exception, the innermost frame, the rank and the phase.

How it reads a log (``../shared/sglang-facts.md`` says why each rule holds):

- The cause is the **first failure** of the crash, on any rank, not the last line. Each rule
  says how much its line tells (``strength``): it *names* a cause, it is a *hint* (exit code
  -9, ENOMEM, a list of possible causes: read as ``other`` with ``host_oom`` runner-up), or
  an *echo* of another rank's failure (gloo/NCCL ``Connection closed/reset by peer``, a
  collective watchdog timeout). The first naming line wins, else the first hint, else the
  first echo. Generic lines (``Scheduler hit an exception``, ``SIGQUIT received``,
  ``Received sigquit``, ``Killed``, ``EngineDeadError``...) carry no cause.
- A line is a candidate when it holds one of a rule's needles (cheap substring search over
  the lowered tail); the rule's linear regex and context check then confirm it. Within
  one line, rules are tried in a fixed precedence: hardware, host memory, hints, KV pool,
  CUDA OOM, specific CUDA faults, port, NCCL, echoes, other CUDA errors, watchdog, model,
  config. So a wrapper's message (``Capture cuda graph failed: <real error>``,
  ``MQEngineDeadError ... OutOfMemoryError(...)``) is read for the real error it holds.
- Source lines shown in tracebacks are not evidence (``raise RuntimeError(f"NCCL error...``
  is code, not an error); frame lines are not either.
- Startup vs serving (``_phase_at``): a daemon that saw the server serve is believed
  outright; else the failure report's frames (start-up frames win: they are the outer
  ones); else the last progress line before the error; else progress lines anywhere
  (start-up markers and no ready line mean start-up); else the daemon's STARTING; else
  unknown. ``Diagnosis.phase_source`` says which.
- ``Diagnosis.certain``: the evidence names the cause and, where the remedy depends on the
  phase, the phase is known. An uncertain memory reading gets the least harmful remedy
  (restart, or one rung down for a CUDA OOM of unknown phase) and a ``runner_up``.
- Precision (issue 35): a catalogue match counts only when the message's words are its own
  (``specificity``: not shared with another family's messages); an import/ABI error is the
  environment wherever raised; a kernel record pasted into a log (OOM killer, Xid) is read as
  the kernel's; an errno, a signal or the resource a message names decides before the module
  that raised it (``meaning``); a hand rule is certain only when it cites the source line of
  its words; a start-up-only cause read in a death while serving is uncertain; and an
  uncertain reading never gives up (``verdict.never_on_a_guess``): it restarts with backoff.
- Errors before the last ``ready to roll`` line, or followed by many batch lines, did not
  kill the server and are not the cause (except a failed HTTP bind just before a ready
  line that another server answered).
- An OOM-killer record (a kernel line for one of the server's pids, or a positive
  ``oom_kill_delta`` from the cgroup's ``memory.events``) makes ``other``, NCCL and watchdog
  readings host OOM.
- Mangled logs (``> `` quoting, prefixes, CRLF, a blank line after every line, lines joined)
  are unmangled first; line numbers stay those of the text given.
- Every rule records where its text comes from (``origin``, ``cites``, ``source_text``);
  ``tests/test_diagnosis_provenance.py`` and ``tests/real/test_source_contract.py`` hold
  them to it. ``docs/diagnosis.md`` lists the families and their rules.

Only the last ``MAX_TAIL_BYTES`` of the input are read; no regex can backtrack beyond a
fixed bound; ``diagnose`` never raises.

The package (each module's docstring says more): ``limits`` (how much is read), ``lines``
(line shapes, unmangling), ``markers`` (phase markers), ``log`` (the log, ``_Log``), ``rule``
(the hand rule and its context checks), ``rules/`` (the hand rules, one module per family,
in their precedence), ``families`` (the catalogue's families as pseudo-rules), ``catalogue``
and ``data/`` (the stack's own messages, generated), ``reading`` (the catalogue's reading of
a line), ``findings`` (what each line says; the first failure), ``phase`` (the phase and what
says so), ``verdict`` (a finding as a ``Diagnosis``), ``kernel`` (OOM-killer records),
``crash`` (``diagnose``), ``action`` (``describe_action``), ``meaning`` (errno, signal and
resource words; ``data/meanings.tsv``), ``specificity`` (which catalogue words are shared); and beside them ``site_rules``
(a site's own ``[[diagnosis.rule]]``), ``startup_facts`` (SGLang's start-up lines),
``kv_pressure`` (the KV-pressure words read while serving) and ``launches`` (the daemon's
launch marker; where each launch of a log begins and how it ended).

The names of ``__all__`` are loaded when first asked for (PEP 562): importing
``startup_facts`` or ``site_rules`` (as the config and the capacity model do) loads neither
the rules nor the catalogue's reader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.core.diagnosis.action import describe_action
    from supervisor.core.diagnosis.crash import diagnose, warm
    from supervisor.core.diagnosis.families import FAMILIES, FRAME_READINGS
    from supervisor.core.diagnosis.kernel import kernel_oom_line, read_oom_kill_count
    from supervisor.core.diagnosis.limits import (
        INTERNAL_ERROR_TYPE,
        KEPT_SERVING_BATCHES,
        MAX_CANDIDATES,
        MAX_EVIDENCE_CHARS,
        MAX_LINE_CHARS,
        MAX_LINES,
        MAX_TAIL_BYTES,
    )
    from supervisor.core.diagnosis.lines import tail_text
    from supervisor.core.diagnosis.reading import read_line
    from supervisor.core.diagnosis.rules import RULES

# Each public name -> the module (of this package) that defines it.
_HOMES = {
    "describe_action": "action",
    "diagnose": "crash",
    "warm": "crash",
    "FAMILIES": "families",
    "FRAME_READINGS": "families",
    "kernel_oom_line": "kernel",
    "read_oom_kill_count": "kernel",
    "INTERNAL_ERROR_TYPE": "limits",
    "KEPT_SERVING_BATCHES": "limits",
    "MAX_CANDIDATES": "limits",
    "MAX_EVIDENCE_CHARS": "limits",
    "MAX_LINE_CHARS": "limits",
    "MAX_LINES": "limits",
    "MAX_TAIL_BYTES": "limits",
    "tail_text": "lines",
    "read_line": "reading",
    "RULES": "rules",
}

__all__ = [
    "FAMILIES",
    "FRAME_READINGS",
    "INTERNAL_ERROR_TYPE",
    "KEPT_SERVING_BATCHES",
    "MAX_CANDIDATES",
    "MAX_EVIDENCE_CHARS",
    "MAX_LINES",
    "MAX_LINE_CHARS",
    "MAX_TAIL_BYTES",
    "RULES",
    "describe_action",
    "diagnose",
    "kernel_oom_line",
    "read_line",
    "read_oom_kill_count",
    "tail_text",
    "warm",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use (then kept here)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
