"""Issue 23, items 6 and 7: a site teaches the supervisor its own words, and what it could not
name is kept for a person.

- ``[[diagnosis.rule]]``: parsed into ``Config.diagnosis.rules`` (inherited by ``[[server]]``
  entries); every refusal is one stderr line and exit 2 from the real ``check-config``;
  the bound on a rule's regex (``site_rules.pattern_problem``) refuses what backtracks without
  bound and accepts what stays fast on the worst line it can meet.
- ``explain --config F`` reads the log with F's rules.
- A crash's ``unrecognised`` line reaches the journal, the morning report's "Crashes it could
  not name" (text and HTML) with a rule to paste that, pasted, names the cause; and the crash
  alert says in words that it does not recognise the error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.cli import explain
from supervisor.core import events as ev
from supervisor.core.config import ConfigError, build_config, load_config
from supervisor.core.diagnosis import MAX_LINE_CHARS, diagnose
from supervisor.core.diagnosis.catalogue import normalise
from supervisor.core.diagnosis.site_rules import (
    LINE_CHARS,
    MAX_PATTERN_CHARS,
    SITE_CAUSES,
    pattern_problem,
    rule_pattern,
    rule_toml,
)
from supervisor.core.model import LOG_CAUSES, Cause, Diagnosis, ExitStatus, Phase, Remedy, SiteRule
from supervisor.sinks.alerts import build_alert
from supervisor.sinks.journal import JOURNAL, JournalSink, read_journal

REPO = Path(__file__).resolve().parent.parent
MODEL = '[server]\nmodel_path = "m"\n'

# A crash whose last words are the site's own: no rule of the supervisor knows them.
FROB = "frobnicator.FrobnicatorError: flux capacitor on device 3 overheated at 88.5 mph (handle 0x7f3a2b1c)"
LOG = "\n".join([
    "[2026-03-01 12:00:00 TP0] Load weight end. avail mem=56.12 GB",
    "[2026-03-01 12:00:01] The server is fired up and ready to roll!",
    "[2026-03-01 13:00:00 TP2] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/sgl/srt/managers/scheduler.py", line 1010, in event_loop_overlap',
    "    batch_result = self.run_batch(batch)",
    '  File "/site/frobnicator/core.py", line 77, in step',
    "    raise FrobnicatorError(msg)",
    FROB,
    "[2026-03-01 13:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
]) + "\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o644)
    return path


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", "check-config", "--config", path.name],
                          capture_output=True, text=True, cwd=path.parent, timeout=60)


# --- the bound on a rule's regex --------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "why"), [
    (r"(a+)+", "nested quantifiers"),
    (r"(a*)*", "nested quantifiers"),
    (r"(.*)*", "nested quantifiers"),
    (r"(\w+\s?)+", "nested quantifiers"),
    (r"x(?:y{1,3}z?)+", "nested quantifiers"),
    (r"(a|ab)+c", "repeated alternation"),
    (r"(?:error|err)*x", "repeated alternation"),
    (r".*b.*c", "wildcards that can match the same text"),
    (r"Error: .* in .* at", "wildcards that can match the same text"),
    (r"a.{0,80}a.{0,80}a.{0,80}b", "wildcards that can match the same text"),
    (r"", "matches an empty line"),
    (r"x?", "matches an empty line"),
    (r"(?:foo)?", "matches an empty line"),
    ("a" * (MAX_PATTERN_CHARS + 1), f"at most {MAX_PATTERN_CHARS}"),
    (r"[unclosed", "not a valid regex"),
    (r"(?P<x>a)(?P<x>b)", "not a valid regex"),
])
def test_a_pattern_that_can_backtrack_without_bound_is_refused(pattern: str, why: str) -> None:
    problem = pattern_problem(pattern)
    assert problem is not None and why in problem, problem


ACCEPTED = [
    r"MyKernelError: .{0,80} failed",
    r"foo.*bar",
    r"^.*Custom.*$",
    r".*Custom.*",
    r"(?:foo|bar)+x",
    r"\d{3}-\d{4}",
    r"(?:\d{3})+x",
    r"a.{0,80}a.{0,80}b",
    r"cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED",
    r"(?i)flux capacitor \w+ overheated",
    r"[^,]*, rank [0-9]+ lost",
]


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_a_bounded_pattern_is_accepted(pattern: str) -> None:
    assert pattern_problem(pattern) is None


def test_what_is_accepted_stays_fast_on_the_worst_lines() -> None:
    """Each accepted pattern against lines made to make it backtrack (its own letters over and
    over, as long as a line the diagnosis reads): well under a second each."""
    for pattern in ACCEPTED:
        rx = re.compile(pattern, re.IGNORECASE)
        letters = "".join(sorted({c for c in pattern if c.isalnum()})) or "a"
        for unit in (letters, letters[:1], letters[:2] + " ", "1", "a, "):
            line = (unit * (LINE_CHARS // len(unit) + 1))[:LINE_CHARS]
            start = time.perf_counter()
            rx.search(line)
            assert time.perf_counter() - start < 1.0, (pattern, unit)


def test_the_bound_knows_the_longest_line_the_diagnosis_reads() -> None:
    assert LINE_CHARS == MAX_LINE_CHARS


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80) | st.text(alphabet="()[]{}*+?|.\\^$aw01,-:", max_size=40))
def test_any_text_gets_an_answer_never_an_exception(pattern: str) -> None:
    problem = pattern_problem(pattern)
    assert problem is None or isinstance(problem, str)
    if problem is None:
        re.compile(pattern, re.IGNORECASE)


# --- [[diagnosis.rule]] in the config ---------------------------------------------------------


def test_rules_are_parsed_in_order_with_their_defaults() -> None:
    cfg = build_config(tomllib.loads(MODEL + """
[[diagnosis.rule]]
match = 'FrobnicatorError: flux capacitor'
cause = "gpu_hw_error"
certain = true

[[diagnosis.rule]]
match = 'MyKernelError: .{0,80} failed'
cause = "cuda_error"
phase = "serving"
"""), where="t.toml")
    assert cfg.diagnosis.rules == (
        SiteRule(match="FrobnicatorError: flux capacitor", cause=Cause.GPU_HW_ERROR, phase=None, certain=True),
        SiteRule(match="MyKernelError: .{0,80} failed", cause=Cause.CUDA_ERROR, phase=Phase.SERVING, certain=False),
    )
    assert build_config(tomllib.loads(MODEL), where="t.toml").diagnosis.rules == ()


def test_every_cause_a_log_can_name_and_none_of_the_daemons_own() -> None:
    assert SITE_CAUSES == LOG_CAUSES
    for cause in Cause:
        doc = MODEL + f"[[diagnosis.rule]]\nmatch = 'x{cause}y'\ncause = \"{cause}\"\n"
        if cause in LOG_CAUSES:
            assert build_config(tomllib.loads(doc), where="t.toml").diagnosis.rules[0].cause is cause
        else:
            with pytest.raises(ConfigError, match="the daemon's own cause"):
                build_config(tomllib.loads(doc), where="t.toml")


def test_several_servers_inherit_the_top_level_rules() -> None:
    cfg = build_config(tomllib.loads("""
[[diagnosis.rule]]
match = 'FrobnicatorError'
cause = "gpu_hw_error"
[[server]]
name = "a"
model_path = "m"
port = 30001
[[server]]
name = "b"
model_path = "m"
port = 30002
"""), where="t.toml")
    assert len(cfg.units) == 2
    assert all(u.diagnosis.rules == cfg.diagnosis.rules != () for u in cfg.units)


def test_a_rule_can_be_set_on_the_command_line(tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", MODEL)
    cfg = load_config(path, ['diagnosis.rule=[{match = "FrobnicatorError", cause = "other", certain = true}]'])
    assert cfg.diagnosis.rules == (SiteRule("FrobnicatorError", Cause.OTHER, None, True),)


REFUSALS = [
    ("match = '(a+)+'\ncause = \"other\"",
     "c.toml: [[diagnosis.rule]] #2 match = '(a+)+': nested quantifiers can backtrack without bound"),
    ("match = '.*b.*c'\ncause = \"other\"", "#2 match = '.*b.*c': wildcards that can match the same text"),
    ("match = '[x'\ncause = \"other\"", "#2 match = '[x': not a valid regex"),
    ("match = 'x*'\ncause = \"other\"", "#2 match = 'x*': matches an empty line"),
    (f"match = '{'a' * 301}'\ncause = \"other\"", "301 characters: at most 300"),
    ("match = 7\ncause = \"other\"", "#2 match = 7: must be a string"),
    ('cause = "other"', "#2 match: missing"),
    ("match = 'x'", "#2 cause: missing: the cause the line names, one of cuda_oom_runtime"),
    ("match = 'x'\ncause = \"cuda_oom\"", "#2 cause = 'cuda_oom': unknown cause; did you mean 'cuda_oom_"),
    ("match = 'x'\ncause = \"hang\"", "#2 cause = 'hang': the daemon's own cause, never read from a log"),
    ("match = 'x'\ncause = \"other\"\nphase = \"serve\"",
     "#2 phase = 'serve': must be \"starting\" or \"serving\"; did you mean 'serving'?"),
    ("match = 'x'\ncause = \"other\"\ncertain = \"yes\"", "#2 certain = 'yes': must be true or false"),
    ("match = 'x'\ncause = \"other\"\ncertian = true", "#2 certian: unknown key; did you mean 'certain'?"),
]


@pytest.mark.parametrize(("second", "line"), REFUSALS)
def test_each_refusal_is_one_line_and_exit_2(tmp_path: Path, second: str, line: str) -> None:
    """The first rule is fine, the second is not: check-config names the file, the rule's
    index, the key, the value and why, on one line, exit 2, no traceback."""
    path = write(tmp_path / "c.toml", MODEL + "[[diagnosis.rule]]\nmatch = 'ok rule'\ncause = \"other\"\n"
                 + "[[diagnosis.rule]]\n" + second + "\n")
    r = check_config(path)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert line in r.stderr


@pytest.mark.parametrize(("doc", "line"), [
    ("[diagnosis.rule]\nmatch = 'x'\ncause = \"other\"\n", "[diagnosis] rule = {"),
    ("[diagnosis]\nrules = []\n", "[diagnosis] rules: unknown key; did you mean 'rule'?"),
    ("diagnosis = 3\n", "[diagnosis] must be a table"),
])
def test_a_malformed_diagnosis_section_is_one_line_and_exit_2(tmp_path: Path, doc: str, line: str) -> None:
    path = write(tmp_path / "c.toml", doc + MODEL if doc.startswith("diagnosis =") else MODEL + doc)
    r = check_config(path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert line in r.stderr


def test_a_good_rule_passes_check_config(tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", MODEL + "[[diagnosis.rule]]\nmatch = 'MyKernelError: .{0,80} failed'\n"
                 'cause = "cuda_error"\nphase = "serving"\ncertain = true\n')
    r = check_config(path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "c.toml: ok\n", "")


# --- explain --config ------------------------------------------------------------------------


def run_explain(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    import argparse

    p = argparse.ArgumentParser(prog="explain")
    explain.add_arguments(p)
    code = explain.run(p.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_explain_reads_the_log_with_the_sites_own_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "server.log"
    log.write_text(LOG)
    code, out, _ = run_explain(["--json", str(log)], capsys)
    assert code == 0 and json.loads(out)["cause"] == "other"
    config = write(tmp_path / "kimi.toml", MODEL + "[[diagnosis.rule]]\nmatch = 'FrobnicatorError: flux capacitor'\n"
                   'cause = "gpu_hw_error"\ncertain = true\n')
    code, out, _ = run_explain(["--json", str(log), "--config", str(config)], capsys)
    obj = json.loads(out)
    assert code == 0
    assert (obj["cause"], obj["certain"], obj["remedy"]) == ("gpu_hw_error", True, "give_up")
    assert obj["basis"].startswith("site rule 1") and obj["evidence"][0] == FROB
    code, out, _ = run_explain([str(log), "-c", str(config)], capsys)
    assert "gpu_hw_error" in out and "basis:     site rule 1" in out


def test_explain_with_several_servers_uses_the_top_level_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "server.log"
    log.write_text(LOG)
    config = write(tmp_path / "two.toml", "[[diagnosis.rule]]\nmatch = 'flux capacitor'\ncause = \"cuda_error\"\n"
                   '[[server]]\nname = "a"\nmodel_path = "m"\nport = 30001\n'
                   '[[server]]\nname = "b"\nmodel_path = "m"\nport = 30002\n')
    code, out, _ = run_explain(["--json", str(log), "--config", str(config)], capsys)
    assert code == 0 and json.loads(out)["cause"] == "cuda_error"


def test_explain_with_a_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(LOG)
    config = write(tmp_path / "bad.toml", MODEL + "[[diagnosis.rule]]\nmatch = '(a+)+'\ncause = \"other\"\n")
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "explain", str(log), "--config", str(config)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "[[diagnosis.rule]] #1 match = '(a+)+': nested quantifiers" in r.stderr


def test_explain_offers_a_rule_for_what_it_could_not_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "server.log"
    log.write_text(LOG)
    code, out, _ = run_explain([str(log)], capsys)
    if "unnamed:" not in out:
        pytest.xfail("diagnose does not set Diagnosis.unrecognised yet")
    rule = out[out.index("[[diagnosis.rule]]"):].splitlines()[:3]
    doc = tomllib.loads("\n".join(line.strip() for line in rule))
    assert re.search(doc["diagnosis"]["rule"][0]["match"], FROB, re.IGNORECASE)


# --- the rule the report offers ----------------------------------------------------------------

LINES = [
    FROB,
    "[2026-03-01 12:00:00 TP0] RuntimeError: MyKernel failed on device 3 at 0x7f3a2b1c with 2.00 GiB "
    "requested (uuid 123e4567-e89b-12d3-a456-426614174000)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "96.00 GiB of which 839.72 MiB is free. Process 123 has 95.1 GiB memory in use. Of the allocated memory "
    "90.2 GiB is allocated by PyTorch, and 1.2 GiB is reserved by PyTorch but unallocated.",
    "ValueError: can't load '/models/kimi/config.json': bad key \"x\"\tnear   line 12",
    "Exception: foo 1.2.3.4:5678 bar 1e-05 baz -3 [done] (a|b)* $HOME \\d",
    "weird \x1b[31m colour ünïcödé ' quote <*> literal",
]


@pytest.mark.parametrize("line", LINES)
def test_the_offered_rule_is_bounded_valid_toml_and_matches_its_line(line: str) -> None:
    normalised = normalise(line)
    pattern = rule_pattern(normalised)
    assert pattern is not None
    assert len(pattern) <= MAX_PATTERN_CHARS and pattern_problem(pattern) is None
    assert re.search(pattern, line, re.IGNORECASE), pattern
    toml = rule_toml(normalised, "cuda_error")
    assert toml is not None and toml.startswith("[[diagnosis.rule]]\n")
    cfg = build_config(tomllib.loads(MODEL + toml), where="t.toml")
    assert cfg.diagnosis.rules == (SiteRule(pattern, Cause.CUDA_ERROR),)


def test_a_cut_line_still_gives_a_rule_that_matches() -> None:
    """The diagnosis keeps 300 characters of the normalised line: a placeholder cut in half
    at the end is dropped, the rest still matches the whole line."""
    normalised = normalise(LINES[1])
    for cut in range(20, len(normalised)):
        pattern = rule_pattern(normalised[:cut])
        assert pattern is None or re.search(pattern, LINES[1], re.IGNORECASE), (cut, pattern)


def test_too_little_text_makes_no_rule_and_the_cause_falls_back_to_other() -> None:
    assert rule_pattern(normalise("x 1 2 0x7f")) is None and rule_toml("x <n> <n>") is None
    toml = rule_toml(normalise(FROB), "hang")  # not a cause a rule may name
    assert toml is not None and 'cause = "other"' in toml


WORDS = st.sampled_from(["Error", "failed", "rank", "flux", "(", ")", "[", "]", "'", '"', ":", ",", ".", "-", "=",
                         "$", "^", "|", "*", "?", "\\", "{", "}", "ünï", "\t", "  ", "<*>", "0x7f3a", "12",
                         "-3", "1e-05", "2.00 GiB", "/a/b/c.py", "/models/x:12", "123e4567-e89b-12d3-a456-426614174000"])


@settings(max_examples=300, deadline=None)
@given(st.lists(WORDS, min_size=1, max_size=40).map(" ".join))
def test_any_line_gets_a_rule_that_matches_it_or_none(line: str) -> None:
    normalised = normalise(line)
    pattern = rule_pattern(normalised)
    if pattern is None:
        return
    assert len(pattern) <= MAX_PATTERN_CHARS and pattern_problem(pattern) is None
    assert re.search(pattern, line, re.IGNORECASE), (line, pattern)
    toml = rule_toml(normalised)
    assert toml is not None and tomllib.loads(toml)["diagnosis"]["rule"][0]["match"] == pattern


# --- the crash event, the journal ---------------------------------------------------------------


def crash(**over: Any) -> ev.Crash:
    base: dict[str, Any] = dict(
        cause=Cause.OTHER, remedy=Remedy.RESTART, phase=Phase.SERVING, exit_code=1, signal=None, evidence=(FROB,),
        evidence_lineno=8, location="core.py:77 step", rank="TP2", exc_type="frobnicator.FrobnicatorError",
        exc_message="flux capacitor", mem_fraction_static=0.93, hicache_size_gb=0.0, attempt=1,
        next_mem_fraction_static=0.93, next_hicache_size_gb=0.0, next_retry_s=10.0, consecutive_failures=1,
        certain=False, unrecognised=normalise(FROB), basis="",
    )
    base.update(over)
    return ev.Crash(**base)


def test_the_crash_event_carries_what_the_diagnosis_could_not_name() -> None:
    from tests.test_machine import Night, emitted

    night = Night()
    night.ready()
    d = Diagnosis(cause=Cause.OTHER, phase=Phase.SERVING, evidence=(FROB,), certain=False,
                  basis="frames: core.py:77 step (frobnicator)", unrecognised=normalise(FROB))
    from supervisor.core.messages import Diagnosed

    fields = emitted(night.send(Diagnosed(ExitStatus(code=1), d)), "crash")
    assert fields["unrecognised"] == normalise(FROB) and fields["basis"] == "frames: core.py:77 step (frobnicator)"
    assert ev.from_fields("crash", fields).fields() == fields  # a journal line reads back as the event


def test_the_journal_keeps_the_unrecognised_line_bounded(tmp_path: Path) -> None:
    sink = JournalSink(tmp_path, clock=lambda: 1_764_460_800.0)
    sink.emit(crash(basis="site rule 1: x"))
    sink.emit(crash(unrecognised="Z" * 5000))
    first, second = read_journal(tmp_path)
    assert first["unrecognised"] == normalise(FROB) and first["basis"] == "site rule 1: x"
    assert len(second["unrecognised"]) == 500
    assert '"unrecognised":' in (tmp_path / JOURNAL).read_text()


# --- the morning report -------------------------------------------------------------------------

T0 = 1_764_460_800.0  # 2025-11-30 00:00 UTC


def _night(state: Path) -> None:
    t = [T0]
    journal = JournalSink(state, clock=lambda: t[0])

    def at(dt: float, event: ev.Event) -> None:
        t[0] = T0 + dt
        journal.emit(event)

    at(0, ev.ServerLaunched(argv=("python",), mem_fraction_static=0.93, hicache_size_gb=None, attempt=1, pid=1,
                            rung=0, launch_id="a"))
    at(3600, crash())  # 01:00: other, its line kept
    at(5400, crash(attempt=2))  # 01:30: the same line again
    at(7200, crash(cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, certain=False, attempt=3,
                   unrecognised="RuntimeError: allocator gave up after <n> tries on GPU <n>"))  # 02:00: uncertain
    at(7300, crash(cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, certain=True, attempt=4,
                   unrecognised="torch.OutOfMemoryError: certain, not listed"))  # certain: named, not listed
    journal.close()


def _report(config: Path, fmt: str, output: str) -> subprocess.CompletedProcess[str]:
    code = ("import sys; from supervisor.cli.report import write_report; from supervisor.core.config import load_config; "
            f"print(write_report(load_config(sys.argv[1]), fmt=sys.argv[2], output=sys.argv[3], since_s=12*3600, "
            f"now={T0 + 9000}))")
    return subprocess.run([sys.executable, "-c", code, str(config), fmt, output], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "TZ": "UTC"}, timeout=120)


def test_the_report_lists_what_it_could_not_name_with_a_rule_that_names_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _night(state)
    config = write(tmp_path / "night.toml", f'{MODEL}[state]\ndir = "{state}"\n')
    r = _report(config, "text", "-")
    assert r.returncode == 0, r.stderr
    section = r.stdout[r.stdout.index("Crashes it could not name:"):r.stdout.index("The night")]
    assert "01:00, 01:30 (2 crashes): read as other" in section
    assert f"line: {normalise(FROB)}" in section
    assert "02:00: read as cuda_oom_runtime (uncertain)" in section
    assert "line: RuntimeError: allocator gave up after <n> tries on GPU <n>" in section
    assert "certain, not listed" not in section
    # The rule as printed, pasted into the config with the cause the person knows it to be:
    block = section[section.index("[[diagnosis.rule]]"):].splitlines()[:3]
    rule = "\n".join(line.strip() for line in block).replace('cause = "other"', 'cause = "gpu_hw_error"')
    assert rule.startswith("[[diagnosis.rule]]\nmatch = '")
    taught = write(tmp_path / "taught.toml", f"{MODEL}{rule}\n")
    rules = load_config(taught).diagnosis.rules
    assert diagnose(LOG, phase=None).cause is Cause.OTHER
    d = diagnose(LOG, phase=None, site_rules=rules)
    assert d.cause is Cause.GPU_HW_ERROR and d.basis.startswith("site rule 1") and d.evidence[0] == FROB

    page = tmp_path / "night.html"
    r = _report(config, "html", str(page))
    assert r.returncode == 0, r.stderr
    source = page.read_text()
    assert "<h3>Crashes it could not name</h3>" in source
    assert '<pre class="rule">[[diagnosis.rule]]\nmatch = &#x27;frobnicator' in source
    assert "01:00, 01:30 (2 crashes)" in source and "cuda_oom_runtime (uncertain)" in source


def test_no_section_when_every_crash_was_named(tmp_path: Path) -> None:
    from supervisor.report import unnamed_crashes

    records = [{"kind": "crash", "t": T0, "cause": "cuda_oom_runtime", "certain": True, "unrecognised": None},
               {"kind": "crash", "t": T0, "cause": "other", "certain": False},
               {"kind": "launch", "t": T0, "unrecognised": "x"}]
    assert unnamed_crashes(records) == []


def test_the_daemons_own_unrecognised_line_round_trips() -> None:
    """What the diagnosis keeps (``unrecognised``), made a rule, then pasted: it names the cause."""
    d = diagnose(LOG, phase=None)
    if d.unrecognised is None:
        pytest.xfail("diagnose does not set Diagnosis.unrecognised yet")
    toml = rule_toml(d.unrecognised, str(d.cause))
    assert toml is not None
    rules = build_config(tomllib.loads(MODEL + toml.replace('"other"', '"nccl_error"')), where="t.toml").diagnosis.rules
    assert diagnose(LOG, phase=None, site_rules=rules).cause is Cause.NCCL_ERROR


# --- the alert's words --------------------------------------------------------------------------

TS = datetime(2026, 10, 4, 3, 12, 9, tzinfo=UTC)


def alert(event: ev.Crash) -> dict[str, Any]:
    payload = build_alert(event, host="gpu-node-3", instance="kimi", ts=TS, alert_id="i",
                          evidence_max_chars=2000)
    assert payload is not None
    return dict(payload)


def test_an_unrecognised_error_is_said_in_words() -> None:
    p = alert(crash())
    assert p["message"] == (
        "sglang kimi on gpu-node-3 crashed at 0.93 with an error it does not recognise: "
        f"{normalise(FROB)}; restarting with backoff at 0.93 in 10 s; it gives up if it repeats"
    )
    assert p["unrecognised"] == normalise(FROB) and p["cause"] == "other" and p["evidence"] == FROB


def test_an_uncertain_reading_says_it_is_unsure() -> None:
    p = alert(crash(cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, next_mem_fraction_static=0.88,
                    unrecognised=None))
    assert p["message"] == ("sglang kimi on gpu-node-3 crashed at 0.93; unsure of the cause (read as cuda_oom_runtime "
                            "while serving, uncertain); restarting with backoff at 0.88 in 10 s; "
                            "it gives up if it repeats")
    assert p["unrecognised"] is None


def test_a_long_unrecognised_line_is_cut_in_the_sentence() -> None:
    p = alert(crash(unrecognised="RuntimeError: " + "x" * 400))
    assert "RuntimeError: " + "x" * 105 + "…; restarting" in p["message"]
    assert len(p["unrecognised"]) == len("RuntimeError: ") + 400


def test_a_certain_crash_keeps_its_words() -> None:
    p = alert(crash(cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN, certain=True, unrecognised=None,
                    next_mem_fraction_static=0.88))
    assert p["message"] == "sglang kimi on gpu-node-3 died of a CUDA OOM while serving at 0.93; restarting at 0.88 in 10 s"


def test_a_kill_from_outside_is_said_in_words() -> None:
    """A main process killed after it was ready with nothing logged: the alert says which
    signal and that nothing was logged, not "an error it does not recognise"."""
    p = alert(crash(killed="SIGKILL", unrecognised=None, evidence=(
        "main process killed by SIGKILL after it was ready; no error was logged since",)))
    assert p["message"] == ("sglang kimi on gpu-node-3 was killed by SIGKILL at 0.93 after it was ready; nothing was "
                            "logged since; restarting with backoff at 0.93 in 10 s; it gives up if it repeats")
