"""``sglang-supervisor explain``: the report an on-call engineer reads, text and JSON."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli import explain
from supervisor.core.diagnosis import MAX_TAIL_BYTES, diagnose

CORPUS = Path(__file__).parent / "data" / "crashlogs"
TS = "[2026-03-01 12:00:00 TP0] "
STARTUP = "\n".join([
    TS + "Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=56.12 GB, mem usage=83.11 GB.",
    TS + "KV Cache is allocated. #tokens: 1200000, KV size: 40.12 GB",
    TS + "Capture cuda graph end. Time elapsed: 28.12 s. mem usage=13.38 GB. avail mem=0.82 GB.",
    TS + "max_total_num_tokens=1200000, chunked_prefill_size=8192, available_gpu_mem=0.82 GB",
    "[2026-03-01 12:00:01] The server is fired up and ready to roll!",
])
CRASH = "\n".join([
    TS + "Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/sgl/srt/managers/scheduler.py", line 1010, in event_loop_overlap',
    "    batch_result = self.run_batch(batch)",
    '  File "/sgl/srt/models/deepseek_v2.py", line 2919, in forward',
    "    hidden_states = self.model(input_ids, positions, forward_batch)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "[2026-03-01 13:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
])


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="explain")
    explain.add_arguments(p)
    return p.parse_args(argv)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert explain.run(parse(["--json", *argv])) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one object, one line
    return json.loads(out)


@pytest.fixture
def crashed_log(tmp_path: Path) -> Path:
    path = tmp_path / "server.log"
    path.write_text(STARTUP + "\n" + CRASH + "\n")
    return path


def test_text_report_names_cause_evidence_line_location_rank_and_action(crashed_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The text report shows cause, evidence with its line number, location, rank, action."""
    assert explain.run(parse([str(crashed_log)])) == 0
    out = capsys.readouterr().out
    assert "cuda_oom_runtime" in out
    assert "line 11: torch.OutOfMemoryError: CUDA out of memory" in out
    assert "deepseek_v2.py:2919 forward" in out
    assert "TP0" in out
    assert "Lower --mem-fraction-static" in out
    assert "avail_mem_after_capture_gb=0.82" in out


def test_json_report_has_diagnosis_action_and_startup_facts(crashed_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object with the diagnosis, the action and the startup facts."""
    obj = run_json([str(crashed_log)], capsys)
    assert obj["cause"] == "cuda_oom_runtime"
    assert obj["phase"] == "serving"
    assert obj["remedy"] == "fraction_down"
    assert obj["evidence_lineno"] == 11
    assert obj["evidence"][0].startswith("torch.OutOfMemoryError")
    assert obj["location"] == "deepseek_v2.py:2919 forward"
    assert obj["rank"] == "TP0"
    assert obj["exc_type"] == "torch.OutOfMemoryError"
    assert obj["exc_message"].startswith("CUDA out of memory")
    assert obj["action"].startswith("Lower --mem-fraction-static")
    startup = obj["startup"]
    assert startup["kv_cache_tokens"] == 1200000
    assert startup["max_total_num_tokens"] == 1200000
    assert startup["avail_mem_after_capture_gb"] == 0.82
    assert startup["ready"] is True
    assert startup["ranks"]["TP0"]["kv_cache_gb"] == 40.12


def test_startup_facts_are_reported_for_a_log_that_did_not_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A healthy log still gives its startup facts (and an 'other' diagnosis, exit 0)."""
    path = tmp_path / "ok.log"
    path.write_text(STARTUP + "\n")
    obj = run_json([str(path)], capsys)
    assert obj["cause"] == "other"
    assert obj["startup"]["avail_mem_after_capture_gb"] == 0.82
    assert obj["startup"]["progress"] == "ready"


def test_capture_headroom_is_null_when_the_log_has_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No capture-end line: avail_mem_after_capture_gb is null, not guessed."""
    path = tmp_path / "old.log"
    path.write_text(TS + "Capture cuda graph end. Time elapsed: 27.74 s\n")
    assert run_json([str(path)], capsys)["startup"]["avail_mem_after_capture_gb"] is None


def test_stdin_is_read_with_a_dash(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """'-' reads the log from stdin."""
    stdin = io.TextIOWrapper(io.BytesIO(b"ValueError: Not enough host memory available. Requesting 40.00 GB\n"))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert run_json(["-"], capsys)["cause"] == "host_oom"


def test_phase_and_exit_code_options_reach_the_diagnosis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--phase decides a context-free OOM; --exit-code 2 with a usage line is a config error."""
    oom = tmp_path / "oom.log"
    oom.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    assert run_json(["--phase", "starting", str(oom)], capsys)["cause"] == "cuda_oom_startup"
    assert run_json(["--phase", "serving", str(oom)], capsys)["cause"] == "cuda_oom_runtime"
    usage = tmp_path / "usage.log"
    usage.write_text("usage: launch_server.py [-h] --model-path MODEL_PATH\n")
    assert run_json(["--exit-code", "2", str(usage)], capsys)["cause"] == "config_error"


@pytest.mark.parametrize("make", [lambda p: p / "missing.log", lambda p: p], ids=["missing", "directory"])
def test_unreadable_log_is_one_line_on_stderr_and_exit_2(tmp_path: Path, make, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or unreadable path: 'explain: cannot read X: why' on stderr, exit 2."""
    path = make(tmp_path)
    assert explain.run(parse([str(path)])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"explain: cannot read {path}: ")
    assert captured.err.count("\n") == 1


def test_huge_log_keeps_true_line_numbers_and_head_startup_facts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Past MAX_TAIL_BYTES the evidence line number still counts from the file's start."""
    path = tmp_path / "big.log"
    filler = "[2026-03-01 12:30:00] Decode batch. #running-req: 3, #token: 900, token usage: 0.01\n"
    count = MAX_TAIL_BYTES // len(filler) + 5000
    with path.open("w") as f:
        f.write(STARTUP + "\n")
        f.write(filler * count)
        f.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
    obj = run_json([str(path)], capsys)
    assert obj["cause"] == "cuda_error"
    assert obj["evidence_lineno"] == STARTUP.count("\n") + 1 + count + 1
    assert obj["startup"]["avail_mem_after_capture_gb"] == 0.82  # from the head, not the tail


def test_explain_agrees_with_diagnose_on_every_corpus_log(capsys: pytest.CaptureFixture[str]) -> None:
    """explain prints, for every real log, the cause the diagnosis gives it."""
    for path in sorted(CORPUS.glob("*.log")):
        obj = run_json([str(path)], capsys)
        assert obj["cause"] == str(diagnose(path.read_bytes(), phase=None).cause), path.name


def test_module_runs_as_a_real_process(crashed_log: Path, no_leftovers: None) -> None:
    """'python -m supervisor.cli.explain --json LOG' works end to end in its own process."""
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli.explain", "--json", str(crashed_log)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cause"] == "cuda_oom_runtime"


def test_explain_says_how_sure_it_is_and_from_what(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bare OOM: uncertain, with the runner-up and the phase's source, in text and JSON."""
    log = tmp_path / "bare.log"
    log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    assert explain.run(parse([str(log)])) == 0
    text = capsys.readouterr().out
    assert "certainty: uncertain" in text
    assert "runner-up:" in text
    assert "phase:" in text and "(from unknown" in text
    obj = run_json([str(log)], capsys)
    assert obj["certain"] is False
    assert obj["runner_up"] in ("cuda_oom_runtime", "cuda_oom_startup")
    assert obj["phase_source"].startswith("unknown")
    assert obj["remedy"] == "fraction_down"


def test_explain_shows_markers_certainty_and_min_fraction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0.5.23's KV message after start-up markers: certain, the phase from markers, the minimum."""
    log = tmp_path / "kv.log"
    log.write_text(
        "[2026-03-01 12:00:00] server_args=ServerArgs(model_path='m', mem_fraction_static=0.0001, tp_size=1)\n"
        "[2026-03-01 12:00:01] Load weight end. elapsed=0.10 s, type=LlamaForCausalLM, avail mem=0.00 GB, mem usage=0.01 GB.\n"
        "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.0001. "
        "Raise --mem-fraction-static above 0.004 (minimum viable = 1 - available/pre = 0.0031).\n"
    )
    obj = run_json([str(log)], capsys)
    assert (obj["cause"], obj["certain"], obj["min_fraction"]) == ("kv_pool_too_small", True, 0.004)
    assert obj["phase_source"].startswith("markers:")
    assert obj["startup"]["mem_fraction_static"] == 0.0001
    assert explain.run(parse([str(log)])) == 0
    text = capsys.readouterr().out
    assert "certainty: certain" in text and "above 0.004" in text and "(from markers:" in text
