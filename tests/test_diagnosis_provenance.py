"""Every rule earns its place: each pattern is seen in logs of at least two threads of the
corpus, or cites the SGLang / torch / NCCL / CUDA / kernel source that prints its text.

A pattern only one log ever showed is overfitting until a second source confirms it. The
table printed here lists, per pattern, its origin, the threads whose logs hold it and the
citation; ``tests/real/test_source_contract.py`` checks the "sglang" ones against the
installed SGLang.
"""

from __future__ import annotations

import collections

import diagnosis_corpus
import pytest

from supervisor.core.diagnosis import RULES
from supervisor.core.diagnosis.startup_facts import SOURCE_PATTERNS

ORIGINS = {
    "sglang", "sglang-legacy", "torch", "nccl", "gloo", "cuda", "nvidia-driver", "nvml", "kernel", "vllm", "ray",
    "python", "hf", "safetensors", "pydantic", "triton", "xla", "torch_npu", "c++", "uvicorn",
}


def _threads_by_needle() -> dict[str, set[str]]:
    texts = [(e.thread, e.path.read_text(errors="replace").lower()) for e in diagnosis_corpus.entries()]
    found: dict[str, set[str]] = collections.defaultdict(set)
    for rule in RULES:
        for needle in rule.needles:
            for thread, text in texts:
                if needle in text:
                    found[needle].add(thread)
    return found


def test_every_rule_pattern_is_seen_twice_or_cites_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    """Each (rule, pattern) matches logs of >= 2 threads, or cites the source line printing it."""
    threads = _threads_by_needle()
    rows, unproven = [], []
    for rule in RULES:
        assert rule.origin in ORIGINS, rule.name
        for needle in rule.needles:
            origin, cite = rule.origin_of(needle), rule.cite_of(needle)
            assert origin in ORIGINS, (rule.name, needle, origin)
            seen = sorted(threads.get(needle, ()))
            sglang_checked = origin == "sglang"  # the source contract greps SGLang's source for it
            ok = len(seen) >= 2 or bool(cite) or sglang_checked
            basis = (f"{len(seen)} threads" if len(seen) >= 2 else
                     f"cites {cite}" if cite else "in SGLang's source (source contract)" if sglang_checked else "NONE")
            rows.append(f"{rule.name:<18} {origin:<14} {needle[:44]!r:<47} {basis[:110]}")
            if not ok:
                unproven.append(f"{rule.name}: {needle!r} ({origin}) seen in {seen}")
    for marker, origin, literals in SOURCE_PATTERNS:
        assert origin in ORIGINS, marker
        rows.append(f"{'startup_facts':<18} {origin:<14} {marker[:44]!r:<47} "
                    f"{'source literals ' + repr(literals)[:90] if literals else 'no literal (not sglang-checked)'}")
    with capsys.disabled():
        print(f"\nrule provenance ({len(rows)} patterns; basis: >= 2 corpus threads, a citation, or SGLang's source)")
        print("\n".join(rows))
    assert not unproven, unproven


def test_sglang_patterns_without_a_literal_citation_are_in_their_source_form() -> None:
    """An "sglang" needle is the text SGLang prints, or records the literal pieces to grep for."""
    for rule in RULES:
        pieces = dict(rule.source_text)
        for needle in rule.needles:
            if rule.origin_of(needle) == "sglang" and needle in pieces:
                assert pieces[needle] and all(isinstance(p, str) and p for p in pieces[needle]), (rule.name, needle)


def test_rule_names_are_unique_and_every_needle_is_lowercase() -> None:
    """Needles are searched in the lowered log: an upper-case needle would never match."""
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert all(n == n.lower() for r in RULES for n in r.needles)
