"""Diagnosis and startup-fact parsing never raise, whatever the bytes (hypothesis)."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.core.diagnosis import INTERNAL_ERROR_TYPE, MAX_TAIL_BYTES, diagnose
from supervisor.core.diagnosis.startup_facts import StartupFactsParser
from supervisor.core.model import LOG_CAUSES, Diagnosis, ExitStatus, Phase

CORPUS = Path(__file__).parent / "data" / "crashlogs"
REAL_LINES = sorted({
    line for path in sorted(CORPUS.glob("*.log")) for line in path.read_text(errors="replace").splitlines()
})
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_sound(d: Diagnosis) -> None:
    assert isinstance(d, Diagnosis)
    assert d.cause in LOG_CAUSES
    assert d.exc_type != INTERNAL_ERROR_TYPE, d.exc_message  # the guard never had to catch
    assert d.evidence_lineno is None or d.evidence_lineno >= 1


exit_statuses = st.one_of(
    st.none(),
    st.builds(ExitStatus, code=st.integers(-(2**31), 2**31)),
    st.builds(ExitStatus, signal=st.integers(0, 128)),
)
lines = st.one_of(st.sampled_from(REAL_LINES), st.text(max_size=200))


@FUZZ
@given(data=st.binary(max_size=4096), exit_status=exit_statuses, phase=st.sampled_from([*Phase, None]))
def test_any_bytes_give_a_diagnosis(data: bytes, exit_status: ExitStatus | None, phase: Phase | None) -> None:
    """Random and non-UTF-8 bytes always give a diagnosis."""
    assert_sound(diagnose(data, exit_status=exit_status, phase=phase))


@FUZZ
@given(text=st.text(max_size=4096))
def test_any_text_gives_a_diagnosis(text: str) -> None:
    """Any str, surrogates and odd line breaks included, gives a diagnosis."""
    assert_sound(diagnose(text))


@FUZZ
@given(
    parts=st.lists(lines, max_size=60),
    sep=st.sampled_from(["\n", "\r\n", "\r", "\n\n"]),
    kernel=st.one_of(st.none(), st.text(max_size=300), st.sampled_from(REAL_LINES)),
    pids=st.lists(st.integers(-5, 2**40), max_size=4),
)
def test_shuffled_real_lines_give_a_diagnosis(parts: list[str], sep: str, kernel: str | None, pids: list[int]) -> None:
    """Real crash lines in random order, mixed with noise, never break the reader."""
    assert_sound(diagnose(sep.join(parts), phase=None, kernel_log=kernel, pids=pids))


@FUZZ
@given(parts=st.lists(lines, max_size=60))
def test_startup_parser_takes_any_line(parts: list[str]) -> None:
    """The startup-facts parser accepts any line."""
    parser = StartupFactsParser()
    for part in parts:
        assert parser.feed(part) in (True, False)
    assert parser.facts.progress


def test_empty_input_is_other() -> None:
    """Empty bytes and empty text give 'other' with no evidence."""
    for empty in (b"", ""):
        d = diagnose(empty)
        assert_sound(d)
        assert d.evidence == ()


def test_one_ten_megabyte_line_gives_a_diagnosis() -> None:
    """A single 10 MB line (no newline at all), plain or full of error words, is handled."""
    assert_sound(diagnose(b"a" * (10 * 1024 * 1024)))
    assert_sound(diagnose(b"CUDA error: out of memory Xid 79 (" * (300 * 1024)))


def test_fifty_megabytes_of_noise_gives_a_diagnosis() -> None:
    """50 MB of random bytes and lines returns (timing lives in bench/)."""
    rng = random.Random(7)
    block = rng.randbytes(1024 * 1024)
    noise = block * 50
    assert len(noise) > 12 * MAX_TAIL_BYTES
    assert_sound(diagnose(noise, exit_status=ExitStatus(signal=9), phase=Phase.SERVING))
    newline_noise = b"\n" * (50 * 1024 * 1024)
    assert_sound(diagnose(newline_noise))
