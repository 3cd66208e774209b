"""Source contract: every pattern the diagnosis and the startup-facts parser take from SGLang
still occurs in the installed SGLang's source (``site-packages/sglang``).

An SGLang upgrade that rewords one of them then fails this test, not a night in production.
Needles are searched case-insensitively in the source (the diagnosis lowers the log too);
where SGLang builds the text from pieces (an f-string), the rule records the literal pieces
(``source_text``) and those are searched as written. The installed version is named in the
failure message. A missing install fails; it never skips.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from supervisor.adapters.health import QUEUE_REQS, TOKEN_USAGE
from supervisor.core.diagnosis import RULES
from supervisor.core.diagnosis.kv_pressure import KV_PRESSURE_WORDS
from supervisor.core.diagnosis.startup_facts import SOURCE_PATTERNS

DEFAULT_SITE_PACKAGES = Path.home() / ".cache" / "sglang-supervisor" / "sglang-0.5.23" / "lib" / "python3.11" / "site-packages"
TESTED_VERSIONS = ("0.5.23",)


def _site_packages() -> Path:
    try:
        from tests.real.sglang_env import load
    except ImportError:
        return DEFAULT_SITE_PACKAGES
    try:
        return Path(load().site_packages)
    except Exception:  # not set up through `make real-sglang`: the default install place
        return DEFAULT_SITE_PACKAGES


@functools.cache
def _source() -> tuple[str, str]:
    """All of SGLang's Python source, as written and lowered."""
    root = _site_packages() / "sglang"
    files = sorted(root.rglob("*.py")) if root.is_dir() else []
    if not files:
        pytest.fail(f"no SGLang source under {root}: run `make real-sglang` (the contract needs the installed SGLang)")
    text = "\n".join(p.read_text(errors="replace") for p in files)
    return text, text.lower()


def _version() -> str:
    for meta in sorted(_site_packages().glob("sglang-*.dist-info")):
        return meta.name.removeprefix("sglang-").removesuffix(".dist-info")
    return "unknown"


def _sglang_needles() -> list[tuple[str, str, tuple[str, ...]]]:
    out = []
    for rule in RULES:
        pieces = dict(rule.source_text)
        for needle in rule.needles:
            if rule.origin_of(needle) == "sglang":
                out.append((rule.name, needle, pieces.get(needle, ())))
    return out


def test_installed_sglang_is_a_tested_version() -> None:
    """The contract is checked against a version the README names."""
    _source()
    assert _version() in TESTED_VERSIONS, _version()


@pytest.mark.parametrize(("rule", "needle", "pieces"), _sglang_needles(), ids=lambda v: v if isinstance(v, str) else "")
def test_diagnosis_sglang_pattern_is_in_sglang_source(rule: str, needle: str, pieces: tuple[str, ...]) -> None:
    """The text an "sglang" rule pattern looks for is in SGLang's source."""
    text, low = _source()
    if pieces:
        missing = [p for p in pieces if p not in text]
        assert not missing, f"{rule}: pieces {missing} of {needle!r} not in SGLang {_version()}'s source"
    else:
        assert needle in low, f"{rule}: {needle!r} not in SGLang {_version()}'s source"


@pytest.mark.parametrize(
    ("marker", "literals"),
    [(m, lits) for m, origin, lits in SOURCE_PATTERNS if origin == "sglang"],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_startup_facts_sglang_line_is_in_sglang_source(marker: str, literals: tuple[str, ...]) -> None:
    """Every literal piece of a startup line the parser reads is in SGLang's source."""
    text, _ = _source()
    assert literals, f"{marker}: an sglang pattern must record the literal text to find"
    missing = [lit for lit in literals if lit not in text]
    assert not missing, f"{marker}: {missing} not in SGLang {_version()}'s source"


@pytest.mark.parametrize("words", [w for origin, w, _ in KV_PRESSURE_WORDS if origin == "sglang"])
def test_kv_pressure_words_are_in_sglang_source(words: str) -> None:
    """The KV-pressure lines read while serving (core.diagnosis.kv_pressure.KV_PRESSURE_WORDS) are SGLang's,
    and so are the two gauges read from its /metrics."""
    text, _ = _source()
    assert words in text, f"{words!r} not in SGLang {_version()}'s source"
    for gauge in (TOKEN_USAGE, QUEUE_REQS):
        assert f'name="{gauge.decode()}"' in text, f"{gauge!r}: not a metric of SGLang {_version()}"


def test_kv_pressure_lines_read_as_sglang_writes_them() -> None:
    """0.5.23 writes the retraction's details after its prefix: the words looked for follow
    the prefix in the same f-string."""
    text, _ = _source()
    assert '"KV cache pool is full. Retract requests. "' in text
    assert 'f"#retracted_reqs: {len(retracted_reqs)}' in text
