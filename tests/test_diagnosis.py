"""Crash diagnosis: the rules of judgment, one by one, and accuracy on the real-log corpus."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import diagnosis_corpus
import pytest
from conftest import free_port
from diagnosis_perturb import PERTURBATIONS

from supervisor.core.diagnosis import (
    INTERNAL_ERROR_TYPE,
    MAX_TAIL_BYTES,
    describe_action,
    diagnose,
    kernel_oom_line,
    read_oom_kill_count,
    tail_text,
)
from supervisor.core.model import LOG_CAUSES, Cause, Diagnosis, ExitStatus, Phase, Remedy

MEMORY_CAUSES = diagnosis_corpus.MEMORY_CAUSES

TS = "[2026-03-01 12:00:00 TP0] "


def sim_runtime_oom(prefix: str = TS) -> str:
    """The simulator's runtime OOM: a scheduler traceback, then SGLang's SIGQUIT line."""
    body = [
        "Scheduler hit an exception: Traceback (most recent call last):",
        '  File "/opt/sglang/python/sglang/srt/managers/scheduler.py", line 2890, in run_scheduler_process',
        "    scheduler.event_loop_overlap()",
        '  File "/opt/sglang/python/sglang/srt/managers/scheduler.py", line 1010, in event_loop_overlap',
        "    batch_result = self.run_batch(batch)",
        '  File "/opt/sglang/python/sglang/srt/models/deepseek_v2.py", line 2919, in forward',
        "    hidden_states = self.model(input_ids, positions, forward_batch)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 95.00 GiB of which 1.12 GiB is free.",
    ]
    lines = [TS + body[0], *(prefix + line for line in body[1:])]
    lines.append("[2026-03-01 12:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    return "\n".join(lines) + "\n"


def traceback(frames: list[tuple[str, int, str, str]], error: str, prefix: str = "") -> str:
    """A Python traceback with the given (file, line, function, source) frames."""
    lines = [f"{prefix}Traceback (most recent call last):"]
    for path, lineno, func, source in frames:
        lines += [f'{prefix}  File "{path}", line {lineno}, in {func}', f"{prefix}    {source}"]
    return "\n".join([*lines, prefix + error]) + "\n"


INIT_FRAMES = [
    ("/sgl/srt/managers/scheduler.py", 2009, "run_scheduler_process", "scheduler = Scheduler(server_args, port_args)"),
    ("/sgl/srt/managers/tp_worker.py", 74, "__init__", "self.model_runner = ModelRunner("),
    ("/sgl/srt/model_executor/model_runner.py", 216, "initialize", "self.init_memory_pool()"),
]
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 448.00 MiB."


# --------------------------------------------------------------------------- the simulator's shapes


@pytest.mark.parametrize("prefix", [TS, ""], ids=["prefixed", "bare"])
@pytest.mark.parametrize("phase", [Phase.SERVING, None])
def test_simulator_runtime_oom_reads_as_runtime_with_location_and_rank(prefix: str, phase: Phase | None) -> None:
    """The simulator's serving OOM is cuda_oom_runtime at deepseek_v2.py:2919 forward on TP0."""
    d = diagnose(sim_runtime_oom(prefix), exit_status=ExitStatus(signal=9), phase=phase)
    assert d.cause is Cause.CUDA_OOM_RUNTIME
    assert d.remedy is Remedy.FRACTION_DOWN
    assert d.location == "deepseek_v2.py:2919 forward"
    assert d.rank == "TP0"
    assert d.phase is Phase.SERVING
    assert d.exc_type == "torch.OutOfMemoryError"
    assert d.exc_message and d.exc_message.startswith("CUDA out of memory")
    assert d.evidence_lineno == 8


def test_not_enough_memory_at_startup_raises_the_fraction() -> None:
    """'Not enough memory ... increase --mem-fraction-static' is a KV pool too small: go up."""
    log = traceback(INIT_FRAMES, "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: 0.70", TS)
    d = diagnose(log, phase=Phase.STARTING)
    assert d.cause is Cause.KV_POOL_TOO_SMALL
    assert d.remedy is Remedy.FRACTION_UP
    assert d.phase is Phase.STARTING
    assert d.location == "model_runner.py:216 initialize"


# --------------------------------------------------------------------------- OOM: which way to move


def test_oom_during_cuda_graph_capture_lowers_the_fraction() -> None:
    """A CUDA OOM wrapped by 'Capture cuda graph failed' is a startup OOM: fraction down."""
    frames = [*INIT_FRAMES[:2], ("/sgl/srt/model_executor/model_runner.py", 934, "init_cuda_graphs", "self.cuda_graph_runner = CudaGraphRunner(self)")]
    d = diagnose(traceback(frames, "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 448.00 MiB."), phase=None)
    assert (d.cause, d.remedy, d.phase) == (Cause.CUDA_OOM_STARTUP, Remedy.FRACTION_DOWN, Phase.STARTING)


@pytest.mark.parametrize(
    "frame",
    [
        ("/sgl/srt/model_executor/model_runner.py", 361, "load_model", "self.model = get_model("),
        ("/sgl/srt/model_executor/model_runner.py", 1740, "init_memory_pool", "self.token_to_kv_pool = MHATokenToKVPool("),
    ],
    ids=["weights", "kv_pool_init"],
)
def test_oom_while_loading_weights_or_allocating_the_pool_clears_the_gpu(frame: tuple[str, int, str, str]) -> None:
    """An OOM in load_model/init_memory_pool is not fixed by a lower fraction: clear the GPU."""
    d = diagnose(traceback([*INIT_FRAMES, frame], OOM), phase=Phase.STARTING)
    assert d.cause is Cause.CUDA_OOM_STARTUP
    assert d.remedy is Remedy.CLEAR_GPU


def test_oom_after_weight_loading_progress_line_clears_the_gpu() -> None:
    """With no frames, the last progress line (weights still loading) decides the stage."""
    log = TS + "Load weight begin. avail mem=78.00 GB\n" + TS + "Failed to initialize moe: CUDA out of memory. Tried to allocate 24.00 MiB.\n"
    d = diagnose(log, phase=None)
    assert (d.cause, d.remedy) == (Cause.CUDA_OOM_STARTUP, Remedy.CLEAR_GPU)


def test_bare_oom_follows_the_phase_the_daemon_saw() -> None:
    """A CUDA OOM with no context is startup or runtime as the daemon saw the server."""
    assert diagnose(OOM, phase=Phase.STARTING).cause is Cause.CUDA_OOM_STARTUP
    assert diagnose(OOM, phase=Phase.SERVING).cause is Cause.CUDA_OOM_RUNTIME


def test_daemon_serving_phase_is_believed_over_startup_looking_frames() -> None:
    """Once /health answered 200 the server was serving, whatever the frames suggest."""
    assert diagnose(traceback(INIT_FRAMES, OOM), phase=Phase.SERVING).cause is Cause.CUDA_OOM_RUNTIME


def test_serving_context_overrides_a_starting_daemon_phase() -> None:
    """Batch lines and forward frames before the OOM mean it happened while serving."""
    log = TS + "Decode batch. #running-req: 12, #token: 4000, token usage: 0.40\n" + traceback(
        [("/sgl/srt/model_executor/model_runner.py", 1199, "forward_extend", "return self.model.forward(")], OOM
    )
    assert diagnose(log, phase=Phase.STARTING).cause is Cause.CUDA_OOM_RUNTIME


def test_kv_pool_exhausted_while_serving_restarts_without_raising() -> None:
    """'Decode out of memory' is the KV pool, never CUDA memory; while serving: plain restart."""
    d = diagnose(TS + "Decode batch. #running-req: 167\nRuntimeError: Decode out of memory. Try to lower your batch size.\n", phase=None)
    assert d.cause is Cause.KV_POOL_TOO_SMALL
    assert d.phase is Phase.SERVING
    assert d.remedy is Remedy.RESTART


def test_nccl_failure_to_allocate_is_a_cuda_oom() -> None:
    """An NCCL 'unhandled cuda error' whose details say 'out of memory' is a CUDA OOM."""
    log = (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
        "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'\n"
    )
    assert diagnose(log, phase=Phase.SERVING).cause is Cause.CUDA_OOM_RUNTIME


# --------------------------------------------------------------------------- host memory


def test_pin_memory_invalid_argument_is_host_memory() -> None:
    """'CUDA error: invalid argument' from torch.empty(pin_memory=True) is host memory."""
    frames = [("/sgl/srt/mem_cache/memory_pool_host.py", 240, "init_kv_buffer", "return torch.empty(size, pin_memory=True)")]
    d = diagnose(traceback(frames, "RuntimeError: CUDA error: invalid argument"))
    assert (d.cause, d.remedy) == (Cause.HOST_OOM, Remedy.HICACHE_DOWN)
    assert d.evidence[0] == "RuntimeError: CUDA error: invalid argument"
    assert any("pin_memory" in line for line in d.evidence)


def test_invalid_argument_without_pinned_memory_is_a_cuda_error() -> None:
    """The same message from a kernel launch is a CUDA error, not host memory."""
    frames = [("/x/flash_attn_interface.py", 233, "flash_attn_varlen_func", "out = torch.ops.fa.varlen_fwd(")]
    assert diagnose(traceback(frames, "RuntimeError: CUDA error: invalid argument")).cause is Cause.CUDA_ERROR


def test_sigkill_without_traceback_plus_kernel_oom_line_is_host_oom() -> None:
    """SIGKILL, no traceback, and the kernel OOM-killed one of our pids: host OOM."""
    kernel = "[12345.6] Out of memory: Killed process 4242 (python3) total-vm:1234kB, anon-rss:99kB\n"
    d = diagnose("[2026-03-01 12:00:00] Decode batch. #running-req: 3\n", exit_status=ExitStatus(signal=9),
                 phase=Phase.SERVING, kernel_log=kernel, pids=[4241, 4242])
    assert d.cause is Cause.HOST_OOM
    assert d.evidence == (kernel.strip(),)


def test_kernel_oom_line_for_a_foreign_pid_does_not_count() -> None:
    """A kernel OOM kill of someone else's process says nothing about our crash."""
    kernel = "Out of memory: Killed process 999 (java)\n"
    d = diagnose("Killed\n", exit_status=ExitStatus(signal=9), kernel_log=kernel, pids=[4242])
    assert d.cause is Cause.OTHER
    assert kernel_oom_line("oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=4242,uid=0", [4242])


def test_kernel_oom_does_not_override_a_specific_log_cause() -> None:
    """A named cause in the log (here a bad flag) stands even with a kernel OOM line."""
    d = diagnose("launch_server.py: error: unrecognized arguments: --tp 8\n", kernel_log="Out of memory: Killed process 7 (python)", pids=[7])
    assert d.cause is Cause.CONFIG_ERROR


@pytest.mark.parametrize(
    "line",
    [
        "[2026-03-01 12:00:00] Rank 0 scheduler died during initialization (exit code: -9). "
        "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.",
        "[2026-03-01 12:00:00] Subprocess scheduler_0 (pid=1234) crashed with exit code -9. Triggering SIGQUIT for cleanup...",
    ],
)
def test_scheduler_killed_by_sigkill_without_a_record_is_other(line: str) -> None:
    """A SIGKILL with no OOM-killer record is 'other' (a person or a scheduler may have sent
    it); SGLang's 'a common cause is the OS OOM killer' is a hint, not evidence."""
    d = diagnose(line + "\nKilled\n", exit_status=ExitStatus(signal=9))
    assert d.cause is Cause.OTHER
    assert d.remedy is Remedy.RESTART
    assert d.runner_up is Cause.HOST_OOM
    assert not d.certain
    assert "killed by SIGKILL, no OOM-killer record" in d.evidence[-1]


@pytest.mark.parametrize("delta", [1, 3])
def test_cgroup_oom_kill_count_makes_a_sigkill_host_oom(delta: int) -> None:
    """A positive oom_kill delta in the service cgroup's memory.events is an OOM-killer record."""
    line = "[2026-03-01 12:00:00] Subprocess scheduler_0 (pid=1234) crashed with exit code -9. Triggering SIGQUIT for cleanup...\n"
    d = diagnose(line, exit_status=ExitStatus(signal=9), oom_kill_delta=delta)
    assert (d.cause, d.remedy, d.certain) == (Cause.HOST_OOM, Remedy.HICACHE_DOWN, True)
    assert d.evidence[0] == f"cgroup memory.events: oom_kill +{delta} while the server ran"


@pytest.mark.parametrize("delta", [0, None])
def test_no_oom_kill_count_leaves_a_sigkill_other(delta: int | None) -> None:
    """A zero or unknown oom_kill delta is no record: the SIGKILL stays 'other'."""
    d = diagnose("Killed\n", exit_status=ExitStatus(signal=9), oom_kill_delta=delta)
    assert d.cause is Cause.OTHER
    assert d.evidence == ("main process killed by SIGKILL, no OOM-killer record",)


def test_oom_kill_count_does_not_override_a_named_cause() -> None:
    """An OOM kill elsewhere in the cgroup does not turn a bad flag into host OOM."""
    d = diagnose("launch_server.py: error: unrecognized arguments: --tp 8\n", oom_kill_delta=1)
    assert d.cause is Cause.CONFIG_ERROR


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n", 2),
        ("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", 0),
        ("low 0\nhigh 0\n", None),
        ("", None),
        ("oom_group_kill 4\n", None),
    ],
)
def test_read_oom_kill_count_parses_memory_events(text: str, count: int | None) -> None:
    """read_oom_kill_count reads the oom_kill line only (not oom or oom_group_kill)."""
    assert read_oom_kill_count(text) == count


def test_kills_after_sglang_sigquit_are_its_own_cleanup() -> None:
    """After 'Received sigquit' SGLang SIGKILLs its tree: a -9 there is not host OOM."""
    log = "[2026-03-01 12:00:00] Received sigquit from a child process. It usually means the child failed.\nWorker died, exit code: -9\nKilled\n"
    assert diagnose(log).cause is Cause.OTHER


# --------------------------------------------------------------------------- first specific error


def test_generic_lines_alone_carry_no_cause() -> None:
    """SIGQUIT / sigquit / Killed / EngineDeadError lines say nothing: other."""
    log = "\n".join([
        "[2026-03-01 12:00:00 TP1] Scheduler hit an exception: Traceback (most recent call last):",
        "[2026-03-01 12:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
        "[2026-03-01 12:00:01] Received sigquit from a child process. It usually means the child failed.",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "Killed",
    ])
    d = diagnose(log, exit_status=ExitStatus(signal=9))
    assert d.cause is Cause.OTHER
    assert d.evidence == ("main process killed by SIGKILL, no OOM-killer record",)
    assert diagnose(log).evidence == ()


def test_first_specific_error_wins_over_later_consequences() -> None:
    """An illegal memory access, then peers' NCCL timeouts: the CUDA error is the cause."""
    log = (
        traceback([("/sgl/srt/managers/scheduler.py", 1117, "run_batch", "self.tp_worker.forward_batch_generation(b)")],
                  "RuntimeError: CUDA error: an illegal memory access was encountered", "[2026-03-01 12:00:00 TP6] ")
        + "[rank1]:[E1001 16:06:04 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600019 milliseconds before timing out.\n"
    )
    d = diagnose(log)
    assert d.cause is Cause.CUDA_ERROR
    assert d.rank == "TP6"
    assert d.phase is Phase.SERVING


@pytest.mark.parametrize(
    ("wrapped", "cause"),
    [
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer", Cause.NCCL_ERROR),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", Cause.CUDA_ERROR),
        ("CUDA out of memory. Tried to allocate 2.00 GiB.", Cause.CUDA_OOM_STARTUP),
    ],
)
def test_capture_wrapper_is_read_for_the_error_it_holds(wrapped: str, cause: Cause) -> None:
    """'Capture cuda graph failed: X' is diagnosed by X, not by the wrapper."""
    assert diagnose(f"Exception: Capture cuda graph failed: {wrapped}\n", phase=None).cause is cause


def test_illegal_memory_access_inside_nccl_frames_is_a_cuda_error() -> None:
    """An illegal memory access surfacing in NCCL's frames is a CUDA fault, not NCCL."""
    frames = [
        ("/sgl/srt/distributed/device_communicators/pynccl.py", 120, "all_reduce", "self.nccl.ncclAllReduce("),
        ("/sgl/srt/distributed/device_communicators/pynccl_wrapper.py", 350, "NCCL_CHECK", 'raise RuntimeError(f"NCCL error: {error_str}")'),
    ]
    log = traceback(frames, "RuntimeError: NCCL error: unhandled cuda error; Cuda failure 'an illegal memory access was encountered'")
    assert diagnose(log).cause is Cause.CUDA_ERROR


def test_source_lines_in_a_traceback_are_not_evidence() -> None:
    """A frame's source line that says 'out of memory' does not make a ValueError an OOM."""
    frames = [("/x/engine.py", 10, "step", 'if "CUDA out of memory" in str(e): raise ValueError("bad request")')]
    d = diagnose(traceback(frames, "ValueError: bad request"))
    assert d.cause is Cause.OTHER
    assert d.exc_type == "ValueError"
    assert d.location == "engine.py:10 step"


def test_errors_before_the_server_became_ready_did_not_kill_it() -> None:
    """A port warning at startup followed by 'ready to roll' is not the cause of a later death."""
    log = "\n".join([
        "ERROR: [Errno 98] error while attempting to bind on address ('0.0.0.0', 9000): address already in use",
        "[2026-03-01 12:00:00] The server is fired up and ready to roll!",
        "[2026-03-01 13:00:00] Watchdog timeout (self.watchdog_timeout=300)",
    ])
    assert diagnose(log, phase=Phase.SERVING).cause is Cause.WATCHDOG_HANG


def test_an_error_the_server_kept_serving_after_is_not_the_cause() -> None:
    """Hundreds of batch lines after an error show it was not fatal."""
    log = "RuntimeError: CUDA error: an illegal memory access was encountered\n" + "Decode batch. #running-req: 3\n" * 300
    assert diagnose(log + "Killed\n", phase=Phase.SERVING).cause is Cause.OTHER


def test_startup_info_lines_that_mention_gloo_or_process_groups_are_not_errors() -> None:
    """'[Gloo] Rank 0 is connected' and ProcessGroupNCCL barrier warnings are normal startup."""
    log = "\n".join([
        "[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
        "[rank0]:[W1101 ProcessGroupNCCL.cpp:4561] [PG ID 0 PG GUID 0 Rank 0]  using GPU 0 to perform barrier as "
        "devices used by this process are currently unknown. This can potentially cause a hang.",
        TS + "Capture cuda graph begin. This can take up to several minutes. avail mem=10.00 GB",
        "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ])
    assert diagnose(log, phase=Phase.STARTING).cause is Cause.CUDA_OOM_STARTUP


# --------------------------------------------------------------------------- other causes


@pytest.mark.parametrize(
    ("line", "cause", "remedy"),
    [
        ("[2026-03-01 12:00:00 TP3] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)", Cause.WATCHDOG_HANG, Remedy.RESTART),
        ("[rank5]:[E814 ProcessGroupNCCL.cpp:607] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4476)", Cause.NCCL_ERROR, Remedy.RESTART),
        ("RuntimeError: CUDA error: no kernel image is available for execution on the device", Cause.CUDA_ERROR, Remedy.GIVE_UP),
        ("torch.AcceleratorError: CUDA error: the provided PTX was compiled with an unsupported toolchain.", Cause.CUDA_ERROR, Remedy.GIVE_UP),
        ("RuntimeError: CUDA error: device-side assert triggered", Cause.CUDA_ERROR, Remedy.RESTART),
        # the NVIDIA driver's line: a hand rule with no source line to cite, so not certain: restart
        ("kernel: NVRM: Xid (PCI:0000:97:00): 79, pid=1234, name=python3, GPU has fallen off the bus.", Cause.GPU_HW_ERROR, Remedy.RESTART),
        ("OSError: [Errno 98] Address already in use", Cause.PORT_IN_USE, Remedy.CLEAR_GPU),
        ("ValueError: Not enough host memory available. Requesting 40.00 GB but only have 30.00 GB free.", Cause.HOST_OOM, Remedy.HICACHE_DOWN),
        ("ValueError: Model architectures ['FooForCausalLM'] are not supported for now.", Cause.MODEL_LOAD_ERROR, Remedy.GIVE_UP),
        ("launch_server.py: error: unrecognized arguments: --cuda-graph-max-bs 8", Cause.CONFIG_ERROR, Remedy.GIVE_UP),
        # a ValueError naming a flag (rule flag_named, no source line): config_error, but not certain
        ("ValueError: --chunked-prefill-size must be at most --max-prefill-tokens", Cause.CONFIG_ERROR, Remedy.RESTART),
    ],
)
def test_specific_lines_name_their_cause_and_remedy(line: str, cause: Cause, remedy: Remedy) -> None:
    """Each kind of failure line maps to its cause and the remedy the policy knows."""
    d = diagnose(line + "\n")
    assert (d.cause, d.remedy) == (cause, remedy)
    assert d.evidence == (line,)
    assert d.evidence_lineno == 1


def test_application_xids_are_not_hardware_failures() -> None:
    """Xid 13/31/43 are faults of the application; only hardware Xids (79, 94...) count."""
    assert diagnose("NVRM: Xid (PCI:0000:00:05): 43, pid=1045242, name=pt_main_thread, Ch 00000008\n").cause is Cause.OTHER


def test_keyerror_while_loading_weights_is_a_model_load_error() -> None:
    """A KeyError raised from load_weights is a checkpoint that does not match the model."""
    frames = [("/sgl/srt/models/deepseek_v2.py", 3000, "load_weights", "param = params_dict[name]")]
    assert diagnose(traceback(frames, "KeyError: 'model.layers.13.mlp.experts.w2_weight_scale'")).cause is Cause.MODEL_LOAD_ERROR


def test_multiline_exception_message_is_read_whole() -> None:
    """A DistNetworkError whose message lines say EADDRINUSE is a port in use."""
    log = "torch.distributed.DistNetworkError:\nThe server socket has failed to listen.\ncode: -98,\nname: EADDRINUSE,\n"
    d = diagnose(log)
    assert d.cause is Cause.PORT_IN_USE
    assert d.exc_type == "torch.distributed.DistNetworkError"
    assert d.evidence_lineno == 1


def test_argparse_exit_code_two_is_a_config_error() -> None:
    """Exit code 2 with argparse's usage line is a configuration error."""
    d = diagnose("usage: launch_server.py [-h] --model-path MODEL_PATH\n", exit_status=ExitStatus(code=2))
    assert d.cause is Cause.CONFIG_ERROR


def test_rank_with_data_parallel_part() -> None:
    """A 'DP1 TP3' prefix is reported as that rank."""
    d = diagnose("[2026-03-01 12:00:00 DP1 TP3] RuntimeError: CUDA error: an illegal memory access was encountered\n")
    assert d.rank == "DP1 TP3"


def test_only_the_tail_is_read_and_line_numbers_are_within_it() -> None:
    """A huge log is cut to its tail; the evidence line number counts from the tail's start."""
    noise = b"x" * 99 + b"\n"
    data = noise * (MAX_TAIL_BYTES // len(noise) + 1000) + b"RuntimeError: CUDA error: an illegal memory access was encountered\n"
    text = tail_text(data)
    assert len(text) <= MAX_TAIL_BYTES
    d = diagnose(data)
    assert d.cause is Cause.CUDA_ERROR
    assert d.evidence_lineno == text.count("\n")


def test_diagnosis_failure_is_reported_not_raised() -> None:
    """Whatever goes wrong inside, diagnose answers 'other' and says so in exc_type."""
    d = diagnose(12345)  # type: ignore[arg-type]
    assert d.cause is Cause.OTHER
    assert d.exc_type == INTERNAL_ERROR_TYPE


# --------------------------------------------------------------------------- the real simulator


@pytest.mark.integration
@pytest.mark.parametrize(
    ("version", "mode", "phase", "cause", "location"),
    [
        ("0.5.6", "runtime_oom", Phase.SERVING, Cause.CUDA_OOM_RUNTIME, "deepseek_v2.py:2919 forward"),
        ("0.5.23", "startup_oom", Phase.STARTING, Cause.CUDA_OOM_STARTUP, "cuda_graph_runner.py:379 __init__"),
        ("0.5.6", "kv_pool", Phase.STARTING, Cause.KV_POOL_TOO_SMALL, "model_runner.py:1402 init_memory_pool"),
        ("0.5.23", "model_load", Phase.STARTING, Cause.MODEL_LOAD_ERROR, None),
        ("0.5.23", "host_oom", Phase.SERVING, Cause.HOST_OOM, None),
    ],
)
def test_simulator_deaths_are_read_right(
    version: str, mode: str, phase: Phase, cause: Cause, location: str | None, tmp_path: Path, no_leftovers: None
) -> None:
    """The simulator's output for each failure mode, as the daemon captures it, reads right."""
    argv = [
        sys.executable, "-m", "supervisor.sim.simulator", "--model-path", str(tmp_path / "model"),
        "--port", str(free_port()), "--tp-size", "2", "--sim-version", version, "--sim-fail", mode,
        "--sim-load-s", "0.2", "--sim-fail-after-s", "0.3",
    ]
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    argv += ["--sim-memory-events", str(events)]
    before = read_oom_kill_count(events.read_text())
    env = {**os.environ, "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"simulator --sim-fail {mode} did not die within 90 s")
    after = read_oom_kill_count(events.read_text())
    delta = after - before if after is not None and before is not None else None
    d = diagnose(out, exit_status=ExitStatus.from_returncode(proc.returncode), phase=phase, oom_kill_delta=delta)
    assert d.cause is cause, out.decode(errors="replace")[-3000:]
    if mode == "host_oom":  # the same death without the cgroup's record is a bare SIGKILL
        bare = diagnose(out, exit_status=ExitStatus.from_returncode(proc.returncode), phase=phase)
        assert (bare.cause, bare.runner_up) == (Cause.OTHER, Cause.HOST_OOM)
    if location:
        assert d.location == location
    if mode != "host_oom":  # a SIGKILLed scheduler is named "scheduler_0": no rank to read
        assert d.rank and d.rank.startswith("TP")


# --------------------------------------------------------------------------- the action sentence


@pytest.mark.parametrize(
    ("d", "words"),
    [
        (Diagnosis(Cause.CUDA_OOM_RUNTIME, Phase.SERVING), ("Lower --mem-fraction-static from 0.93", "serving")),
        (Diagnosis(Cause.KV_POOL_TOO_SMALL, Phase.STARTING), ("Raise --mem-fraction-static from 0.93", "worse")),
        (Diagnosis(Cause.KV_POOL_TOO_SMALL, Phase.SERVING, remedy_override=Remedy.RESTART), ("Restart", "--max-running-requests")),
        (Diagnosis(Cause.HOST_OOM, Phase.STARTING), ("--hicache-size", "host memory")),
        (Diagnosis(Cause.CUDA_OOM_STARTUP, Phase.STARTING, remedy_override=Remedy.CLEAR_GPU), ("holds the GPU", "would not help")),
        (Diagnosis(Cause.PORT_IN_USE, Phase.STARTING), ("port",)),
        (Diagnosis(Cause.CUDA_ERROR, Phase.STARTING, remedy_override=Remedy.GIVE_UP), ("Give up", "a CUDA error")),
        (Diagnosis(Cause.NCCL_ERROR, Phase.SERVING), ("Restart with backoff", "NCCL")),
    ],
)
def test_describe_action_says_what_and_why_in_one_sentence(d: Diagnosis, words: tuple[str, ...]) -> None:
    """The action sentence names the move and the reason."""
    sentence = describe_action(d, fraction=0.93)
    assert all(w in sentence for w in words), sentence
    assert sentence.endswith(".") and sentence.count(". ") == 0


# --------------------------------------------------------------------------- the corpus


def test_corpus_copy_is_complete() -> None:
    """Every labelled log is in the test data, with a cause the classifier may return."""
    entries = diagnosis_corpus.entries()
    public = [e for e in entries if not e.name.startswith("real/")]
    assert len(public) >= 128
    assert all(e.path.is_file() for e in entries), [e.name for e in entries if not e.path.is_file()]
    assert {e.label for e in entries} <= {str(c) for c in LOG_CAUSES}


def _corpus_run(hand_rules: bool | frozenset[str] = True) -> list[tuple[diagnosis_corpus.Entry, Diagnosis]]:
    return [(e, e.diagnose(hand_rules=hand_rules)) for e in diagnosis_corpus.entries()]


def test_corpus_accuracy_and_no_memory_confusions(capsys: pytest.CaptureFixture[str]) -> None:
    """≥ 97 % of the real logs get their labelled cause; the four memory causes never mix;
    a memory cause is named only with memory evidence; every answer marked certain is right;
    no give-up where the label's remedy is not one. Prints the confusion matrix."""
    results = []
    wrong = []
    unfounded = []
    certain_wrong = []
    runs = _corpus_run()
    for e, d in runs:
        got = str(d.cause)
        results.append((e, got))
        if got != e.label:
            wrong.append(f"{e.name}: labelled {e.label}, diagnosed {got} ({'certain' if d.certain else 'uncertain'})")
            if d.certain:
                certain_wrong.append(f"{e.name}: {e.label} read as {got} for certain ({d.basis})")
        memory_words = ("memory", "oom", "killed process", "sigbus", "bus error", "bad_alloc", "pin", "profiled value",
                        "kv cach", "shm")
        if got in MEMORY_CAUSES and not any(w in line.lower() for line in d.evidence for w in memory_words):
            unfounded.append(f"{e.name}: {got} from {d.evidence[:1]}")
    counts = diagnosis_corpus.confusion(results)
    correct = sum(n for (label, got), n in counts.items() if label == got)
    memory_mixups = [
        f"{label} -> {got}" for (label, got) in counts
        if label != got and label in MEMORY_CAUSES and got in MEMORY_CAUSES
    ]
    certain = [d for _, d in runs if d.certain]
    gave_up = [f"{e.name}: {e.label} -> {d.cause} ({d.basis})" for e, d in runs if diagnosis_corpus.wrong_give_up(e, d)]
    with capsys.disabled():
        print("\n" + diagnosis_corpus.matrix_text(counts))
        print(f"{correct}/{len(runs)} correct ({100 * correct / len(runs):.1f} %); memory-cause confusions: "
              f"{len(memory_mixups)}; memory causes without memory evidence: {len(unfounded)}; certain answers: "
              f"{len(certain) - len(certain_wrong)}/{len(certain)} right; wrong give-ups: {len(gave_up)}; "
              f"wrong: {wrong or 'none'}")
    assert not gave_up, gave_up
    assert not memory_mixups
    assert not unfounded, unfounded
    assert not certain_wrong, certain_wrong
    assert correct / len(runs) >= 0.97, wrong


# With the rules written from logs switched off (the catalogue and the frames alone): how it
# reads words it was never shown. docs/diagnosis.md lists each rule left, and why the
# catalogue cannot hold its words.
CATALOGUE_ONLY_FLOOR = 0.92


def test_corpus_accuracy_with_the_catalogue_and_the_frames_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """The honest estimate for logs nobody here has read: the catalogue (the stack's own
    messages) and the frames (the code that raised new words), no hand-written rule."""
    runs = _corpus_run(hand_rules=False)
    correct = sum(str(d.cause) == e.label for e, d in runs)
    certain = [(e, d) for e, d in runs if d.certain]
    certain_right = sum(str(d.cause) == e.label for e, d in certain)
    wrong = [f"{e.name}: {e.label} -> {d.cause}" for e, d in runs if str(d.cause) != e.label]
    gave_up = [e.name for e, d in runs if diagnosis_corpus.wrong_give_up(e, d)]
    with capsys.disabled():
        print(f"\ncatalogue and frames only: {correct}/{len(runs)} correct ({100 * correct / len(runs):.1f} %, "
              f"goal {100 * CATALOGUE_ONLY_FLOOR:.0f} %); certain answers {certain_right}/{len(certain)} right; "
              f"wrong give-ups: {len(gave_up)}; wrong: {wrong}")
    assert correct / len(runs) >= CATALOGUE_ONLY_FLOOR, wrong
    assert certain_right == len(certain)
    assert not gave_up, gave_up


def test_each_release_judged_without_the_hand_rules_written_after_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The figure batch by batch: each corpus release read with only the hand rules written
    before it was released (``rule_batches.tsv``, from the rules' git history: a rule dated
    batch b was written with releases 1..b in view, so it may judge release b + 1 on), beside
    the catalogue-and-frames figure and the full one. Every hand rule must be dated."""
    from supervisor.core.diagnosis import RULES

    batch_of, rule_batch = diagnosis_corpus.batches(), diagnosis_corpus.rule_batches()
    assert set(rule_batch) == {r.name for r in RULES}, "run scripts/rule-history"
    entries = diagnosis_corpus.entries()
    assert {e.name for e in entries} == set(batch_of), "run scripts/rule-history"
    rows, total, right = [], 0, 0
    for k in sorted(set(batch_of.values())):
        allowed = frozenset(name for name, b in rule_batch.items() if b < k)
        logs = [e for e in entries if batch_of[e.name] == k]
        before = sum(str(e.diagnose(hand_rules=allowed).cause) == e.label for e in logs)
        bare = sum(str(e.diagnose(hand_rules=False).cause) == e.label for e in logs)
        full = sum(str(e.diagnose().cause) == e.label for e in logs)
        total, right = total + len(logs), right + before
        rows.append(f"  release {k}: {len(logs):3} logs, {len(allowed):2} rules written before it: "
                    f"{100 * before / len(logs):5.1f} %   catalogue and frames only {100 * bare / len(logs):5.1f} %   "
                    f"all rules {100 * full / len(logs):5.1f} %")
    with capsys.disabled():
        print("\neach release judged without the hand rules written after it:\n" + "\n".join(rows)
              + f"\n  all releases: {right}/{total} ({100 * right / total:.1f} %)")
    assert right / total >= CATALOGUE_ONLY_FLOOR


def test_the_catalogue_it_reads_with(capsys: pytest.CaptureFixture[str]) -> None:
    """The catalogue's size per source and version (scripts/catalogue, `make catalogue`)."""
    from collections import Counter

    from supervisor.core.diagnosis.catalogue import catalogue

    cat = catalogue()
    per = Counter(v for e in cat.entries for v in e.seen_in)
    with capsys.disabled():
        print(f"\ncatalogue: {len(cat)} messages from " + ", ".join(f"{v} {per[v]}" for v in cat.versions))
    assert len(cat) > 10_000 and all(per[v] > 0 for v in cat.versions)
    assert any(v.startswith("sglang==0.5.23") for v in cat.versions)


@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_perturbed_corpus_logs_keep_their_cause(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every corpus log gives the same cause with the perturbation applied (timestamps, rank
    prefixes, quoting, CRLF, docker columns): logs reach the daemon through journald, docker,
    kubectl and chat quotes, and the reading must not depend on how lines are framed."""
    perturb = PERTURBATIONS[name]
    changed = []
    entries = diagnosis_corpus.entries()
    for e in entries:
        text = e.path.read_text(errors="replace")
        before = e.diagnose(text).cause
        after = e.diagnose(perturb(text)).cause
        if after is not before:
            changed.append(f"{e.name}: {before} -> {after}")
    with capsys.disabled():
        print(f"\nperturbation {name!r}: {len(entries) - len(changed)}/{len(entries)} same cause; "
              f"changed: {changed or 'none'}")
    assert not changed


def test_what_was_logged_before_the_daemon_saw_it_ready_did_not_kill_it_while_serving() -> None:
    """A group node >= 1 logs no ready line: the daemon says where in the output the server
    became READY (``ready_at``), and a start-up line before it (SGLang 0.5.23's bf16
    warning, whose words name a missing driver) is not the cause of a death while serving."""
    warning = ("[2026-11-30 10:00:01 TP0] multimem all-gather disabled (Found no NVIDIA driver on your system. "
               "Please check that you have an NVIDIA GPU and installed a driver)\n")
    before = "[2026-11-30 10:00:00 TP0] Load weight end. avail mem=1.00 GB\n" + warning
    after = "[2026-11-30 10:00:05 TP0] Decode batch. #running-req: 1, #token: 30\n"
    tail = (before + after).encode()
    d = diagnose(tail, phase=Phase.SERVING, ready_at=len(before.encode()),
                 exit_status=ExitStatus(signal=9))
    assert d.cause is Cause.OTHER


# --------------------------------------------------------------------------- the catalogue and the frames (issue 23)

SITE = "/usr/local/lib/python3.10/dist-packages"


def test_a_message_of_the_stack_is_read_by_its_family_and_is_certain() -> None:
    """SGLang 0.5.23's own KV-pool message, with numbers no rule was written for: the
    catalogue knows it (kv_pool.startup), the message says its phase, so the reading is
    certain and says where the words come from."""
    d = diagnose(TS + "ValueError: Loaded weights leave no GPU memory for the KV cache under "
                 "--mem-fraction-static=0.91. Raise --mem-fraction-static above 0.913 (minimum viable = 0.9 - "
                 "available/pre = 0.01).\n", phase=None)
    assert d.cause is Cause.KV_POOL_TOO_SMALL and d.certain and d.remedy is Remedy.FRACTION_UP
    assert d.basis.startswith("catalogue: kv_pool.startup: sglang 0.5.23 ") and d.min_fraction == 0.913


def test_a_wrapper_is_read_for_the_cuda_error_it_holds() -> None:
    """torch's "CUDA error: <*>" holds the CUDA runtime's own description: its table names
    the family (the environment, the hardware, a kernel fault), whatever words wrap it."""
    cases = {
        "RuntimeError: CUDA error: invalid device ordinal": Cause.CONFIG_ERROR,
        "RuntimeError: CUDA error: uncorrectable ECC error encountered": Cause.GPU_HW_ERROR,
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered": Cause.CUDA_ERROR,
        "Some new wrapper: CUresult error: 2 (out of memory) file=csrc/utils.h line=194": Cause.CUDA_OOM_RUNTIME,
    }
    for line, cause in cases.items():
        d = diagnose(TS + line + "\n", phase=Phase.SERVING, hand_rules=False)
        assert d.cause is cause, (line, d)


def test_a_warning_is_never_the_cause_whatever_words_it_holds() -> None:
    """SGLang logs "Ignore import error when loading ..." as a warning; the error it quotes
    did not kill anything. The death after it is read instead."""
    log = (TS + "Ignore import error when loading sglang.srt.models.grok: '_OpNamespace' 'sgl_kernel' object has "
           "no attribute 'fused_add_rmsnorm'\n" + TS + "RuntimeError: Not enough memory. Please try to increase "
           "--mem-fraction-static.\n")
    d = diagnose(log, phase=None)
    assert d.cause is Cause.KV_POOL_TOO_SMALL and d.evidence_lineno == 2
    alone = diagnose(log.splitlines()[0] + "\n", phase=Phase.SERVING)
    assert alone.cause is Cause.OTHER and not alone.certain


def test_new_words_are_read_by_the_code_that_raised_them_and_never_certain() -> None:
    """An exception no rule and no catalogue entry knows: its innermost frame's module
    (the module table, generated from the packages' trees) names the subsystem."""
    words = "FooError: the frobnicator declined"
    config = traceback([(f"{SITE}/sglang/srt/server_args.py", 812, "check_server_args", "raise ValueError(x)")],
                       "ValueError: frobnicator 7 cannot go with quux")
    loader = traceback([(f"{SITE}/sglang/srt/model_loader/loader.py", 371, "load_model", "x = y()"),
                        (f"{SITE}/safetensors/torch.py", 12, "load_file", "z()")], "RuntimeError: " + words)
    kernel = traceback([(f"{SITE}/sgl_kernel/elementwise.py", 40, "rmsnorm", "torch.ops.sgl_kernel.rmsnorm(x)"),
                        (f"{SITE}/torch/_ops.py", 1158, "__call__", "return self._op(*args)")], "RuntimeError: " + words)
    for log, cause, where in ((config, Cause.CONFIG_ERROR, "server_args.py:812"),
                              (loader, Cause.MODEL_LOAD_ERROR, "torch.py:12"),
                              (kernel, Cause.CUDA_ERROR, "elementwise.py:40")):
        d = diagnose(log, phase=None, hand_rules=False)
        assert d.cause is cause and not d.certain, (cause, d)
        assert d.basis.startswith(f"frames: {where}") and d.unrecognised, d


def test_a_main_process_killed_after_it_was_ready_with_nothing_logged_is_killed() -> None:
    """The death of this rank by a signal, said so: which signal, and that nothing was
    logged. SGLang's own teardown (a sigquit line first) is not a kill from outside."""
    ready = TS + "The server is fired up and ready to roll!\n"
    serving = TS + "Decode batch. #running-req: 1, #token: 30, token usage: 0.00\n"
    d = diagnose(ready + serving, phase=Phase.SERVING, exit_status=ExitStatus(signal=9))
    assert d.killed == "SIGKILL" and d.basis == "signal" and d.cause is Cause.OTHER
    assert "no error was logged" in d.evidence[0]
    teardown = ready + "[2026-03-01 12:00:01] Received sigquit from a child process. It usually means the child failed.\n"
    assert diagnose(teardown, phase=Phase.SERVING, exit_status=ExitStatus(signal=9)).killed is None


def test_a_newest_first_log_is_read_in_the_order_it_was_written() -> None:
    """A cloud log viewer that lists the newest line first: the traceback's header follows
    its frames. Read back in order, the KeyError is raised in load_weights (the checkpoint
    does not fit the model)."""
    lines = [
        "[2025-04-04 06:24:51] Received sigquit from a child process. It usually means the child failed.",
        "KeyError: 'model.layers.78.mlp.gate_up_proj.input_scale'",
        "param = params_dict[name]",
        f'File "{SITE}/sglang/srt/models/llama.py", line 503, in load_weights',
        "model.load_weights(self._get_all_weights(model_config, model))",
        f'File "{SITE}/sglang/srt/model_loader/loader.py", line 371, in load_model',
        "[2025-04-04 06:24:51 TP7] Scheduler hit an exception: Traceback (most recent call last):",
    ]
    d = diagnose("\n".join(lines) + "\n", phase=None)
    assert d.cause is Cause.MODEL_LOAD_ERROR, d
