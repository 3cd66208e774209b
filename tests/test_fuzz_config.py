"""Fuzzed config files: any bytes give a Config or one clear line, never a traceback.

Hypothesis writes TOML documents with random sections, keys, types and values (and random
bytes, and valid documents in other encodings) and loads them in-process with
``load_config``: the only exception allowed is ``ConfigError``, whose text is one line. A
handful of nasty files also go through the real command line (``check-config``): exit 2,
exactly one line on stderr, no traceback.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.core.config import Config, ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name not in ("name", "units")}
KNOWN_KEYS = {
    name: [f.name for f in dataclasses.fields(getattr(Config(), name))] for name in SECTIONS
}
VALID = {"server": {"model_path": "moonshotai/Kimi-K2.5", "port": 30000}}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- a small TOML writer (tomllib only reads) -------------------------------------------------


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (inline tables and arrays for containers)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_string(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def toml_document(doc: dict[str, Any]) -> str:
    """Top-level plain values first, then one ``[section]`` per table."""
    lines = [f"{_string(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for section, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{_string(section)}]")
            lines += [f"{_string(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# --- strategies -----------------------------------------------------------------------------

scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 65535, 65536, 30000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 0.93, 1.0, -0.0, 1e-300]),
    st.text(max_size=40),
    st.sampled_from(["", "none", "nvml", "simulated", "json", "127.0.0.1:9188", "/tmp", "\u202e"]),
    st.dates(),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=10), children, max_size=3),
    ),
    max_leaves=12,
)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid base with random sections, known and unknown keys set to random values."""
    doc: dict[str, Any] = {s: dict(t) for s, t in VALID.items()} if draw(st.booleans()) else {}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.one_of(st.sampled_from(list(SECTIONS)), st.text(min_size=1, max_size=12)))
        if draw(st.integers(0, 9)) == 0:
            doc[section] = draw(values)  # a section that is not a table
            continue
        table = doc.setdefault(section, {}) if isinstance(doc.get(section, {}), dict) else {}
        keys = KNOWN_KEYS.get(section, [])
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(keys)) if keys and draw(st.booleans()) else draw(st.text(min_size=1, max_size=12))
            table[key] = draw(values)
        doc[section] = table
    return doc


def assert_loads_or_one_line(path: Path) -> None:
    """``load_config`` gives a Config, or a ConfigError of one non-empty line."""
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        text = str(exc)
        assert text and "\n" not in text and "Traceback" not in text, text
    else:
        assert isinstance(cfg, Config)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o644)
    return path


# --- in-process fuzzing ---------------------------------------------------------------------


@FUZZ
@given(doc=documents())
def test_random_documents_load_or_fail_in_one_line(tmp_path: Path, doc: dict[str, Any]) -> None:
    """Random sections, keys, types and values: a Config or one ConfigError line."""
    assert_loads_or_one_line(_write(tmp_path / "fuzz.toml", toml_document(doc).encode()))


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes_fail_in_one_line(tmp_path: Path, data: bytes) -> None:
    """Arbitrary bytes (mostly not TOML, often not UTF-8) fail in one line."""
    assert_loads_or_one_line(_write(tmp_path / "fuzz.toml", data))


@FUZZ
@given(doc=documents(), encoding=st.sampled_from(["utf-16", "utf-32", "utf-8-sig", "latin-1", "cp1252", "utf-16-be"]))
def test_documents_in_other_encodings_fail_in_one_line(tmp_path: Path, doc: dict[str, Any], encoding: str) -> None:
    """A document saved in another encoding (or with a BOM) loads or fails in one line."""
    try:
        data = toml_document(doc).encode(encoding)
    except UnicodeEncodeError:
        data = toml_document(doc).encode(encoding, errors="replace")
    assert_loads_or_one_line(_write(tmp_path / "fuzz.toml", data))


@FUZZ
@given(section=st.sampled_from(list(SECTIONS)), data=st.data())
def test_every_known_key_with_any_value_loads_or_fails_in_one_line(tmp_path: Path, section: str, data: st.DataObject) -> None:
    """Each known key of each section, set to a random value on a valid base."""
    key = data.draw(st.sampled_from(KNOWN_KEYS[section]))
    doc: dict[str, Any] = {s: dict(t) for s, t in VALID.items()}
    doc.setdefault(section, {})[key] = data.draw(values)
    assert_loads_or_one_line(_write(tmp_path / "fuzz.toml", toml_document(doc).encode()))


# Inputs that make tomllib itself raise something other than TOMLDecodeError.
NASTY = {
    "huge_integer": b'[server]\nmodel_path = "m"\nport = ' + b"9" * 5000 + b"\n",
    "deep_array": b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "deep_inline_table": b'[server]\nmodel_path = "m"\nenv = ' + b"{a=" * 3000 + b"1" + b"}" * 3000 + b"\n",
    "nul_in_string": b'[server]\nmodel_path = "m\\u0000x"\n',
    "utf16": '[server]\nmodel_path = "m"\n'.encode("utf-16"),
    "random_bytes": bytes(range(256)) * 4,
}


@pytest.mark.parametrize("name", list(NASTY))
def test_nasty_files_fail_in_one_line_in_process(tmp_path: Path, name: str) -> None:
    """Huge integers and deep nesting (tomllib's ValueError/RecursionError) are one line too."""
    assert_loads_or_one_line(_write(tmp_path / f"{name}.toml", NASTY[name]))


@pytest.mark.parametrize("name", list(NASTY))
def test_nasty_files_exit_2_with_one_line_from_the_command_line(tmp_path: Path, name: str) -> None:
    """``check-config`` on a nasty file: exit 2, exactly one stderr line, no traceback."""
    path = _write(tmp_path / f"{name}.toml", NASTY[name])
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check-config", "--config", str(path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("override", ["server.port=" + "9" * 5000, "server.env=" + "{a=" * 3000 + "1" + "}" * 3000,
                                      "server.port=[1,", "nodot=1", "server.=1"])
def test_nasty_overrides_exit_2_with_one_line(tmp_path: Path, override: str) -> None:
    """A nasty ``--set`` value is one line and exit 2 as well."""
    path = _write(tmp_path / "ok.toml", toml_document(VALID).encode())
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check-config", "--config", str(path), "--set", override],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
