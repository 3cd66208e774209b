"""The crash-log corpus the diagnosis tests read: public bug-report logs plus real SGLang runs.

``tests/data/crashlogs/labels.tsv`` (id, label, source thread, note) labels the public logs;
``tests/data/crashlogs/real/labels.tsv`` (file, cause, exit, note), when present, labels the
logs of real SGLang 0.5.23 runs, which count as one more thread.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from supervisor.core.diagnosis import diagnose
from supervisor.core.model import Diagnosis, ExitStatus

CORPUS = Path(__file__).parent / "data" / "crashlogs"
REAL = CORPUS / "real"
MEMORY_CAUSES = frozenset({"cuda_oom_runtime", "cuda_oom_startup", "kv_pool_too_small", "host_oom"})
REAL_THREAD = "real SGLang 0.5.23 runs (tests/data/crashlogs/real)"


@dataclass(frozen=True)
class Entry:
    name: str  # "001", "real/scheduler_sigkill.log"
    path: Path
    label: str
    thread: str  # the bug-report thread the log comes from
    exit_status: ExitStatus | None = None

    def diagnose(self, text: bytes | str | None = None, *, hand_rules: bool | Collection[str] = True) -> Diagnosis:
        data = self.path.read_bytes() if text is None else text
        return diagnose(data, exit_status=self.exit_status, phase=None, hand_rules=hand_rules)


def _thread(source: str) -> str:
    """``owner/repo#N`` of a source column ("sgl-project/sglang#4547 (comment)" -> "...#4547")."""
    return source.split(" ", 1)[0].strip()


def _exit(value: str) -> ExitStatus | None:
    value = value.strip()
    try:
        return ExitStatus.from_returncode(int(value))
    except ValueError:
        return None


def entries() -> list[Entry]:
    """Every labelled log: the public ones, then the real-SGLang ones when labelled."""
    out = []
    for row in (CORPUS / "labels.tsv").read_text().splitlines()[1:]:
        if not row.strip():
            continue
        cols = row.split("\t")
        out.append(Entry(cols[0], CORPUS / f"{cols[0]}.log", cols[1], _thread(cols[2])))
    real_labels = REAL / "labels.tsv"
    if real_labels.is_file():
        for row in real_labels.read_text().splitlines()[1:]:
            cols = row.split("\t")
            if len(cols) < 2 or not cols[0].strip():
                continue
            name = cols[0].strip()
            out.append(Entry(f"real/{name}", REAL / name, cols[1].strip(), REAL_THREAD,
                             _exit(cols[2]) if len(cols) > 2 else None))
    return out


def _table(name: str) -> dict[str, int]:
    """A generated two-column table of ``scripts/rule-history`` (``key  batch ...``)."""
    out = {}
    for line in (CORPUS / name).read_text().splitlines():
        if not line or line.startswith("#") or line.startswith(("id\t", "rule\t")):
            continue
        cols = line.split("\t")
        out[cols[0]] = int(cols[1])
    return out


def batches() -> dict[str, int]:
    """Each log's corpus release (1..4), from ``batches.tsv``."""
    return _table("batches.tsv")


def rule_batches() -> dict[str, int]:
    """Each hand rule's batch: the latest release that was already in the repo when it was
    written (``rule_batches.tsv``, from the git history of the rules)."""
    return _table("rule_batches.tsv")


# Labels whose remedy stops the night: a give-up for any other label is a wrong give-up (a
# deterministic CUDA error read as one is the label's own remedy: "cannot be fixed by a restart").
GIVE_UP_LABELS = frozenset({"gpu_hw_error", "model_load_error", "config_error"})


def wrong_give_up(e: Entry, d: Diagnosis) -> bool:
    from supervisor.core.model import Remedy

    if d.remedy is not Remedy.GIVE_UP or e.label in GIVE_UP_LABELS:
        return False
    return not (e.label == "cuda_error" and str(d.cause) == "cuda_error")


def confusion(results: list[tuple[Entry, str]]) -> collections.Counter[tuple[str, str]]:
    return collections.Counter((e.label, got) for e, got in results)


def matrix_text(counts: collections.Counter[tuple[str, str]]) -> str:
    """The confusion matrix as text (rows: label, columns: diagnosis)."""
    causes = sorted({c for pair in counts for c in pair})
    width = max(map(len, causes))
    lines = ["confusion matrix (rows: label, columns: diagnosis)",
             " " * width + " " + " ".join(f"{i:>3}" for i in range(len(causes)))]
    for i, row in enumerate(causes):
        lines.append(f"{row:>{width}} " + " ".join(f"{counts[(row, col)] or '.':>3}" for col in causes) + f"  [{i}]")
    return "\n".join(lines)
