"""Diagnosis by family: each kind of failure issue 13 names, read the way it looks in general.

Each test builds the family's shape from its parts (frames, markers, wording, prefixes), not
from one corpus file, and checks the cause, the phase and what it was inferred from, the
certainty, the runner-up and the remedy the daemon would apply.
"""

from __future__ import annotations

import pytest

from supervisor.core.diagnosis import diagnose
from supervisor.core.model import Cause, ExitStatus, Phase, Remedy

TS = "[2026-03-01 12:00:00 TP0] "
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 448.00 MiB. GPU 0 has 79 GiB in use."


def tb(funcs: list[str], error: str, prefix: str = "") -> str:
    lines = [f"{prefix}Traceback (most recent call last):"]
    for i, func in enumerate(funcs):
        lines += [f'{prefix}  File "/x/pkg/mod{i}.py", line {10 + i}, in {func}', f"{prefix}    self.{func}()"]
    return "\n".join([*lines, prefix + error]) + "\n"


# --------------------------------------------------------------------------- phase without a flag


@pytest.mark.parametrize(
    "func",
    ["load_weights", "profile_run", "_dummy_sampler_run", "determine_available_memory", "init_memory_pool",
     "capture", "warmup", "_dummy_run", "initialize_kv_cache"],
)
def test_oom_inside_startup_work_is_a_startup_oom(func: str) -> None:
    """An OOM raised inside start-up work is cuda_oom_startup, inferred from the frames."""
    d = diagnose(tb(["run", func, "forward"], OOM), phase=None)
    assert d.cause is Cause.CUDA_OOM_STARTUP
    assert d.phase is Phase.STARTING
    assert d.phase_source.startswith("frames: ")
    assert d.certain
    assert d.remedy in (Remedy.FRACTION_DOWN, Remedy.CLEAR_GPU)


@pytest.mark.parametrize("marker", ["Load weight end. avail mem=20.00 GB", "Loading safetensors checkpoint shards: 3% Completed"])
def test_startup_markers_and_no_ready_line_mean_startup_even_after_the_error(marker: str) -> None:
    """Start-up markers in the log and no ready line: start-up, from markers, certain."""
    log = OOM + "\n" + TS + marker + "\n"
    d = diagnose(log, phase=None)
    assert (d.cause, d.phase, d.certain) == (Cause.CUDA_OOM_STARTUP, Phase.STARTING, True)
    assert "markers" in d.phase_source and "no ready line" in d.phase_source


def test_serving_lines_anywhere_mean_serving() -> None:
    """A request line in the log means the server was serving."""
    log = OOM + "\n" + '[2026-03-01 12:00:00] INFO:     127.0.0.1:1 - "POST /generate HTTP/1.1" 200 OK\n'
    d = diagnose(log, phase=None)
    assert (d.cause, d.phase, d.certain) == (Cause.CUDA_OOM_RUNTIME, Phase.SERVING, True)


def test_bare_oom_of_unknown_phase_is_uncertain_and_takes_one_rung_down() -> None:
    """No phase, no markers, no frames: uncertain; the runner-up is the other OOM; one rung down."""
    d = diagnose(OOM + "\n", phase=None)
    assert d.cause in (Cause.CUDA_OOM_RUNTIME, Cause.CUDA_OOM_STARTUP)
    assert not d.certain
    assert d.runner_up in (Cause.CUDA_OOM_RUNTIME, Cause.CUDA_OOM_STARTUP)
    assert d.runner_up is not d.cause
    assert d.remedy_override is Remedy.FRACTION_DOWN
    assert d.phase_source.startswith("unknown")


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.SERVING])
def test_the_daemons_phase_makes_it_certain(phase: Phase) -> None:
    """When the daemon passes the phase, it is known: phase_source 'daemon', certain."""
    d = diagnose(OOM + "\n", phase=phase)
    assert d.phase_source == "daemon"
    assert d.certain


def test_kv_pool_wording_names_its_phase() -> None:
    """KV-pool sizing text is printed only at start-up: known phase from the evidence, certain, up."""
    d = diagnose("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\n", phase=None)
    assert (d.cause, d.phase, d.certain, d.remedy) == (Cause.KV_POOL_TOO_SMALL, Phase.STARTING, True, Remedy.FRACTION_UP)
    assert d.phase_source.startswith("evidence: ")


def test_uncertain_memory_readings_never_raise_or_halve() -> None:
    """No diagnosis that is uncertain raises the fraction or halves the host cache."""
    logs = [OOM, "RuntimeError: Decode out of memory. Try to lower your batch size.", "Killed", "exit code: -9",
            "OSError: [Errno 12] Cannot allocate memory", "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."]
    for log in logs:
        for phase in (None, Phase.STARTING, Phase.SERVING):
            d = diagnose(log + "\n", phase=phase, exit_status=ExitStatus(signal=9))
            if not d.certain:
                assert d.remedy in (Remedy.RESTART, Remedy.FRACTION_DOWN), (log, phase, d)


# --------------------------------------------------------------------------- new wording


@pytest.mark.parametrize(("current", "minimum"), [("0.0001", 0.004), ("0.85", 0.912)])
def test_0523_kv_wording_is_kv_pool_too_small_with_min_fraction(current: str, minimum: float) -> None:
    """SGLang 0.5.23's 'Loaded weights leave no GPU memory for the KV cache' raises the fraction."""
    line = (
        f"ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={current}. "
        f"Raise --mem-fraction-static above {minimum:.3f} (minimum viable = 1 - available/pre = 0.0031). "
        "If using speculative decoding, draft weights are now counted."
    )
    d = diagnose(tb(["__init__", "init_memory_pool", "profile_max_num_token"], line, TS), phase=None)
    assert (d.cause, d.remedy, d.phase, d.certain) == (Cause.KV_POOL_TOO_SMALL, Remedy.FRACTION_UP, Phase.STARTING, True)
    assert d.min_fraction == pytest.approx(minimum)


# --------------------------------------------------------------------------- echoes


@pytest.mark.parametrize(
    "echo",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234",
        "RuntimeError: Connection reset by peer",
        "[rank1]:[E1001 16:06:04 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600019 milliseconds before timing out.",
    ],
)
def test_echoes_before_the_first_real_failure_do_not_win(echo: str) -> None:
    """A peer's echo printed first (rank order in the log is not time order) does not hide
    the failure on another rank."""
    log = "[2026-03-01 12:00:01 TP1] " + echo + "\n" + tb(["run_batch", "forward"], "RuntimeError: CUDA error: an illegal memory access was encountered", "[2026-03-01 12:00:00 TP3] ")
    d = diagnose(log, phase=Phase.SERVING)
    assert d.cause is Cause.CUDA_ERROR
    assert d.rank == "TP3"


def test_an_echo_alone_is_the_cause() -> None:
    """With nothing else in the log, the NCCL echo is what there is."""
    d = diagnose("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n", phase=None)
    assert d.cause is Cause.NCCL_ERROR


def test_sigquit_from_a_child_is_not_a_cause() -> None:
    """'Received sigquit from a child process' names nothing."""
    d = diagnose("[2026-03-01 12:00:00] Received sigquit from a child process. It usually means the child failed.\n")
    assert d.cause is Cause.OTHER


def test_the_crash_report_helpers_failing_are_not_a_cuda_error() -> None:
    """SGLang 0.5.23 dumps its schedulers with py-spy before it kills its tree (on by default,
    SGLANG_PYSPY_DUMP_BEFORE_CRASH). Without py-spy it logs that at error level, from
    srt/utils/cudacore_pyspy_dump_utils.py: the "cuda" in the module's name once filed the
    helper's own words under cuda.other, and a detokenizer SIGKILLed on a CPU host read as
    a CUDA error (found by the real soak). The helpers report on their own tools: no cause."""
    log = (
        "[2026-12-02 04:00:00] Received sigquit from a child process. It usually means the child failed.\n"
        "[2026-12-02 04:00:00] Pyspy failed (py-spy dump --native --pid 4242). Error: /bin/sh: 1: py-spy: not found\n"
        "[2026-12-02 04:00:00] All pyspy dump attempts failed for PID 4242.\n"
        "[2026-12-02 04:00:01] No sglang scheduler processes found for CUDA coredump.\n"
    )
    d = diagnose(log, exit_status=ExitStatus(signal=9), phase=Phase.SERVING)
    assert d.cause is Cause.OTHER, d
    assert not any("cuda" in e.lower() and "coredump" not in e.lower() for e in d.evidence), d.evidence


@pytest.mark.parametrize(
    "record",
    [
        "kernel: Out of memory: Killed process 4242 (sglang::schedul) total-vm:1kB, anon-rss:1kB",
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
        "Memory on the node was 12.49GB / 13.15GB (0.950003), which exceeds the memory usage threshold of 0.95. "
        "Ray killed this worker because it was the most recently scheduled task",
    ],
)
def test_an_oom_kill_record_in_the_log_is_host_oom_even_when_nccl_lines_come_last(record: str) -> None:
    """A kernel or Ray OOM kill in the log beats the NCCL/gloo lines that follow it."""
    log = record + "\n" + "[rank0]:[E ProcessGroupNCCL.cpp:1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)\n"
    log += "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
    assert diagnose(log, phase=None).cause is Cause.HOST_OOM


# --------------------------------------------------------------------------- host OOM vs SIGKILL


@pytest.mark.parametrize(
    "line",
    [
        "Rank 0 scheduler died during initialization (exit code: -9). If exit code is -9 (SIGKILL), a common cause is the OS OOM killer.",
        "Subprocess scheduler_0 (pid=77) crashed with exit code -9. Triggering SIGQUIT for cleanup...",
        "Worker exit detail: The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is called.",
        "OSError: [Errno 12] Cannot allocate memory",
    ],
)
def test_a_hint_of_host_memory_is_other_with_host_oom_as_runner_up(line: str) -> None:
    """SIGKILL, ENOMEM, or a message listing the OOM killer as a possibility: not evidence."""
    d = diagnose(line + "\n", exit_status=ExitStatus(signal=9), phase=None)
    assert (d.cause, d.runner_up, d.certain, d.remedy) == (Cause.OTHER, Cause.HOST_OOM, False, Remedy.RESTART)
    assert "no OOM-killer record" in d.evidence[-1] or "not evidence" in d.evidence[-1]


def test_a_kernel_record_for_our_pid_makes_the_sigkill_host_oom() -> None:
    """The same SIGKILL with a kernel OOM-killer line for one of our pids is host OOM."""
    d = diagnose("Subprocess scheduler_0 (pid=77) crashed with exit code -9.\n", exit_status=ExitStatus(signal=9),
                 kernel_log="Out of memory: Killed process 77 (python3)\n", pids=[77])
    assert (d.cause, d.certain) == (Cause.HOST_OOM, True)


# --------------------------------------------------------------------------- hardware under other names


@pytest.mark.parametrize(
    ("line", "certain"),
    [
        ("torch.AcceleratorError: CUDA error: Invalid access of peer GPU memory over nvlink or a hardware error", True),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", True),
        # the NVIDIA driver's kernel line and an older CUDA's wording: hand rules with no source
        # line to cite, so not certain: a restart with backoff, the crash-loop give-up if it repeats
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", False),
        ("RuntimeError: CUDA error: uncorrectable NVLink error was detected during the execution", False),
    ],
)
@pytest.mark.parametrize("around", ["nccl", "capture"])
def test_hardware_errors_are_gpu_hw_error_whatever_frames_surround_them(line: str, certain: bool, around: str) -> None:
    """Hardware failures inside an NCCL watchdog or a graph capture are still hardware; only a
    certain reading (CUDA's own table) gives up."""
    funcs = ["ncclCommWatchdog", "all_reduce"] if around == "nccl" else ["init_cuda_graphs", "capture"]
    error = f"Exception: Capture cuda graph failed: {line}" if around == "capture" else line
    d = diagnose(tb(funcs, error), phase=None)
    assert (d.cause, d.certain) == (Cause.GPU_HW_ERROR, certain)
    assert d.remedy is (Remedy.GIVE_UP if certain else Remedy.RESTART)


# --------------------------------------------------------------------------- wrapper advice


@pytest.mark.parametrize(
    ("wrapped", "cause"),
    [
        ("RuntimeError: NCCL error: unhandled system error", Cause.NCCL_ERROR),
        ("KeyError: 'model.layers.0.mlp.gate'", Cause.OTHER),
        ("CUDA error: device-side assert triggered", Cause.CUDA_ERROR),
    ],
)
def test_capture_wrapper_advice_is_not_the_cause(wrapped: str, cause: Cause) -> None:
    """'Capture cuda graph failed' plus its advice to lower the fraction: the wrapped error decides."""
    advice = (
        "Possible solutions:\n1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
        "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)\n"
    )
    d = diagnose(tb(["init_cuda_graphs", "__init__"], f"Exception: Capture cuda graph failed: {wrapped}") + advice, phase=None)
    assert d.cause is cause
    assert d.remedy is not Remedy.FRACTION_DOWN


# --------------------------------------------------------------------------- model load and config


@pytest.mark.parametrize(
    "error",
    [
        "ValueError: Unsupported architectures: FooForConditionalGeneration. Supported list: ['LlamaForCausalLM']",
        "ValueError: Model architectures ['FooForCausalLM'] are not supported for now. Supported architectures: ...",
        "safetensors_rust.SafetensorError: Error while deserializing header: MetadataIncompleteBuffer",
        "OSError: /models/x does not appear to have a file named config.json.",
        "FileNotFoundError: [Errno 2] No such file or directory: '/models/llama/model-00001-of-00004.safetensors'",
        "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory",
    ],
)
def test_model_load_errors(error: str) -> None:
    """Unsupported architectures and missing or corrupt checkpoint files: model_load_error."""
    assert diagnose(tb(["load_model", "load_weights"], error), phase=None).cause is Cause.MODEL_LOAD_ERROR


def test_keyerror_on_a_weight_name_inside_load_weights_even_with_blank_lines_pasted() -> None:
    """A KeyError in load_weights, pasted with '> ' quoting and a blank line after each line."""
    log = tb(["load_model", "load_weights"], "KeyError: 'lm_head.weight'", "> [2025-11-06T02:10:00.702Z] ")
    doubled = "\n> \n".join(log.splitlines()) + "\n"
    assert diagnose(doubled, phase=None).cause is Cause.MODEL_LOAD_ERROR


@pytest.mark.parametrize(
    "error",
    [
        "Value error, Total number of attention heads (64) must be divisible by tensor parallel size (3).",
        "ValueError: Total number of attention heads (32) must be divisible by tensor parallel size (3).",
        "TypeError: 'str' object cannot be interpreted as an integer",
        "TypeError: '<' not supported between instances of 'str' and 'int'",
        "sglang serve: error: argument --tp-size: invalid int value: 'notanint'",
    ],
)
def test_argument_validation_at_startup_is_config_error(error: str) -> None:
    """Argument validation at start-up (a constraint, a wrongly typed value, argparse): config_error.
    It gives up only when certain (argparse's own line, cited); a Python TypeError read by a hand
    rule that cites no source line restarts with backoff instead."""
    d = diagnose(tb(["__init__", "init_torch_distributed", "get_open_port"], error), phase=None)
    assert d.cause is Cause.CONFIG_ERROR
    certain = "argument --tp-size" in error or "divisible by" in error and d.basis.startswith("catalogue")
    assert d.certain is certain, d.basis
    assert d.remedy is (Remedy.GIVE_UP if certain else Remedy.RESTART)


def test_a_type_error_while_serving_is_not_a_config_error() -> None:
    """The same TypeError inside the batch loop is a software bug: other."""
    d = diagnose(tb(["event_loop_overlap", "run_batch"], "TypeError: 'str' object cannot be interpreted as an integer"))
    assert d.cause is Cause.OTHER


# --------------------------------------------------------------------------- mangled logs


def _mangle(text: str, how: str) -> str:
    lines = text.splitlines()
    if how == "quoted":
        return "".join(f"> {line}\n" for line in lines)
    if how == "timestamps":
        return "".join(f"2025-04-06T07:44:23.512Z {line}\n" for line in lines)
    if how == "crlf":
        return "".join(f"{line}\r\n" for line in lines)
    if how == "joined":
        return "  ".join(lines) + "\n"
    return text


@pytest.mark.parametrize("how", ["quoted", "timestamps", "crlf", "joined"])
def test_mangled_logs_are_read_anyway(how: str) -> None:
    """'> ' quoting, timestamps on every line, CRLF, or lines joined: same cause and location."""
    log = tb(["__init__", "init_memory_pool", "load_weights"], "KeyError: 'model.embed_tokens.weight'")
    log = TS + "Load weight begin. avail mem=80.00 GB\n" + log + "x" * 700 + "\n"
    d = diagnose(_mangle(log, how), phase=None)
    assert d.cause is Cause.MODEL_LOAD_ERROR


# --------------------------------------------------------------------------- never raises


def test_new_keyword_never_raises_on_odd_values() -> None:
    """diagnose() answers whatever oom_kill_delta holds."""
    for delta in (-1, 0, 10**12):
        assert diagnose("Killed\n", exit_status=ExitStatus(signal=9), oom_kill_delta=delta).cause in (Cause.OTHER, Cause.HOST_OOM)


# --------------------------------------------------------------------------- a ready line that was not ours


def test_a_failed_bind_before_the_ready_line_is_port_in_use_when_nothing_follows() -> None:
    """uvicorn failed to bind, then 'ready to roll' (the warm-up reached whoever holds the
    port), then the teardown: the cause is the port, not 'other'."""
    log = "\n".join([
        "[2026-03-01 12:00:00] INFO:     Application startup complete.",
        "[2026-03-01 12:00:00] ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use",
        "[2026-03-01 12:00:00] INFO:     Waiting for application shutdown.",
        "[2026-03-01 12:00:02] The server is fired up and ready to roll!",
        "[2026-03-01 12:00:02] INFO:     Application shutdown complete.",
    ]) + "\n"
    d = diagnose(log, exit_status=ExitStatus(code=3), phase=None)
    assert (d.cause, d.remedy) == (Cause.PORT_IN_USE, Remedy.CLEAR_GPU)


def test_a_bind_failure_after_which_uvicorn_did_bind_is_not_the_cause() -> None:
    """'Uvicorn running on' after the failed bind: the server did serve; the later crash decides."""
    log = "\n".join([
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 30000): address already in use",
        "INFO:     Uvicorn running on http://0.0.0.0:30001 (Press CTRL+C to quit)",
        "[2026-03-01 12:00:02] The server is fired up and ready to roll!",
        "Killed",
    ]) + "\n"
    assert diagnose(log, phase=None).cause is Cause.OTHER
