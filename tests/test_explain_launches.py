"""``explain`` reads launches (issue 33, item 1): a ``server.log`` holds one launch after another
(the daemon's markers, or a start-up after SGLang's READY line); ``explain`` reads the last
launch that ended, or ``--launch N``, says how it ended, and takes its start-up facts from it.

The logs are built from real ones: ``tests/data/crashlogs/real`` (SGLang 0.5.23 on a GPU: a
SIGTERM drain, the KV-pool guard) and a pasted CUDA OOM while serving (``309.log``), joined
with the markers the daemon writes (``launch_marker``).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from test_explain import parse, run_json

from supervisor.cli import explain
from supervisor.core.diagnosis import MAX_TAIL_BYTES, diagnose
from supervisor.core.diagnosis.launches import launch_end, launch_marker, parse_marker, split_launches

CORPUS = Path(__file__).parent / "data" / "crashlogs"
ARGV = ["python3", "-m", "sglang.launch_server", "--model-path", "/models/tiny-llama", "--port", "30000"]


def _lines(name: str) -> list[str]:
    return (CORPUS / name).read_text().splitlines()


DRAIN = _lines("real/sigterm_drain.log")  # ready, then SIGTERM: drained and exited 0
_SIGTERM = next(i for i, line in enumerate(DRAIN) if "SIGTERM received" in line)
SERVING = DRAIN[:_SIGTERM]  # the same server up to the moment it was sent SIGTERM: ready, serving
OOM_WHILE_SERVING = SERVING + _lines("309.log")  # ... then a CUDA OOM in a forward pass
KV_POOL_FAILURE = _lines("real/kv_pool_too_small.log")  # the KV-pool guard at start-up: no pool, no READY


def with_markers(*launches: list[str]) -> str:
    """The launches as the daemon's server.log holds them: a marker line before each."""
    out = []
    for n, lines in enumerate(launches, 1):
        out.append(launch_marker(n, f"2026-11-30T11:4{n}:00Z", ARGV))
        out.extend(lines)
    return "\n".join(out) + "\n"




def line_at(path: Path, lineno: int) -> str:
    return path.read_text().split("\n")[lineno - 1]


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """Launch 1 crashed while serving (CUDA OOM), 2 was stopped by SIGTERM, 3 failed at start-up."""
    path = tmp_path / "server.log"
    path.write_text(with_markers(OOM_WHILE_SERVING, DRAIN, KV_POOL_FAILURE))
    return path


@pytest.mark.parametrize(("n", "outcome", "cause", "phase", "evidence"), [
    (1, "crashed", "cuda_oom_runtime", "serving", "torch.OutOfMemoryError: CUDA out of memory"),
    (2, "stopped", "other", "serving", None),
    (3, "crashed", "kv_pool_too_small", "starting", "ValueError: Loaded weights leave no GPU memory for the KV cache"),
])
def test_each_launch_is_named_with_its_cause_phase_and_end(three: Path, n: int, outcome: str, cause: str, phase: str,
                                                          evidence: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    """--launch N reads that launch alone: how it ended, its cause and phase, its evidence at
    the file's own line number."""
    obj = run_json(["--launch", str(n), str(three)], capsys)
    launch = obj["launch"]
    assert (launch["number"], launch["of"], launch["outcome"], launch["attempt"]) == (n, 3, outcome, n)
    assert line_at(three, launch["first_lineno"]) == launch_marker(n, f"2026-11-30T11:4{n}:00Z", ARGV)
    assert (obj["cause"], obj["phase"]) == (cause, phase)
    if evidence is None:  # the clean stop: what says so, where
        assert obj["evidence"] == []
        assert "Draining requests and shutting down" in line_at(three, launch["stop_lineno"])
    else:
        assert line_at(three, obj["evidence_lineno"]).startswith(evidence)
        assert launch["stop_lineno"] is None


def test_the_text_says_which_launch_and_how_it_ended(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The text report opens with "launch N of M: ..."; a clean stop has no cause or action rows."""
    assert explain.run(parse(["--launch", "2", str(three)])) == 0
    out = capsys.readouterr().out
    assert out.startswith("launch:    2 of 3: stopped cleanly (the daemon's launch 2 at 2026-11-30T11:42:00Z, line ")
    assert "stopped:   line " in out and "SIGTERM received" in out
    assert "cause:" not in out and "action:" not in out
    assert explain.run(parse(["--launch", "1", str(three)])) == 0
    out = capsys.readouterr().out
    assert out.startswith("launch:    1 of 3: crashed")
    assert "cause:     cuda_oom_runtime" in out


def test_the_default_is_the_last_launch_when_it_ended(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --launch: the last launch, which ended (a start-up failure)."""
    obj = run_json([str(three)], capsys)
    assert (obj["launch"]["number"], obj["launch"]["outcome"], obj["launch"]["note"]) == (3, "crashed", None)
    assert obj["cause"] == "kv_pool_too_small"


def test_a_last_launch_still_running_is_skipped_for_the_last_that_ended(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The last launch logged no death: explain reads the one before it, and says so."""
    path = tmp_path / "server.log"
    path.write_text(with_markers(KV_POOL_FAILURE, OOM_WHILE_SERVING, SERVING))
    obj = run_json([str(path)], capsys)
    assert (obj["launch"]["number"], obj["launch"]["outcome"]) == (2, "crashed")
    assert "launch 3 of 3 is still running" in obj["launch"]["note"]
    assert obj["cause"] == "cuda_oom_runtime"
    obj = run_json(["--launch", "3", str(path)], capsys)
    assert (obj["launch"]["outcome"], obj["cause"]) == ("running", "other")


def test_startup_facts_come_from_the_chosen_launch_only(three: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Launch 3 never built a KV pool: it has no token counts, though launches 1 and 2 do;
    each launch's fraction is its own (0.0001 vs 0.719), and launch 3 never got ready."""
    whole = explain._read(str(three))
    assert whole.spans[0].parser.facts.kv_cache_tokens == 4096
    third = run_json([str(three)], capsys)["startup"]
    assert (third["kv_cache_tokens"], third["max_total_num_tokens"]) == (None, None)
    assert (third["mem_fraction_static"], third["ready"]) == (0.0001, False)
    second = run_json(["--launch", "2", str(three)], capsys)["startup"]
    assert (second["kv_cache_tokens"], second["max_total_num_tokens"]) == (4096, 4096)
    assert (second["mem_fraction_static"], second["ready"]) == (0.719, True)


def test_without_markers_a_start_up_after_ready_begins_the_next_launch(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two READY lines, no markers: the second server's start-up (its server_args line) splits
    the log; the OOM before the last READY is not the last launch's cause."""
    path = tmp_path / "plain.log"
    path.write_text("\n".join(OOM_WHILE_SERVING + DRAIN) + "\n")
    obj = run_json([str(path)], capsys)
    launch = obj["launch"]
    assert (launch["number"], launch["of"], launch["outcome"], launch["attempt"]) == (2, 2, "stopped", None)
    assert line_at(path, launch["first_lineno"]).startswith("[2026-11-30 11:45:59] server_args=")
    assert obj["cause"] != "cuda_oom_runtime"
    first = run_json(["--launch", "1", str(path)], capsys)
    assert (first["launch"]["outcome"], first["cause"], first["phase"]) == ("crashed", "cuda_oom_runtime", "serving")


def test_a_long_launch_keeps_true_line_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A launch longer than the tail that is read, followed by another: its evidence line number
    still counts from the file's start."""
    filler = "[2026-11-30 11:47:00] Decode batch, #running-req: 1, #token: 1197, token usage: 0.29, #queue-req: 0"
    count = MAX_TAIL_BYTES // len(filler) + 2000
    path = tmp_path / "big.log"
    path.write_text(with_markers(SERVING + [filler] * count + _lines("309.log"), KV_POOL_FAILURE))
    obj = run_json(["--launch", "1", str(path)], capsys)
    assert obj["cause"] == "cuda_oom_runtime"
    assert line_at(path, obj["evidence_lineno"]).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert obj["startup"]["ready"] is True  # from the launch's head, beyond its tail


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank"])
def test_empty_input_is_one_line_and_exit_2(tmp_path: Path, content: str, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An empty file, or nothing on stdin: one line on stderr, nothing on stdout, exit 2."""
    path = tmp_path / "empty.log"
    path.write_text(content)
    assert explain.run(parse([str(path)])) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"explain: {path} is empty: there is no log to read\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(content.encode())))
    assert explain.run(parse(["-"])) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "explain: stdin is empty: there is no log to read\n")


@pytest.mark.parametrize("n", ["9", "4", "0", "-1"])
def test_a_launch_not_in_the_log_is_one_line_and_exit_2(three: Path, n: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--launch N with no such launch: one line on stderr naming N, exit 2."""
    assert explain.run(parse(["--launch", n, str(three)])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"explain: --launch {n}: ") and captured.err.count("\n") == 1


# -- the core: splitting and endings, over text


def test_a_marker_reads_back_what_the_daemon_wrote_even_behind_a_prefix() -> None:
    """``parse_marker`` reads ``launch_marker``'s line, also behind a journal's prefix."""
    line = launch_marker(7, "2026-11-30T11:41:00.5+00:00", ARGV)
    for text in (line, "Nov 30 11:41:00 host sglang-supervisor[42]: " + line, line + "\r"):
        marker = parse_marker(text)
        assert marker is not None
        assert (marker.attempt, marker.wall, marker.argv) == (7, "2026-11-30T11:41:00.5+00:00", " ".join(ARGV))
    assert parse_marker("=== sglang-supervisor launch x at y: z") is None
    assert parse_marker(DRAIN[0]) is None


def test_split_keeps_text_before_the_first_marker_only_when_it_holds_a_line() -> None:
    """A rotated log's first, unmarked launch counts; blank lines before a marker do not; inside
    a marked launch, a start-up after READY does not split (only a marker does)."""
    rotated = split_launches("\n".join([*SERVING[-3:], launch_marker(5, "w", ARGV), *SERVING, *SERVING]))
    assert [(launch.marker and launch.marker.attempt, launch.first_lineno) for launch in rotated] == [(None, 1), (5, 4)]
    blank = split_launches("\n\n" + launch_marker(1, "w", ARGV) + "\n" + SERVING[0])
    assert [(launch.marker is not None, launch.first_lineno) for launch in blank] == [(True, 3)]
    assert len(split_launches("\n".join(SERVING + SERVING + SERVING))) == 3


def test_a_forced_exit_on_sigterm_is_no_clean_stop() -> None:
    """SGLang's "Signal SIGTERM received while health check failed. Force exiting." is an
    error, not the drain: the launch crashed."""
    for words in ("Signal SIGTERM received while health check failed. Force exiting.",
                  "Signal SIGTERM received while force shutdown flag set. Force exiting."):
        tail = "\n".join([*SERVING, f"[2026-11-30 11:46:14] {words}"])
        assert launch_end(tail, diagnose(tail, phase=None), followed=True).outcome == "crashed"
    drained = "\n".join(DRAIN)
    end = launch_end(drained, diagnose(drained, phase=None), followed=False)
    assert (end.outcome, end.stop_lineno) == ("stopped", _SIGTERM + 1)
