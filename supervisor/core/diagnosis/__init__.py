"""Crash diagnosis: read a dead SGLang server's log the way an experienced engineer does.

Pure: no I/O, no clock, no asyncio. ``diagnose`` takes the tail of the server's output (and,
when the daemon has them, the exit status, the phase it saw and kernel OOM-killer lines)
and returns a ``model.Diagnosis``: the cause, the evidence line(s) and their line number,
the exception, the innermost frame, the rank and the phase.

How it reads a log (``../shared/sglang-facts.md`` says why each rule holds):

- The cause is the **first failure** of the crash, on any rank, not the last line. Each rule
  says how much its line tells (``strength``): it *names* a cause, it is a *hint* (exit code
  -9, ENOMEM, a list of possible causes: read as ``other`` with ``host_oom`` runner-up), or
  an *echo* of another rank's failure (gloo/NCCL ``Connection closed/reset by peer``, a
  collective watchdog timeout). The first naming line wins, else the first hint, else the
  first echo. Generic lines (``Scheduler hit an exception``, ``SIGQUIT received``,
  ``Received sigquit``, ``Killed``, ``EngineDeadError``...) carry no cause.
- A line is a candidate when it holds one of a rule's needles (cheap substring search over
  the lowered tail); the rule's linear regex and context check then confirm it. Within
  one line, rules are tried in a fixed precedence: hardware, host memory, hints, KV pool,
  CUDA OOM, specific CUDA faults, port, NCCL, echoes, other CUDA errors, watchdog, model,
  config. So a wrapper's message (``Capture cuda graph failed: <real error>``,
  ``MQEngineDeadError ... OutOfMemoryError(...)``) is read for the real error it holds.
- Source lines shown in tracebacks are not evidence (``raise RuntimeError(f"NCCL error...``
  is code, not an error); frame lines are not either.
- Startup vs serving (``_phase_at``): a daemon that saw the server serve is believed
  outright; else the failure report's frames (start-up frames win: they are the outer
  ones); else the last progress line before the error; else progress lines anywhere
  (start-up markers and no ready line mean start-up); else the daemon's STARTING; else
  unknown. ``Diagnosis.phase_source`` says which.
- ``Diagnosis.certain``: the evidence names the cause and, where the remedy depends on the
  phase, the phase is known. An uncertain memory reading gets the least harmful remedy
  (restart, or one rung down for a CUDA OOM of unknown phase) and a ``runner_up``.
- Errors before the last ``ready to roll`` line, or followed by many batch lines, did not
  kill the server and are not the cause (except a failed HTTP bind just before a ready
  line that another server answered).
- An OOM-killer record (a kernel line for one of the server's pids, or a positive
  ``oom_kill_delta`` from the cgroup's ``memory.events``) makes ``other``, NCCL and watchdog
  readings host OOM.
- Mangled logs (``> `` quoting, prefixes, CRLF, a blank line after every line, lines joined)
  are unmangled first; line numbers stay those of the text given.
- Every rule records where its text comes from (``origin``, ``cites``, ``source_text``);
  ``tests/test_diagnosis_provenance.py`` and ``tests/real/test_source_contract.py`` hold
  them to it. ``docs/diagnosis.md`` lists the families and their rules.

Only the last ``MAX_TAIL_BYTES`` of the input are read; no regex can backtrack beyond a
fixed bound; ``diagnose`` never raises.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from supervisor.core.diagnosis import catalogue as _catalogue
from supervisor.core.diagnosis.startup_facts import line_rank
from supervisor.core.model import Cause, Diagnosis, ExitStatus, Phase, Remedy, SiteRule

MAX_TAIL_BYTES = 4 * 1024 * 1024  # how much of the end of the output is read
MAX_LINE_CHARS = 4096  # longer lines are read up to this many characters
MAX_LINES = 200_000  # lines read, the last ones of the tail
MAX_CANDIDATES = 2000  # candidate lines examined, the last ones of the tail
MAX_EVIDENCE_CHARS = 500  # each evidence line is cut to this length
KEPT_SERVING_BATCHES = 200  # batch lines after an error that prove the server outlived it
INTERNAL_ERROR_TYPE = "supervisor.core.diagnosis.InternalError"  # exc_type when diagnosis itself failed

_BACK_WINDOW = 150  # lines scanned up from the evidence for its traceback
_AFTER_WINDOW = 40  # lines scanned down from it for the rest of the failure report
_OTHER_SCAN_LINES = 5000  # lines scanned for an exception line when no rule matched


# --------------------------------------------------------------------------- line shapes

_PREFIX = re.compile(
    r"[\s|`'\">]+"  # indentation, CI-view "  | ", quotes, markdown backticks
    r"|(?:#033|\x1b)\[[0-9;]{0,20}m"  # ANSI colour, raw or syslog-escaped
    r"|\[[^\]\n]{0,100}\]:?"  # "[2025-08-02 19:24:30 TP3]", "[rank0]:"
    r"|\([\w.-]{1,60}(?:,? \w{1,20}=[\w.:-]{1,60}){0,4}\)"  # "(WorkerDict pid=1)", "(VllmWorker rank=7 pid=2)"
    r"|[\w.-]{1,40} {1,8}\|"  # docker compose "sglang-1  |"
    r"|\d{4}-\d\d-\d\d[T ][\d:.,]{5,20}Z?"  # "2025-04-06T07:44:23.51Z", "2024-12-19 21:40:35"
    r"|(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?: \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,6})?)?"
    r"(?: \d{1,10})? \[?[\w.-]{1,60}:\d{1,6}\]"  # vLLM "ERROR 03-23 21:43:38 [worker.py:620]"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):"  # uvicorn "ERROR:    "
    r"|(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?= \d{4}-\d\d-\d\d)"  # a log viewer's "ERROR 2025-04-05T00:01:19Z"
    r"|kernel:"
)
_EXC = re.compile(r"([A-Za-z_]\w{0,100}(?:\.[A-Za-z_]\w{0,100}){0,8})(?::(?: (.*))?$|\((.*)$|$)")
_EXC_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Failure", "Fault")
_FRAME = re.compile(r'File "([^"\n]{1,500})", line (\d{1,7}), in ([\w<>.-]{1,200})')
_TRACEBACK = "traceback (most recent call last)"
_DIGITS = re.compile(r"\d+")
_CARETS = re.compile(r"[\^~\s]+")  # the markers under a source line (Python >= 3.11)
# An exception message that continues on the next lines (NCCL names the CUDA failure there).
_DETAILS_FOLLOW = ("unhandled cuda error", "unhandled system error", "nccl_debug=info for details", "last error:")


def _strip_prefix(line: str) -> str:
    """The line without log prefixes (timestamps, ranks, pids, levels, docker columns)."""
    pos = 0
    for _ in range(16):
        m = _PREFIX.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
    return line[pos:]


def _prefix_shape(line: str) -> str:
    """The line's log prefix with digits blurred: equal for lines of one log record."""
    prefix = line[: len(line) - len(_strip_prefix(line))].strip()
    return _DIGITS.sub("0", prefix)


def _parse_exception(line: str) -> tuple[str, str] | None:
    """``(type, message)`` when the line is a Python exception line, else None."""
    body = _strip_prefix(line).rstrip()
    m = _EXC.match(body)
    if m is None:
        return None
    name = m.group(1)
    last = name.rsplit(".", 1)[-1]
    if not last.endswith(_EXC_SUFFIXES):
        return None
    if m.end(1) == len(body) and last in _EXC_SUFFIXES:
        return None  # a bare "Error" is a word, not an exception's name
    # vLLM's repr form: OutOfMemoryError('CUDA out of memory...')
    repr_form = m.group(3)
    message = repr_form.rstrip(")").strip("'\"") if repr_form is not None else (m.group(2) or "").strip()
    return name, message


# --------------------------------------------------------------------------- the rules


@dataclass(frozen=True, slots=True)
class _Rule:
    """One way a cause shows in a log line."""

    name: str
    cause: Cause
    needles: tuple[str, ...]  # lowercase substrings, any of which makes a line a candidate
    pattern: re.Pattern[str] | None = None  # must also be found in the line
    remedy: Remedy | None = None  # remedy_override the rule implies
    # Must also hold around the line: returns the index of a supporting line (added to the
    # evidence; the line itself when nothing else) or None.
    context: Callable[[_Log, int], int | None] | None = None
    phased: bool = False  # a CUDA OOM: runtime or startup depending on the phase
    usual_phase: Phase | None = None  # the phase when neither the log nor the daemon says
    # The text itself is printed in one phase only (KV-pool sizing at start-up, the batch
    # loop's pool exhaustion while serving): ``usual_phase`` is then known, not guessed.
    phase_in_text: bool = False
    # How much the line tells: "names" (it names the cause), "echo" (a consequence of
    # another failure: a peer's closed connection, a collective timeout) or "hint" (it
    # points at a cause without evidence: a SIGKILL, an ENOMEM). A naming line anywhere in
    # the crash beats a hint, and a hint beats an echo.
    strength: str = "names"
    runner_up: Cause | None = None  # the other reading a hint or an echo leaves open
    # Provenance: where the needles' text comes from ("sglang", "sglang-legacy", "torch",
    # "nccl", "gloo", "cuda", "kernel", "vllm", "ray", "python", "hf", "nvidia-driver"...),
    # per-needle exceptions, and citations of the source line that prints a needle's text.
    origin: str = "sglang"
    origins: tuple[tuple[str, str], ...] = ()  # (needle, origin) where it differs
    cites: tuple[tuple[str, str], ...] = ()  # (needle, "file:line" or a literal of the source)
    # For an "sglang" needle that SGLang's source builds from pieces (an f-string), the
    # literal pieces to find there instead of the needle itself.
    source_text: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def origin_of(self, needle: str) -> str:
        return next((o for n, o in self.origins if n == needle), self.origin)

    def cite_of(self, needle: str) -> str | None:
        return next((c for n, c in self.cites if n == needle), None)

    def matches(self, log: _Log, index: int, text: str, found: set[str]) -> int | None:
        """Whether the line (with ``found`` needles in it) shows this rule; see ``context``."""
        if found.isdisjoint(self.needles):
            return None
        if self.pattern is not None and self.pattern.search(text) is None:
            return None
        return index if self.context is None else self.context(log, index)


def _ci(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


# Xid codes that mean the hardware or its links failed (ECC, fell off the bus, NVLink/fabric,
# GSP). 13, 31, 43, 45 are faults of the application and are not counted.
_HW_XIDS = frozenset(
    {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140, 144, 145, 146, 147, 148, 149, 150, 154}
)
_XID = re.compile(r"\bXid\b(?: \([^)\n]{0,40}\))?(?: error)?:? ?(\d{1,3})\b|previous Xid (\d{1,3})\b", re.I)


def _hw_xid(log: _Log, index: int) -> int | None:
    for m in _XID.finditer(log.text(index)):
        code = m.group(1) or m.group(2)
        if code and int(code) in _HW_XIDS:
            return index
    return None


_PINNED_HINTS = ("pin_memory", "pinned", "hostalloc", "host_alloc", "cudahostregister")
_INNERMOST_LINES = 8  # the innermost frames (with their source and caret lines)


def _pinned_host_context(log: _Log, index: int) -> int | None:
    """The CUDA error comes from allocating pinned host memory (a host-memory failure)."""
    for i in [index, *log.traceback_lines(index)[:_INNERMOST_LINES]]:
        low = log.low(i)
        if any(h in low for h in _PINNED_HINTS) or ("memory_pool_host" in low and "init" in low):
            return i
    return None


_LOADER_HINTS = ("load_weights", "weight_loader", "load_model", "model_loader", "load_state_dict")


def _loader_context(log: _Log, index: int) -> int | None:
    """The exception was raised while loading the checkpoint."""
    for i in log.traceback_lines(index):
        if any(h in log.low(i) for h in _LOADER_HINTS):
            return index
    return None


def _raised(log: _Log, index: int) -> int | None:
    """The line is a Python exception line."""
    return index if log.exception(index) is not None else None


def _raised_by(types: tuple[str, ...]) -> Callable[[_Log, int], int | None]:
    """The line is an exception line of one of ``types`` (by their last dotted part)."""

    def check(log: _Log, index: int) -> int | None:
        exc = log.exception(index)
        return index if exc is not None and exc[0].rsplit(".", 1)[-1] in types else None

    return check


def _before_sigquit(log: _Log, index: int) -> int | None:
    """Not after SGLang's own sigquit: past that point it SIGKILLs its own tree."""
    first = log.first_sigquit
    return index if first is None or index < first else None


def _raised_or_validation(log: _Log, index: int) -> int | None:
    """An exception line, or a validation library's message line ("Value error, ...")."""
    if log.exception(index) is not None:
        return index
    body = _strip_prefix(log.text(index)).lower()
    return index if body.startswith(("value error,", "assertion error,")) else None


def _at_startup(log: _Log, index: int) -> int | None:
    """An exception raised while the server was starting (init frames, no serving frames)."""
    if log.exception(index) is None:
        return None
    report = "".join(log.low(i) + "\n" for i in log.traceback_lines(index))
    if any(k in report for k in _SERVING_FRAMES):
        return None
    if any(k in report for k in (*_STARTUP_FRAMES, *_WEIGHTS_FRAMES, *_CAPTURE_FRAMES, "__init__")):
        return index
    return None


_CUDA_ERROR_PATTERN = _ci(
    r"\bcuda (?:driver |runtime )?error(?!s)|cudaError|CUDA_ERROR_|CUBLAS_STATUS_|CUDNN_STATUS_"
    r"|AcceleratorError|Cuda failure|Triton Error \[CUDA\]"
)

RULES: tuple[_Rule, ...] = (
    # -- the GPU itself: a restart cannot fix it, whatever frames surround it
    _Rule("xid", Cause.GPU_HW_ERROR, ("xid",), context=_hw_xid, origin="nvidia-driver",
          cites=(("xid", "NVIDIA driver NVRM kernel message: 'NVRM: Xid (PCI:...): 79, ...'"),)),
    _Rule(
        "gpu_lost",
        Cause.GPU_HW_ERROR,
        (
            "fallen off the bus", "gpu is lost", "gpu_is_lost", "uncorrectable ecc", "ecc error",
            "system not yet initialized", "cudaerrorsystemnotready", "busy or unavailable",
            "cudaerrordevicesunavailable", "no cuda-capable device", "no cuda gpus are available",
            "rminitadapter failed", "unable to determine the device handle", "found no nvidia driver",
            "over nvlink or a hardware error", "nvlink uncorrectable", "cudaerrornvlinkuncorrectable",
            "uncorrectable nvlink", "hardware stack error", "cudaerrorhardwarestackerror",
        ),
        origin="cuda",
        origins=(
            ("fallen off the bus", "nvidia-driver"), ("gpu is lost", "nvidia-driver"),
            ("rminitadapter failed", "nvidia-driver"), ("unable to determine the device handle", "nvidia-driver"),
            ("found no nvidia driver", "torch"), ("no cuda gpus are available", "torch"), ("gpu_is_lost", "nvml"),
        ),
        cites=(
            ("over nvlink or a hardware error", "cuda_runtime_api.h cudaErrorNvlinkUncorrectable: "
             "'Invalid access of peer GPU memory over nvlink or a hardware error'"),
            ("nvlink uncorrectable", "cuda.h CUDA_ERROR_NVLINK_UNCORRECTABLE: 'uncorrectable NVLink error'"),
            ("uncorrectable nvlink", "cuda.h CUDA_ERROR_NVLINK_UNCORRECTABLE: 'uncorrectable NVLink error'"),
            ("cudaerrornvlinkuncorrectable", "cuda_runtime_api.h: cudaErrorNvlinkUncorrectable = 220"),
            ("hardware stack error", "cuda_runtime_api.h cudaErrorHardwareStackError: 'hardware stack error'"),
            ("cudaerrorhardwarestackerror", "cuda_runtime_api.h: cudaErrorHardwareStackError = 714"),
            ("uncorrectable ecc", "cuda_runtime_api.h cudaErrorECCUncorrectable: 'uncorrectable ECC error encountered'"),
            ("ecc error", "cuda_runtime_api.h cudaErrorECCUncorrectable: 'uncorrectable ECC error encountered'"),
            ("fallen off the bus", "NVRM Xid 79: 'GPU has fallen off the bus'"),
            ("gpu is lost", "nvidia-smi: 'Unable to determine the device handle for GPU...: GPU is lost'"),
            ("gpu_is_lost", "nvml.h NVML_ERROR_GPU_IS_LOST"),
            ("system not yet initialized", "cuda_runtime_api.h cudaErrorSystemNotReady: 'system not yet initialized'"),
            ("cudaerrorsystemnotready", "cuda_runtime_api.h: cudaErrorSystemNotReady = 802"),
            ("busy or unavailable", "cuda_runtime_api.h cudaErrorDevicesUnavailable: 'CUDA-capable device(s) is/are busy or unavailable'"),
            ("cudaerrordevicesunavailable", "cuda_runtime_api.h: cudaErrorDevicesUnavailable = 46"),
            ("no cuda-capable device", "cuda_runtime_api.h cudaErrorNoDevice: 'no CUDA-capable device is detected'"),
            ("no cuda gpus are available", "torch/cuda/__init__.py _lazy_init: 'No CUDA GPUs are available'"),
            ("rminitadapter failed", "NVRM kernel message: 'RmInitAdapter failed!'"),
            ("unable to determine the device handle", "nvidia-smi: 'Unable to determine the device handle for GPU'"),
            ("found no nvidia driver", "torch/cuda/__init__.py: 'Found no NVIDIA driver on your system'"),
        ),
    ),
    # -- host memory (checked before CUDA OOM: Ray's OutOfMemoryError is about host RAM)
    _Rule(
        "pinned_host",
        Cause.HOST_OOM,
        ("invalid argument", "out of memory"),
        pattern=_CUDA_ERROR_PATTERN,
        context=_pinned_host_context,
        origin="cuda",
        cites=(("invalid argument", "cuda_runtime_api.h cudaErrorInvalidValue: 'invalid argument'"),
               ("out of memory", "cuda_runtime_api.h cudaErrorMemoryAllocation: 'out of memory'")),
    ),
    _Rule(
        "host_memory",
        Cause.HOST_OOM,
        (
            "not enough host memory", "running low on memory", "killed due to memory pressure",
            "exceeds the memory usage threshold", "can't allocate memory", "std::bad_alloc",
            "insufficient shared memory", "bus error", "sigbus", "oom-kill", "invoked oom-killer",
        ),
        origin="ray",
        origins=(
            ("not enough host memory", "sglang"), ("can't allocate memory", "torch"), ("std::bad_alloc", "c++"),
            ("insufficient shared memory", "torch"), ("bus error", "kernel"), ("sigbus", "kernel"),
            ("oom-kill", "kernel"), ("invoked oom-killer", "kernel"), ("killed due to memory pressure", "kernel"),
        ),
        cites=(
            ("running low on memory", "ray/_private/memory_monitor: 'Task was killed due to the node running low on memory'"),
            ("exceeds the memory usage threshold", "ray memory monitor: '... which exceeds the memory usage threshold of 0.95. Ray killed this worker'"),
            ("can't allocate memory", "c10/core/impl/alloc_cpu.cpp: 'DefaultCPUAllocator: can't allocate memory: you tried to allocate'"),
            ("std::bad_alloc", "libstdc++: 'what():  std::bad_alloc'"),
            ("insufficient shared memory", "torch/utils/data/_utils/signal_handling: 'This might be caused by insufficient shared memory (shm)'"),
            ("bus error", "kernel SIGBUS, shell: 'Bus error (core dumped)'"),
            ("sigbus", "kernel signal name SIGBUS"),
            ("oom-kill", "mm/oom_kill.c: 'oom-kill:constraint=...,task=...,pid=...'"),
            ("invoked oom-killer", "mm/oom_kill.c: '%s invoked oom-killer: gfp_mask=...'"),
            ("killed due to memory pressure", "systemd-oomd: 'Killed ... due to memory pressure'"),
        ),
    ),
    _Rule("kernel_oom", Cause.HOST_OOM, ("killed process", "kill process"), pattern=_ci(r"out of memory|\boom\b"),
          origin="kernel",
          cites=(("killed process", "mm/oom_kill.c: 'Out of memory: Killed process %d (%s)'"),
                 ("kill process", "mm/oom_kill.c (older kernels): 'Out of memory: Kill process %d (%s)'"))),
    _Rule("python_memoryerror", Cause.HOST_OOM, ("memoryerror",), pattern=re.compile(r"(?<![\w.])MemoryError\b"),
          origin="python", cites=(("memoryerror", "CPython builtin exception MemoryError"),)),
    # -- hints of host memory, not evidence: a SIGKILL may come from a person, a supervisor or
    # a job scheduler; an ENOMEM from a tiny allocation (a signal stack, a thread) says nothing
    # about RAM. Without an OOM-killer record they are "other", with host_oom as runner-up.
    _Rule(
        "sigkill",
        Cause.OTHER,
        ("exit code", "exitcode", "return code", "returncode", "signal 9", "terminated with"),
        pattern=_ci(r"(?:exit ?code|return ?code)[:= ]{0,3}-9\b|killed by signal 9\b|signal 9 \(SIGKILL\)"
                    r"|\bterminated with -9\b"),
        context=_before_sigquit,
        strength="hint",
        runner_up=Cause.HOST_OOM,
        origins=(("exitcode", "python"), ("return code", "python"), ("returncode", "python"), ("signal 9", "kernel"),
                 ("terminated with", "sglang")),
        cites=(("signal 9", "shell/torch elastic: 'killed by signal 9 (SIGKILL)'"),
               ("terminated with", "sglang engine.py, a node >= 1 joining its schedulers: "
                                   "'Scheduler or DataParallelController {pid} terminated with {exitcode}'"),
               ("exitcode", "multiprocessing: 'exitcode=-9'"),
               ("return code", "subprocess: 'returned non-zero exit status'/'return code -9'"),
               ("returncode", "subprocess.CompletedProcess returncode=-9")),
    ),
    _Rule(
        "enomem",
        Cause.OTHER,
        ("cannot allocate memory", "errno 12]"),
        strength="hint",
        runner_up=Cause.HOST_OOM,
        origin="kernel",
        cites=(("cannot allocate memory", "glibc strerror(ENOMEM): 'Cannot allocate memory'"),
               ("errno 12]", "CPython OSError: '[Errno 12] Cannot allocate memory'")),
    ),
    _Rule(
        "ray_worker_died",
        Cause.OTHER,
        ("killed by sigkill by oom killer",),
        strength="hint",
        runner_up=Cause.HOST_OOM,
        origin="ray",
        cites=(("killed by sigkill by oom killer", "ray/_private/worker exit detail: 'There are some potential root "
                "causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.'"),),
    ),
    # -- the KV / request-slot pool: raise the fraction at startup, never lower it
    _Rule(
        "kv_pool_startup",
        Cause.KV_POOL_TOO_SMALL,
        (
            "increase --mem-fraction-static", "leave no gpu memory for the kv cache", "larger than the profiled value",
            "no available memory for the cache blocks",
            "maximum number of tokens that can be stored in kv cache",
            "larger than the available kv cache memory",
        ),
        usual_phase=Phase.STARTING,
        phase_in_text=True,
        origins=(
            ("no available memory for the cache blocks", "vllm"),
            ("maximum number of tokens that can be stored in kv cache", "vllm"),
            ("larger than the available kv cache memory", "vllm"),
        ),
        cites=(
            ("leave no gpu memory for the kv cache", "sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py:3051"),
            ("increase --mem-fraction-static", "sglang 0.5.23 srt/model_executor/pool_configurator.py:96"),
            ("larger than the profiled value", "sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py:3102"),
            ("no available memory for the cache blocks", "vllm/worker/cache_engine: 'No available memory for the cache blocks. "
             "Try increasing `gpu_memory_utilization`'"),
            ("maximum number of tokens that can be stored in kv cache", "vllm/v1/core/kv_cache_utils.py: "
             "'...is larger than the maximum number of tokens that can be stored in KV cache'"),
            ("larger than the available kv cache memory", "vllm/v1/core/kv_cache_utils.py: "
             "'...needed memory is larger than the available KV cache memory'"),
        ),
    ),
    _Rule(
        "kv_pool_exhausted",  # raised only by the scheduler's batch loop
        Cause.KV_POOL_TOO_SMALL,
        (
            "alloc_req_slots runs out of memory", "runs out of memory. please set a smaller number",
            "prefill out of memory", "decode out of memory", "out of memory. try to lower your batch size",
        ),
        usual_phase=Phase.SERVING,
        phase_in_text=True,
        origins=(("runs out of memory. please set a smaller number", "sglang-legacy"),),
        cites=(("runs out of memory. please set a smaller number", "sglang <= 0.4 schedule_batch.py alloc_req_slots: "
                "'alloc_req_slots runs out of memory. Please set a smaller number for `--max-running-requests`.'"),),
    ),
    # -- another process holds part of the GPU: clear it
    _Rule(
        "unbalanced",
        Cause.CUDA_OOM_STARTUP,
        ("memory capacity is unbalanced",),
        remedy=Remedy.CLEAR_GPU,
        usual_phase=Phase.STARTING,
        phase_in_text=True,
    ),
    # -- CUDA OOM: runtime or startup by phase
    _Rule(  # NCCL failed to allocate its own buffers: it does so at communicator init and on the
        # first collectives (warm-up, profiling, graph capture), so with no phase it is start-up
        "nccl_oom",
        Cause.CUDA_OOM_STARTUP,
        ("cuda failure 'out of memory'",),
        phased=True,
        usual_phase=Phase.STARTING,
        origin="nccl",
        cites=(("cuda failure 'out of memory'", "nccl src/include/checks.h CUDACHECK: "
                "WARN(\"Cuda failure '%s'\", cudaGetErrorString(err)) after a cudaMalloc in comm init / channel setup"),),
    ),
    _Rule(
        "cuda_oom",
        Cause.CUDA_OOM_RUNTIME,
        (
            "cuda out of memory", "cuda error: out of memory", "cuda driver error: out of memory",
            "torch.outofmemoryerror", "torch.cuda.outofmemoryerror",
            "hip out of memory", "npu out of memory", "xpu out of memory", "mps backend out of memory",
            "cublas_status_alloc_failed", "cudaerrormemoryallocation", "resource_exhausted: out of memory",
        ),
        phased=True,
        # Unknown phase: most OOMs pasted bare are serving-time activation spikes. The reading
        # is then uncertain and the remedy is one rung down, right for either phase.
        usual_phase=Phase.SERVING,
        origin="torch",
        origins=(("cublas_status_alloc_failed", "cuda"),
                 ("cudaerrormemoryallocation", "cuda"), ("resource_exhausted: out of memory", "xla"),
                 ("npu out of memory", "torch_npu"), ("hip out of memory", "torch"), ("xpu out of memory", "torch")),
        cites=(
            ("cuda out of memory", "c10/cuda/CUDACachingAllocator.cpp: 'CUDA out of memory. Tried to allocate'"),
            ("cuda error: out of memory", "c10/cuda/CUDAException.h: 'CUDA error: ' + cudaGetErrorString -> 'out of memory'"),
            ("cuda driver error: out of memory", "c10/cuda/driver_api.h: 'CUDA driver error: out of memory'"),
            ("torch.outofmemoryerror", "torch/__init__.py: OutOfMemoryError (torch >= 2.5)"),
            ("torch.cuda.outofmemoryerror", "torch/cuda/__init__.py: OutOfMemoryError (torch < 2.5)"),
            ("hip out of memory", "c10/hip/HIPCachingAllocator.cpp: 'HIP out of memory. Tried to allocate'"),
            ("npu out of memory", "torch_npu NPUCachingAllocator: 'NPU out of memory. Tried to allocate'"),
            ("xpu out of memory", "c10/xpu/XPUCachingAllocator.cpp: 'XPU out of memory. Tried to allocate'"),
            ("mps backend out of memory", "aten/src/ATen/mps/MPSAllocator.mm: 'MPS backend out of memory'"),
            ("cublas_status_alloc_failed", "cublas_api.h: CUBLAS_STATUS_ALLOC_FAILED"),
            ("cudaerrormemoryallocation", "cuda_runtime_api.h: cudaErrorMemoryAllocation = 2"),
            ("resource_exhausted: out of memory", "xla/tsl status: 'RESOURCE_EXHAUSTED: Out of memory'"),
        ),
    ),
    _Rule(  # "CUDA error (/path/kernel.h:188): out of memory"
        "cuda_oom_at",
        Cause.CUDA_OOM_RUNTIME,
        ("out of memory",),
        pattern=_ci(r"cuda error \([^)\n]{1,300}\): out of memory"),
        phased=True,
        usual_phase=Phase.SERVING,
        origin="cuda",
        cites=(("out of memory", "cuda_runtime_api.h cudaErrorMemoryAllocation: 'out of memory'"),),
    ),
    # -- CUDA faults; deterministic ones cannot be fixed by a restart
    _Rule(
        "cuda_deterministic",
        Cause.CUDA_ERROR,
        (
            "no kernel image is available", "unsupported toolchain", "ptx jit compilation failed",
            "invalid device function", "driver version is insufficient",
        ),
        remedy=Remedy.GIVE_UP,
        origin="cuda",
        cites=(
            ("no kernel image is available", "cuda_runtime_api.h cudaErrorNoKernelImageForDevice"),
            ("unsupported toolchain", "cuda_runtime_api.h cudaErrorUnsupportedPtxVersion: "
             "'the provided PTX was compiled with an unsupported toolchain'"),
            ("ptx jit compilation failed", "cuda_runtime_api.h cudaErrorJitCompilerNotFound/'PTX JIT compilation failed'"),
            ("invalid device function", "cuda_runtime_api.h cudaErrorInvalidDeviceFunction"),
            ("driver version is insufficient", "cuda_runtime_api.h cudaErrorInsufficientDriver"),
        ),
    ),
    _Rule(
        "cuda_fault",
        Cause.CUDA_ERROR,
        (
            "illegal memory access", "device-side assert triggered", "illegal instruction was encountered",
            "misaligned address", "unspecified launch failure", "cudaerrorillegaladdress",
            "cuda_error_illegal_address",
        ),
        origin="cuda",
        cites=(
            ("illegal memory access", "cuda_runtime_api.h cudaErrorIllegalAddress: 'an illegal memory access was encountered'"),
            ("device-side assert triggered", "cuda_runtime_api.h cudaErrorAssert: 'device-side assert triggered'"),
            ("illegal instruction was encountered", "cuda_runtime_api.h cudaErrorIllegalInstruction"),
            ("misaligned address", "cuda_runtime_api.h cudaErrorMisalignedAddress"),
            ("unspecified launch failure", "cuda_runtime_api.h cudaErrorLaunchFailure"),
            ("cudaerrorillegaladdress", "cuda_runtime_api.h: cudaErrorIllegalAddress = 700"),
            ("cuda_error_illegal_address", "cuda.h: CUDA_ERROR_ILLEGAL_ADDRESS = 700"),
        ),
    ),
    _Rule(  # a kernel's own assert, printed by the device runtime before the error is raised
        "device_assert",
        Cause.CUDA_ERROR,
        ("assertion `",),
        pattern=re.compile(r"\.cuh?:\d{1,6}: [^\n]{0,300}?block: \[\d{1,6},\d{1,6},\d{1,6}\], thread: \[\d{1,6},\d{1,6},\d{1,6}\] Assertion `"),
        origin="cuda",
        cites=(("assertion `", "CUDA device runtime __assertfail: '%s:%d: %s: block: [%d,%d,%d], thread: [%d,%d,%d] "
                "Assertion `%s` failed.'"),),
    ),
    # -- a port someone else holds (HTTP, dist-init, ZMQ)
    _Rule("port", Cause.PORT_IN_USE, ("address already in use", "eaddrinuse", "errno 98", "address in use"),
          origin="kernel",
          cites=(("address already in use", "glibc strerror(EADDRINUSE): 'Address already in use'"),
                 ("eaddrinuse", "errno name EADDRINUSE (torch TCPStore: 'name: EADDRINUSE')"),
                 ("errno 98", "CPython OSError: '[Errno 98] Address already in use'"),
                 ("address in use", "zmq: 'Address in use' (zmq.error.ZMQError)"))),
    _Rule("port_taken", Cause.PORT_IN_USE, ("already in use",), pattern=_ci(r"\bport\b[^\n]{0,60}?already in use"),
          cites=(("already in use", "sglang server_args.py / utils: 'port ... is already in use'"),)),
    # -- NCCL / distributed communication
    _Rule(
        "nccl",
        Cause.NCCL_ERROR,
        (
            "nccl error", "ncclinternalerror", "ncclsystemerror", "ncclunhandledcudaerror",
            "ncclremoteerror", "ncclinvalidusage", "distbackenderror", "distnetworkerror", "nccl communicator",
        ),
        origin="nccl",
        origins=(("distbackenderror", "torch"), ("distnetworkerror", "torch"), ("nccl error", "torch")),
        cites=(
            ("nccl error", "torch/csrc/distributed/c10d/NCCLUtils.hpp C10D_NCCL_CHECK: 'NCCL error in: '"),
            ("ncclinternalerror", "nccl.h ncclInternalError"), ("ncclsystemerror", "nccl.h ncclSystemError"),
            ("ncclunhandledcudaerror", "nccl.h ncclUnhandledCudaError"), ("ncclremoteerror", "nccl.h ncclRemoteError"),
            ("ncclinvalidusage", "nccl.h ncclInvalidUsage"),
            ("distbackenderror", "torch/distributed: DistBackendError"),
            ("distnetworkerror", "torch/distributed: DistNetworkError"),
            ("nccl communicator", "torch ProcessGroupNCCL: 'NCCL communicator was aborted'"),
        ),
    ),
    # -- echoes: a collective that timed out or a peer that vanished is what the other ranks
    # see after one rank died; the cause is that rank's failure when the log has it
    _Rule(
        "nccl_watchdog",
        Cause.NCCL_ERROR,
        ("collective operation timeout", "process group watchdog"),
        strength="echo",
        origin="torch",
        cites=(("collective operation timeout", "torch ProcessGroupNCCL.cpp: 'Watchdog caught collective operation timeout'"),
               ("process group watchdog", "torch ProcessGroupNCCL.cpp: 'Process group watchdog thread terminated with exception'")),
    ),
    _Rule(  # torch's NCCL watchdog; its warnings ("using GPU 0 to perform barrier") do not count
        "nccl_timeout",
        Cause.NCCL_ERROR,
        ("processgroupnccl",),
        pattern=_ci(
            r"checktimeout|detected by watchdog|failed or timed out|taking the entire process down|was aborted"
        ),
        strength="echo",
        origin="torch",
        cites=(("processgroupnccl", "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"),),
    ),
    # gloo failures (its transport or mesh setup), not "[Gloo] Rank 0 is connected to 7 peer ranks"
    _Rule("gloo", Cause.NCCL_ERROR, ("gloo/transport/", "connectfullmesh failed", "connection closed by peer",
                                     "connection reset by peer"),
          strength="echo", origin="gloo",
          origins=(("connection reset by peer", "kernel"),),
          cites=(("gloo/transport/", "gloo/transport/tcp/pair.cc: '[.../gloo/transport/tcp/pair.cc:534] Connection closed by peer'"),
                 ("connectfullmesh failed", "gloo/rendezvous/context.cc: 'connectFullMesh failed'"),
                 ("connection closed by peer", "gloo/transport/tcp/pair.cc: 'Connection closed by peer'"),
                 ("connection reset by peer", "glibc strerror(ECONNRESET): 'Connection reset by peer'"))),
    # -- any other CUDA error
    _Rule(
        "cuda_error",
        Cause.CUDA_ERROR,
        ("cuda error", "cuda driver error", "cuda runtime error", "cudaerror", "cuda_error_", "cublas_status_",
         "cudnn_status_", "acceleratorerror", "cuda failure", "triton error [cuda]"),
        pattern=_CUDA_ERROR_PATTERN,
        origin="torch",
        origins=(("cudaerror", "cuda"), ("cuda_error_", "cuda"), ("cublas_status_", "cuda"), ("cudnn_status_", "cuda"),
                 ("cuda failure", "nccl"), ("triton error [cuda]", "triton")),
        cites=(("cuda error", "c10/cuda/CUDAException.h C10_CUDA_CHECK: 'CUDA error: '"),
               ("cuda driver error", "c10/cuda/driver_api.h: 'CUDA driver error: '"),
               ("cuda runtime error", "torch (old) THCGeneral: 'cuda runtime error (%d) : %s'"),
               ("cudaerror", "cuda_runtime_api.h cudaError_t names"), ("cuda_error_", "cuda.h CUresult names"),
               ("cublas_status_", "cublas_api.h cublasStatus_t names"), ("cudnn_status_", "cudnn.h cudnnStatus_t names"),
               ("acceleratorerror", "torch/__init__.py AcceleratorError (torch >= 2.8)"),
               ("cuda failure", "nccl src/include/checks.h: 'Cuda failure '%s''"),
               ("triton error [cuda]", "triton/backends/nvidia/driver.c: 'Triton Error [CUDA]: '")),
    ),
    # -- SGLang's own scheduler watchdog (not NCCL's, matched above)
    _Rule(
        "watchdog",
        Cause.WATCHDOG_HANG,
        ("(self.watchdog_timeout=", "scheduler watchdog timeout", "scheduler debug info:"),
        usual_phase=Phase.SERVING,  # it fires only with a batch in flight
        phase_in_text=True,
        source_text=(
            ("(self.watchdog_timeout=", ("({self.watchdog_timeout=}",)),
            ("scheduler watchdog timeout", ('f"{self.debug_name} watchdog timeout "', 'debug_name="Scheduler"')),
            ("scheduler debug info:", ('f"{self.debug_name} debug info:', 'debug_name="Scheduler"')),
        ),
        cites=(("(self.watchdog_timeout=", "sglang 0.5.23 srt/utils/watchdog.py:154-155"),
               ("scheduler watchdog timeout", "sglang 0.5.23 srt/utils/watchdog.py:154"),
               ("scheduler debug info:", "sglang 0.5.23 srt/utils/watchdog.py:150")),
    ),
    # -- the model cannot be loaded
    _Rule(
        "model_files",
        Cause.MODEL_LOAD_ERROR,
        (
            "are not supported for now", "is not supported for now", "unsupported architectures:",
            "does not recognize this architecture",
            "unrecognized model in", "failed to be inspected", "safetensorerror",
            "error while deserializing header", "headertoolarge", "metadataincompletebuffer",
            "incomplete metadata", "does not appear to have a file named", "is not a valid model identifier",
            "repository not found", "gatedrepoerror", "can't load the configuration", "can't load tokenizer",
            "error(s) in loading state_dict", "size mismatch for", "unrecognized configuration class",
            "pytorchstreamreader failed", "invalid load key", "not a local folder and is not a valid model identifier",
            "repo id must be in the form", "hfvalidationerror",
        ),
        origin="hf",
        origins=(
            ("are not supported for now", "sglang"), ("is not supported for now", "sglang-legacy"),
            ("unsupported architectures:", "sglang-legacy"), ("failed to be inspected", "vllm"),
            ("safetensorerror", "safetensors"), ("error while deserializing header", "safetensors"),
            ("headertoolarge", "safetensors"), ("metadataincompletebuffer", "safetensors"),
            ("incomplete metadata", "safetensors"), ("error(s) in loading state_dict", "torch"),
            ("size mismatch for", "torch"), ("pytorchstreamreader failed", "torch"), ("invalid load key", "python"),
        ),
        cites=(
            ("is not supported for now", "sglang <= 0.4 model_config: 'Model architectures [...] is not supported for now'"),
            ("unsupported architectures:", "sglang 0.2-0.3 model_loader: 'Unsupported architectures: %s. Supported list: %s'"),
            ("does not recognize this architecture", "transformers/models/auto/configuration_auto.py: "
             "'Transformers does not recognize this architecture'"),
            ("unrecognized model in", "transformers configuration_auto.py: 'Unrecognized model in %s'"),
            ("failed to be inspected", "vllm/model_executor/models/registry.py: 'Model architectures %s failed to be inspected'"),
            ("safetensorerror", "safetensors_rust.SafetensorError"),
            ("error while deserializing header", "safetensors: 'Error while deserializing header: %s'"),
            ("headertoolarge", "safetensors: HeaderTooLarge"), ("metadataincompletebuffer", "safetensors: MetadataIncompleteBuffer"),
            ("incomplete metadata", "safetensors: 'incomplete metadata, file not fully covered'"),
            ("does not appear to have a file named", "transformers/utils/hub.py: '%s does not appear to have a file named %s'"),
            ("is not a valid model identifier", "transformers/utils/hub.py: 'is not a local folder and is not a valid model identifier'"),
            ("not a local folder and is not a valid model identifier", "transformers/utils/hub.py"),
            ("repository not found", "huggingface_hub RepositoryNotFoundError: 'Repository Not Found'"),
            ("gatedrepoerror", "huggingface_hub.errors.GatedRepoError"),
            ("can't load the configuration", "transformers configuration_utils.py: \"Can't load the configuration of\""),
            ("can't load tokenizer", "transformers tokenization_utils_base.py: \"Can't load tokenizer for\""),
            ("error(s) in loading state_dict", "torch/nn/modules/module.py: 'Error(s) in loading state_dict for'"),
            ("size mismatch for", "torch/nn/modules/module.py: 'size mismatch for %s'"),
            ("unrecognized configuration class", "transformers auto_factory.py: 'Unrecognized configuration class'"),
            ("pytorchstreamreader failed", "caffe2/serialize/inline_container.cc: 'PytorchStreamReader failed reading zip archive'"),
            ("invalid load key", "CPython pickle: \"invalid load key, '%c'.\""),
            ("repo id must be in the form", "huggingface_hub/utils/_validators.py: 'Repo id must be in the form'"),
            ("hfvalidationerror", "huggingface_hub.errors.HFValidationError"),
        ),
    ),
    _Rule(
        "model_path",
        Cause.MODEL_LOAD_ERROR,
        ("no such file or directory",),
        pattern=_ci(
            r"no such file or directory[^\n]{0,300}?"
            r"(?:safetensors|\.bin\b|\.pt\b|\.gguf|config\.json|tokenizer|/models?/)"
        ),
        origin="kernel",
        cites=(("no such file or directory", "glibc strerror(ENOENT): 'No such file or directory'"),),
    ),
    _Rule(  # a checkpoint that does not match the model code
        "loader_mismatch",
        Cause.MODEL_LOAD_ERROR,
        ("keyerror", "assertionerror"),
        pattern=re.compile(r"(?<![\w.])(?:KeyError|AssertionError)\b"),
        context=_loader_context,
        origin="python",
        cites=(("keyerror", "CPython builtin KeyError, raised in a load_weights frame"),
               ("assertionerror", "CPython builtin AssertionError, raised in a load_weights frame")),
    ),
    # -- the server's arguments (argparse, or an exception that names a flag or a constraint)
    _Rule(
        "argparse",
        Cause.CONFIG_ERROR,
        ("error: unrecognized arguments", "error: argument", "error: ambiguous option",
         "error: the following arguments are required", "invalid choice:"),
        origin="python",
        cites=(("error: unrecognized arguments", "CPython argparse.py: 'unrecognized arguments: %s'"),
               ("error: argument", "CPython argparse.py ArgumentError: 'argument %s: %s'"),
               ("error: ambiguous option", "CPython argparse.py: 'ambiguous option: %s could match %s'"),
               ("error: the following arguments are required", "CPython argparse.py: 'the following arguments are required: %s'"),
               ("invalid choice:", "CPython argparse.py: 'invalid choice: %r (choose from %s)'")),
    ),
    _Rule(
        "constraint",
        Cause.CONFIG_ERROR,
        ("compatible with", "cannot be used", "not supported with", "not supported when", "divisible by",
         "user-specified max_model_len", "trust_remote_code", "no bucket >=", "validation error for"),
        pattern=_ci(
            r"not compatible with|incompatible with|cannot be used (?:together )?with"
            r"|(?:is|are) not supported (?:with|when)|divisible by|user-specified max_model_len"
            r"|trust_remote_code|no bucket >= ?\d|validation error for"
        ),
        context=_raised_or_validation,  # an exception or a validation message, not a warning
        origins=(("user-specified max_model_len", "vllm"), ("no bucket >=", "vllm"), ("validation error for", "pydantic"),
                 ("trust_remote_code", "hf")),
        cites=(("user-specified max_model_len", "vllm/config: 'User-specified max_model_len (%d) is greater than'"),
               ("no bucket >=", "vllm-ascend/hpu bucketing: 'no bucket >= %d'"),
               ("validation error for", "pydantic_core: '%d validation error for %s'"),
               ("trust_remote_code", "transformers dynamic_module_utils: 'set the option `trust_remote_code=True`'"),
               ("divisible by", "sglang/vllm config checks: '... must be divisible by tensor parallel size'"),
               ("compatible with", "sglang server_args.py checks: '... is not compatible with ...'"),
               ("cannot be used", "sglang server_args.py checks: '... cannot be used with ...'"),
               ("not supported with", "sglang server_args.py checks: '... is not supported with ...'"),
               ("not supported when", "sglang server_args.py checks: '... is not supported when ...'")),
    ),
    _Rule(
        "flag_named",
        Cause.CONFIG_ERROR,
        ("valueerror", "assertionerror", "argumenterror", "argumenttypeerror"),
        pattern=re.compile(r"(?<![\w-])--[a-z][a-z0-9-]{1,60}"),
        context=_raised_by(("ValueError", "AssertionError", "ArgumentError", "ArgumentTypeError")),
        origin="python",
        cites=(("valueerror", "CPython builtin ValueError naming a --flag"),
               ("assertionerror", "CPython builtin AssertionError naming a --flag"),
               ("argumenterror", "CPython argparse.ArgumentError"), ("argumenttypeerror", "CPython argparse.ArgumentTypeError")),
    ),
    _Rule(  # a flag or environment value of the wrong type (a string where a number belongs)
        "value_type",
        Cause.CONFIG_ERROR,
        ("typeerror",),
        pattern=re.compile(
            r"TypeError: (?:'str' object cannot be interpreted as an integer"
            r"|[^\n]{0,80}must be (?:an? )?(?:int|integer|float|real number)[^\n]{0,20}, not '?str"
            r"|'[<>]=?' not supported between instances of (?:'str' and '(?:int|float)'|'(?:int|float)' and 'str')"
            r"|unsupported operand type\(s\) for [^\n]{1,6}: (?:'str' and '(?:int|float)'|'(?:int|float)' and 'str'))"
        ),
        context=_at_startup,
        origin="python",
        cites=(("typeerror", "CPython: \"'str' object cannot be interpreted as an integer\", "
                "\"must be real number, not str\", \"'<' not supported between instances of 'str' and 'int'\""),),
    ),
)
_NEEDLES: tuple[str, ...] = tuple(dict.fromkeys(n for rule in RULES for n in rule.needles))


# --------------------------------------------------------------------------- the catalogue's families

# What each family of the stack's messages means (docs/diagnosis.md says why). A family is
# read as a pseudo-rule, so its findings go through the same phase, certainty and remedy
# logic as a rule's. ``generic`` and ``other`` are not here: they name no cause.
def _family(name: str, cause: Cause, **kw: object) -> _Rule:
    return _Rule(f"family {name}", cause, (), origin="catalogue", **kw)  # type: ignore[arg-type]


FAMILIES: dict[str, _Rule] = {
    "cuda.memory": _family("cuda.memory", Cause.CUDA_OOM_RUNTIME, phased=True, usual_phase=Phase.SERVING),
    "cuda.hardware": _family("cuda.hardware", Cause.GPU_HW_ERROR),
    "cuda.launch": _family("cuda.launch", Cause.CUDA_ERROR),
    "cuda.toolchain": _family("cuda.toolchain", Cause.CUDA_ERROR, remedy=Remedy.GIVE_UP),
    "cuda.environment": _family("cuda.environment", Cause.CONFIG_ERROR),
    "cuda.other": _family("cuda.other", Cause.CUDA_ERROR),
    "host.memory": _family("host.memory", Cause.HOST_OOM),
    "hint.memory": _family("hint.memory", Cause.OTHER, strength="hint", runner_up=Cause.HOST_OOM),
    "kv_pool.startup": _family("kv_pool.startup", Cause.KV_POOL_TOO_SMALL, usual_phase=Phase.STARTING,
                               phase_in_text=True),
    "kv_pool.exhausted": _family("kv_pool.exhausted", Cause.KV_POOL_TOO_SMALL, usual_phase=Phase.SERVING,
                                 phase_in_text=True),
    "nccl.error": _family("nccl.error", Cause.NCCL_ERROR),
    "nccl.echo": _family("nccl.echo", Cause.NCCL_ERROR, strength="echo"),
    "port.bind": _family("port.bind", Cause.PORT_IN_USE),
    "config.args": _family("config.args", Cause.CONFIG_ERROR),
    "model.load": _family("model.load", Cause.MODEL_LOAD_ERROR),
    "watchdog": _family("watchdog", Cause.WATCHDOG_HANG, usual_phase=Phase.SERVING, phase_in_text=True),
}
# A child that ended: a hint when SIGKILL ended it (exit code -9), else nothing of its own.
_PROCESS_EXIT = "process.exit"
_NAMELESS = frozenset({"generic", "other", _PROCESS_EXIT})  # known words that name no cause

# New words, read by the code that raised them: the subsystem of the innermost frame that
# is not plumbing (catalogue.modules(), generated from the packages' trees) -> a reading.
# Never certain; the basis names the frame.
_SKIPPED_SUBSYSTEMS = frozenset({"dispatch"})
_CONFIG_TYPES = frozenset({"ValueError", "TypeError", "AssertionError", "NotImplementedError", "KeyError",
                           "ArgumentError", "ArgumentTypeError", "ValidationError"})
FRAME_READINGS: dict[str, _Rule] = {
    "config": _Rule("frames config", Cause.CONFIG_ERROR, (), origin="frames"),
    "model_load": _Rule("frames model_load", Cause.MODEL_LOAD_ERROR, (), origin="frames"),
    "cuda": _Rule("frames cuda", Cause.CUDA_ERROR, (), origin="frames"),
    # an error in communication code: the rank's own, or what it saw when a peer died first
    "distributed": _Rule("frames distributed", Cause.NCCL_ERROR, (), origin="frames", strength="echo"),
    "memory": _Rule("frames memory", Cause.KV_POOL_TOO_SMALL, (), origin="frames"),
}

# Causes that are often the consequence of another failure (a peer killed by the kernel
# shows up as an NCCL timeout); a kernel OOM-killer line overrides them.
_CONSEQUENTIAL = frozenset({Cause.NCCL_ERROR, Cause.WATCHDOG_HANG, Cause.OTHER})

# Lines that report a failure without naming it; never evidence of a cause.
_GENERIC = (
    "hit an exception", "sigquit", "enginedeaderror", "engine loop has died", "engine loop is not running",
    "is already dead", "output_handler failed", "scheduler is dead", "exception in callback",
    "unhandled error", "keyboardinterrupt", "systemexit", "cancellederror", "child process",
)


# --------------------------------------------------------------------------- phase markers

# In the failure report (frames, source lines, the error itself): startup stages.
_WEIGHTS_FRAMES = (
    "load_model", "load_weights", "weight_loader", "process_weights_after_loading", "create_weights",
    "repack", "model_loader", "init_memory_pool", "loading shards", "checkpoint shards",
)
_CAPTURE_FRAMES = (
    "init_cuda_graphs", "= cudagraphrunner(", "capture", "warmup", "warm_up", "warming up",
    "profile_run", "_dummy_run", "_dummy_sampler_run", "dummy_metadata", "dummy_batch", "dummy_input",
    "determine_num_available_blocks", "determine_available_memory", "initialize_kv_cache",
    "profile_max_num_token", "kv_cache_configurator", "init_device_graphs", "cuda_graph_capture",
)
_STARTUP_FRAMES = (
    "= scheduler(", "= modelrunner(", "= tpmodelworker(", "= tpworkerclass(", "init_model_worker",
    "in initialize\n", ".initialize(", "init_device", "from_engine_args", "_init_engine",
    "failed to initialize", "during initialization", "initialization failed", "init_torch_distributed",
    "initialize_model_parallel", "ncclcomminitrank", "enginecoreproc(", "failed to start",
)
_SERVING_FRAMES = (
    "forward_batch_generation", "run_batch", "event_loop_overlap", "event_loop_normal", "event_loop_pp",
    "forward_thread_func", "forward_extend", "forward_decode", "execute_model", "step_with_batch_queue",
    "run_busy_loop", "_process_engine_step", "run_engine_loop", "engine_step", "_log_task_completion",
    "output_handler", "error in model execution", "serving_chat", "serving_completion", "engine loop",
    "process_batch_result", "get_next_batch_to_run", "get_model_worker_batch", "worker_busy_loop",
    "forward_prefill", "_continuation_prefill", "generate_request", "handle_generate_request",
)
# Lines that belong to a failure report although they are not traceback lines.
_REPORT_LINES = (
    "exception in worker", "exception in callback", "output_handler failed", "error in model execution",
    "hit an exception", "enginedeaderror", "engine loop",
)
# Progress lines in the log (nearest one before the evidence wins) -> startup stage.
_STARTUP_PROGRESS: dict[str, str] = {
    "load weight begin": "weights",
    "loading safetensors": "weights",
    "loading shards": "weights",
    "checkpoint shards": "weights",
    "loading model from": "weights",
    "load weight end": "pool",
    "kv cache is allocated": "pool",
    "memory pool end": "capture",
    "capture cuda graph": "capture",
    "capturing batches": "capture",
    "loading model weights took": "capture",
    "loading weights took": "capture",
    "model loading took": "capture",
    "memory profiling": "capture",
}
_SERVING_PROGRESS = (
    "ready to roll", "prefill batch", "decode batch", 'http/1.1"', "added request", "avg prompt throughput",
)
_BATCH_LINES = ("prefill batch", "decode batch")
_CLEAR_GPU_STAGES = frozenset({"weights", "pool"})


# --------------------------------------------------------------------------- the log


def tail_text(tail: bytes | str, limit: int = MAX_TAIL_BYTES) -> str:
    """The last ``limit`` bytes (characters for str) as text, starting at a whole line."""
    if isinstance(tail, bytes | bytearray | memoryview):
        raw = bytes(tail[-limit:]) if len(tail) > limit else bytes(tail)
        cut = len(tail) > limit
        text = raw.decode("utf-8", errors="replace")
    else:
        cut = len(tail) > limit
        text = tail[-limit:] if cut else tail
    if cut:
        first_newline = text.find("\n")
        if 0 <= first_newline < len(text) - 1:
            text = text[first_newline + 1 :]
    return text


# Where a line that had other lines joined onto it is cut again: before a traceback header,
# a frame line, a timestamped record or an exception line.
_JOIN_POINT = re.compile(
    r"(?<=\S) {1,8}(?=Traceback \(most recent call last\)|File \"[^\"\n]{1,300}\", line \d"
    r"|\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d|(?:[A-Za-z_]\w{0,60}\.){0,6}[A-Z]\w{0,60}(?:Error|Exception): )"
)
_JOINED_LINE_CHARS = 600  # only lines longer than this are looked at for joins


def _is_blank(line: str) -> bool:
    """Empty once its log prefix (quote marks, timestamp, rank, docker column) is gone."""
    bare = line.strip(" >\t\r")
    return not bare or (len(line) < 120 and not _strip_prefix(line).strip())


def _unmangle(parts: list[str]) -> tuple[list[str], list[int] | None]:
    """The lines of a log pasted with a blank line after every line, or with lines joined,
    back as the server printed them; and each new line's index in ``parts`` (None: same)."""
    blank = [_is_blank(line) for line in parts]
    nonblank = [i for i, b in enumerate(blank) if not b]
    doubled = len(nonblank) >= 4 and sum(
        1 for i in nonblank if i + 1 < len(parts) and blank[i + 1]
    ) >= 0.8 * len(nonblank)
    long_lines = any(len(line) > _JOINED_LINE_CHARS for line in parts)
    if not doubled and not long_lines:
        return parts, None
    lines: list[str] = []
    orig: list[int] = []
    for i in nonblank if doubled else range(len(parts)):
        line = parts[i]
        pieces = [line]
        if len(line) > _JOINED_LINE_CHARS:
            cuts = [m.end() for m in _JOIN_POINT.finditer(line, 0, 64 * MAX_LINE_CHARS)][:200]
            # Never between a line's own log prefix and its message ("... [executor.py:383] torch.XError: ...").
            cuts = [c for k, c in enumerate(cuts) if _strip_prefix(line[(cuts[k - 1] if k else 0):c]).strip()]
            if cuts:
                pieces = [line[a:b] for a, b in zip([0, *cuts], [*cuts, len(line)], strict=True)]
        lines.extend(pieces)
        orig.extend([i] * len(pieces))
    return lines, orig


_ISO_STAMP = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?")


def _newest_first(parts: list[str]) -> bool:
    """A log pasted from a viewer that lists the newest line first: its timestamps go down,
    or its tracebacks' headers come after their frames ("Traceback (most recent call last)"
    is always followed by its first frame when written)."""
    stamps = [m.group(0).replace(" ", "T").replace(",", ".") for line in parts[:4000]
              if (m := _ISO_STAMP.search(line[:120])) is not None]
    pairs = list(zip(stamps, stamps[1:], strict=False))
    down, up = sum(a > b for a, b in pairs), sum(a < b for a, b in pairs)
    if down >= 5 and down >= 4 * up:
        return True
    before = after = 0
    for i, line in enumerate(parts[:MAX_LINES]):
        if _TRACEBACK not in line.lower():
            continue
        near_before = any(_FRAME.search(parts[j]) for j in range(max(0, i - 2), i))
        near_after = any(_FRAME.search(parts[j]) for j in range(i + 1, min(len(parts), i + 3)))
        before += near_before and not near_after
        after += near_after
    return before > after


class _Log:
    """A log tail split into lines, with substring search over its lowered text.

    The crash is searched for only after the last line that proves the server outlived
    everything before it: the last ``ready to roll``, or the batch line that has
    ``KEPT_SERVING_BATCHES - 1`` more after it. In a long serving log that is a short
    stretch at the end, so the rule needles scan little text.
    """

    def __init__(self, text: str, lines_after_ready: int | None = None) -> None:
        parts = text.replace("\r\n", "\n").rsplit("\n", MAX_LINES)
        self.skipped = 0  # lines dropped from the front (beyond MAX_LINES)
        if len(parts) > MAX_LINES:
            self.skipped = parts[0].count("\n") + 1
            parts = parts[1:]
        # The first line (an index into parts) logged after the daemon saw the server ready.
        ready_part = None if lines_after_ready is None else max(0, len(parts) - 1 - lines_after_ready)
        parts, self._orig = _unmangle(parts)
        if _newest_first(parts):
            # A log viewer that shows the newest line first: read it in the order it was written.
            orig = self._orig if self._orig is not None else list(range(len(parts)))
            parts, self._orig = parts[::-1], orig[::-1]
            if ready_part is not None:
                ready_part = None  # the daemon never hands over such a log; a file's offset means nothing here
        self._lines = parts
        self._low_text = "\n".join(parts).lower()  # lower() never makes or takes a newline
        self._low_lines = self._low_text.split("\n")
        self._starts = list(accumulate((len(line) + 1 for line in self._low_lines), initial=0))
        self.count = len(parts)
        ready = self.last_line(("ready to roll",), self.count)
        outlived = self.nth_last_line(_BATCH_LINES, KEPT_SERVING_BATCHES)
        self.crash_start = max(ready, outlived) + 1  # where the crash can begin
        self.ready_index: int | None  # the first line logged after the server was last ready
        if ready_part is not None:  # the daemon's own READY (a group node >= 1 logs no ready line)
            self.ready_index = next((i for i in range(self.count) if self._part(i) >= ready_part), self.count)
            self.crash_start = max(self.crash_start, self.ready_index)
        else:
            self.ready_index = ready + 1 if ready >= 0 else None
        self.first_sigquit = self.first_line(("received sigquit", "sigquit received"), self.crash_start)

    def _part(self, i: int) -> int:
        """The index in the text's own lines of line ``i`` (they differ once unmangled)."""
        return self._orig[i] if self._orig is not None else i

    def lineno(self, i: int) -> int:
        """1-based line number of line ``i`` in the text given."""
        return (self._orig[i] if self._orig is not None else i) + 1 + self.skipped

    def text(self, i: int) -> str:
        return self._lines[i][:MAX_LINE_CHARS].rstrip("\r")

    def low(self, i: int) -> str:
        return self._low_lines[i][:MAX_LINE_CHARS]

    def _line_of(self, pos: int) -> int:
        return bisect_right(self._starts, pos) - 1

    def find_needles(self, needles: tuple[str, ...], start: int = 0, last: int = MAX_CANDIDATES) -> dict[int, set[str]]:
        """The needles each line from ``start`` on holds, for the ``last`` last lines per needle."""
        hits: dict[int, set[str]] = {}
        low, starts = self._low_text, self._starts
        for needle in needles:
            end, found = len(low), 0
            while found < last and (pos := low.rfind(needle, starts[start], end)) != -1:
                i = self._line_of(pos)
                hits.setdefault(i, set()).add(needle)
                found += 1
                end = starts[i]
        return hits

    def find_lines(self, needles: tuple[str, ...], start: int = 0, last: int = MAX_CANDIDATES) -> list[int]:
        """Sorted indices of the ``last`` last lines from ``start`` on that hold any needle."""
        return sorted(self.find_needles(needles, start, last))[-last:]

    def first_line(self, needles: tuple[str, ...], start: int = 0) -> int | None:
        found = [self._line_of(p) for n in needles if (p := self._low_text.find(n, self._starts[start])) != -1]
        return min(found) if found else None

    def last_line(self, needles: tuple[str, ...], before: int) -> int:
        """Index of the last line before ``before`` holding a needle, or -1."""
        end = self._starts[before]
        found = [self._line_of(p) for n in needles if (p := self._low_text.rfind(n, 0, end)) != -1]
        return max(found, default=-1)

    def nth_last_line(self, needles: tuple[str, ...], n: int) -> int:
        """Index of the ``n``-th last line holding a needle, or -1 when there are fewer."""
        found: set[int] = set()
        for needle in needles:
            end = len(self._low_text)
            while len(found) < 2 * n and (pos := self._low_text.rfind(needle, 0, end)) != -1:
                line = self._line_of(pos)
                found.add(line)
                end = self._starts[line]
        ordered = sorted(found, reverse=True)
        return ordered[n - 1] if len(ordered) >= n else -1

    # -- line kinds

    def is_frame(self, i: int) -> bool:
        return 0 <= i < self.count and 'file "' in self.low(i) and _FRAME.search(self.text(i)) is not None

    def is_code(self, i: int) -> bool:
        """A source line that a traceback shows under a frame line (or a bare ``raise``)."""
        if _strip_prefix(self.text(i)).startswith(("raise ", "return ", "assert ")):
            return True
        return self.is_frame(i - 1) and not self.is_frame(i) and _parse_exception(self.text(i)) is None

    def exception(self, i: int) -> tuple[str, str] | None:
        low = self.low(i)
        if "rror" not in low and "xception" not in low and "exit" not in low and "interrupt" not in low \
                and "failure" not in low and "fault" not in low:
            return None
        return _parse_exception(self.text(i))

    def traceback_lines(self, index: int) -> list[int]:
        """Indices of the traceback right above ``index`` (innermost first), up to its header."""
        found = []
        for i in range(index - 1, max(-1, index - 1 - _BACK_WINDOW), -1):
            if _TRACEBACK in self.low(i):
                found.append(i)
                break
            if not (self.is_frame(i) or self.is_code(i) or _CARETS.fullmatch(_strip_prefix(self.text(i)))
                    or self._continued_source(i)):
                break  # not part of a traceback
            found.append(i)
        return found

    def _continued_source(self, i: int) -> bool:
        """An indented line of a multi-line source statement that a traceback shows."""
        text = self.text(i)
        body = _strip_prefix(text)
        return bool(body) and text[: len(text) - len(body)].endswith("    ") and self.exception(i) is None

    def logical(self, i: int) -> tuple[str, int]:
        """Line ``i`` plus, for an exception whose message is on the next lines, those lines."""
        text = self.text(i)
        exc = self.exception(i)
        dangling = exc is not None and not exc[1]
        if not dangling and (exc is None or not any(k in self.low(i) for k in _DETAILS_FOLLOW)):
            return text, i
        end, shape = i, _prefix_shape(text)
        for j in range(i + 1, min(self.count, i + 7)):
            if not self.text(j).strip() or self.is_frame(j) or _TRACEBACK in self.low(j):
                break
            if (dangling and self.exception(j)) or _prefix_shape(self.text(j)) != shape:
                break  # the next exception, or another log record
            end = j
        return " ".join(self.text(k) for k in range(i, end + 1)), end

    # -- facts around a line

    def nearest_progress(self, i: int) -> tuple[tuple[Phase, str | None], str] | None:
        """The phase (and startup stage) the last progress line before ``i`` shows, and its marker."""
        last_startup = self.last_line(tuple(_STARTUP_PROGRESS), i)
        last_serving = self.last_line(_SERVING_PROGRESS, i)
        if last_startup < 0 and last_serving < 0:
            return None
        if last_serving > last_startup:
            low = self.low(last_serving)
            return (Phase.SERVING, None), next((k for k in _SERVING_PROGRESS if k in low), "serving")
        low = self.low(last_startup)
        key, stage = next(((k, st) for k, st in _STARTUP_PROGRESS.items() if k in low), ("start-up", None))
        return (Phase.STARTING, stage), key

    def progress_anywhere(self) -> tuple[tuple[Phase, str | None], str] | None:
        """The phase progress lines anywhere in the log show: serving lines mean serving;
        start-up markers with no ready line mean start-up (the server never became ready)."""
        serving = self.last_line(_SERVING_PROGRESS, self.count)
        if serving >= 0:
            low = self.low(serving)
            return (Phase.SERVING, None), next((k for k in _SERVING_PROGRESS if k in low), "serving")
        startup = self.last_line(tuple(_STARTUP_PROGRESS), self.count)
        if startup < 0:
            return None
        low = self.low(startup)
        key, stage = next(((k, st) for k, st in _STARTUP_PROGRESS.items() if k in low), ("start-up", None))
        return (Phase.STARTING, stage), key

    def report_lines(self, index: int, end: int) -> list[int]:
        """The failure report around an error: its traceback, itself, what follows."""
        lines = [*self.traceback_lines(index), *range(index, end + 1)]
        for j in range(end + 1, min(self.count, end + 1 + _AFTER_WINDOW)):
            low = self.low(j)
            if self.is_frame(j) or self.is_code(j) or any(k in low for k in _REPORT_LINES):
                lines.append(j)
        return lines

    def rank_near(self, index: int) -> str | None:
        rank = line_rank(self.text(index))
        if rank:
            return rank
        for i in self.traceback_lines(index):
            rank = line_rank(self.text(i))
            if rank:
                return rank
        return None

    def location(self, index: int) -> str | None:
        """The innermost frame above ``index`` outside torch's own code (else the innermost)."""
        first = None
        for i in self.traceback_lines(index):
            m = _FRAME.search(self.text(i))
            if m is None:
                continue
            path, lineno, func = m.groups()
            name = path.replace("\\", "/").rsplit("/", 1)[-1]
            where = f"{name}:{lineno} {func}"
            if "/torch/" not in path and not path.startswith("torch/"):
                return where
            first = first or where
        return first

    def exception_near(self, index: int) -> tuple[str, str, int] | None:
        """The exception line ``index`` is (or continues): type, message, its line index."""
        exc = self.exception(index)
        if exc is not None:
            return exc[0], exc[1], index
        for i in range(index - 1, max(-1, index - 7), -1):
            if self.is_frame(i) or not self.text(i).strip():
                return None
            exc = self.exception(i)
            if exc is not None:
                return (exc[0], exc[1], i) if not exc[1] else None
        return None


# --------------------------------------------------------------------------- diagnosis


@dataclass(frozen=True, slots=True)
class _Finding:
    rule: _Rule
    index: int  # the evidence line
    end: int  # last line of its logical line
    support: int  # a supporting line (== index when none)
    basis: str = ""  # what the reading rests on (Diagnosis.basis)
    cited: bool = False  # the evidence is a message of the stack's own code (catalogue or a cited rule)


_RUNNER_UP_LINES = 40  # candidate lines read past the first naming finding, for a runner-up
_STRENGTHS = ("names", "frames", "hint", "echo")
# Words of a line that may report a failure: such lines are looked up in the catalogue.
_ERROR_WORDS = (
    "error", "exception", "fail", "fatal", "abort", "cannot ", "can't ", "unable to", "invalid", "not supported",
    "unsupported", "out of memory", "timed out", "timeout", "refused", "denied", "not found", "no such",
    "mismatch", "exceeded", "insufficient", "illegal", "assert", "corrupt", "segmentation", "killed", "crash",
    "died", "lost", "must be", "expected", "warn", "exit code", "no kernel image", "already in use",
)
# A level word in the log prefix (vLLM, uvicorn, Python logging, c10's glog "[W1130 ...]").
_LEVEL = re.compile(r"(?<![\w-])(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?![\w-])|\[([WIEF])\d{3,4} \d\d:\d\d:\d\d")
_BELOW_ERROR = frozenset({"DEBUG", "INFO", "WARNING", "WARN", "W", "I"})


def _explicit_level(text: str) -> str | None:
    """The level a log prefix states, if any (NCCL's "NCCL WARN" reports its errors: not a level)."""
    prefix = text[: len(text) - len(_strip_prefix(text))]
    m = _LEVEL.search(prefix)
    if m is None:
        return None
    return m.group(1) or m.group(2)


# The families, most specific first: when one line holds several messages of the stack (a
# wrapper and what it wraps, an NCCL error and the CUDA failure under it), the most specific
# is the cause: NCCL failed because a CUDA allocation did.
_SPECIFIC = ("cuda.memory", "cuda.hardware", "cuda.launch", "cuda.toolchain", "cuda.environment", "host.memory",
             "kv_pool.startup", "kv_pool.exhausted", "port.bind", "watchdog", "model.load", "config.args", "nccl.error",
             "nccl.echo", "cuda.other", "hint.memory")
# A family whose words say little ("unknown error" of CUDA's table): a hand rule that reads the
# same line (nvidia-smi's "Unable to determine the device handle") goes first.
_WEAK_FAMILIES = frozenset({"cuda.other"})
_NCCL_MEMORY = _family("cuda.memory via nccl", Cause.CUDA_OOM_STARTUP, phased=True, usual_phase=Phase.STARTING)


@dataclass(frozen=True, slots=True)
class _Reading:
    """What the catalogue makes of one line: the family it names (None: none), the entry
    that says so, whether an NCCL message carried it, whether the stack prints the line's
    words below error level only, and whether the match is sure: the line holds the whole
    message, or enough of its opening words (``_SURE_LETTERS``) to leave no doubt."""

    family: str | None
    entry: _catalogue.Entry | None
    via_nccl: bool = False
    below: bool = False
    sure: bool = True


_SURE_LETTERS = 2 * _catalogue.MIN_LITERAL_CHARS


def _sure(m: _catalogue.Match) -> bool:
    return m.whole or m.entry.literal >= _SURE_LETTERS


def _resolve(m: _catalogue.Match, depth: int = 0) -> tuple[str | None, _catalogue.Entry, bool, bool]:
    """A match's family: a wrapper's is what it holds when the catalogue knows that (the
    CUDA table's description, another message, read again), nothing when it holds an error
    the catalogue does not know, else its own."""
    entry = m.entry
    nccl = entry.origin.startswith("nvidia-nccl") or "nccl" in entry.pattern.lower() or "cuda failure" in entry.pattern.lower()
    for value in m.values:  # a placeholder that holds a table's entry: "*** SIGBUS received at ...", "error 2 (out of memory)"
        held = _catalogue.catalogue().table_entry(value)
        if held is not None and held.family in FAMILIES:
            return held.family, held, nccl, True
    if m.inner and depth < 3:
        inner = _read_text(m.inner, depth + 1)
        if inner.family is not None and inner.entry is not None:
            return inner.family, inner.entry, nccl or inner.via_nccl, inner.sure
        if _parse_exception(m.inner) is not None or inner.entry is not None:
            return None, entry, nccl, True  # it wraps an error the stack names no cause for
    return (entry.family if entry.family in FAMILIES else None), entry, nccl, _sure(m)


def _read_text(text: str, depth: int = 0) -> _Reading:
    cat = _catalogue.catalogue()
    table = cat.match(text, tables=True) if depth else None
    if table is not None:
        return _Reading(table.entry.family if table.entry.family in FAMILIES else None, table.entry,
                        table.entry.origin.startswith("nvidia-nccl"))
    found = cat.matches(text)
    tail = cat.table_tail(text)
    if not found and tail is None:
        return _Reading(None, None)
    primary = cat.primary(found)
    if primary is not None and primary.entry.logged_below_error:
        return _Reading(None, primary.entry, below=True)  # the line is a warning's words, whatever it quotes
    readings = [_resolve(f, depth) for f in found]
    if tail is not None:
        readings.append((tail.family if tail.family in FAMILIES else None, tail, False, True))
    named = [r for r in readings if r[0] is not None]
    if not named:
        return _Reading(None, found[0].entry if found else tail)
    family, entry, nccl, sure = min(named, key=lambda r: (_SPECIFIC.index(r[0]) if r[0] in _SPECIFIC else len(_SPECIFIC),
                                                         not r[3]))
    return _Reading(family, entry, nccl, sure=sure)


def _catalogue_reading(text: str, exc: tuple[str, str] | None) -> _Reading:
    """What the catalogue makes of a line (its exception's message when the line as a whole
    matches nothing).

    The message the line opens with decides the level (``Catalogue.primary``): a warning's
    words are a warning, whatever messages it quotes after them. Of the families the line's
    messages name, the most specific wins (``_SPECIFIC``): a C++ library's message is matched
    piece by piece ("CUDA out of memory. Tried to allocate" and "Including non-PyTorch
    memory" are both in one OOM line), and a wrapper holds what it wraps."""
    body = _strip_prefix(text)
    reading = _read_text(body)
    if reading.entry is None and exc is not None and exc[1]:
        reading = _read_text(exc[1])
    return reading


def read_line(line: str) -> tuple[str | None, _catalogue.Entry | None]:
    """How the diagnosis reads one log line with the catalogue: the family it names (None:
    none, or a line printed below error level) and the entry that says so."""
    reading = _catalogue_reading(line, _parse_exception(line))
    return (None if reading.below else reading.family), reading.entry


def _family_finding(log: _Log, reading: _Reading, i: int, end: int) -> _Finding | None:
    """A catalogue reading as a finding. A CUDA failure raised while allocating pinned host
    memory (its frames say so) is the host's memory, not the device's; a device OOM that an
    NCCL message reports happened where NCCL allocates: at start-up, unless the log says
    otherwise."""
    if reading.family is None or reading.entry is None:
        return None
    rule = FAMILIES[reading.family]
    entry = reading.entry
    basis = f"catalogue: {reading.family}: {entry.origin}"
    if reading.family in ("cuda.memory", "cuda.other") and (pinned := _pinned_host_context(log, i)) is not None:
        return _Finding(FAMILIES["host.memory"], i, end, pinned, basis=f"{basis}; pinned host memory in its frames",
                        cited=True)
    if reading.family == "cuda.memory" and reading.via_nccl:
        rule = _NCCL_MEMORY
    if not reading.sure:
        basis += " (the line holds only its opening words)"
    return _Finding(rule, i, end, i, basis=basis, cited=reading.sure)


def _wraps_another(exc: tuple[str, str]) -> bool:
    """An exception whose message is another exception ("Capture cuda graph failed: TypeError:
    ..."), or a bare ``Exception`` with no message (its text follows on the next lines): its
    own frames are where it was re-raised, not where the error was."""
    message = exc[1].strip()
    if not message:
        return exc[0].rsplit(".", 1)[-1] == "Exception"
    return _parse_exception(message.split(": ", 1)[-1]) is not None


def _frames_finding(log: _Log, i: int, end: int, exc: tuple[str, str]) -> _Finding | None:
    """An exception no rule and no catalogue entry names, read by the code that raised it:
    the innermost frame of its traceback in a subsystem the module table knows."""
    for j in log.traceback_lines(i):
        fm = _FRAME.search(log.text(j))
        if fm is None:
            continue
        path, lineno, func = fm.groups()
        sub: str | None = _catalogue.subsystem(path)
        if any(h in func.lower() for h in _LOADER_HINTS):
            sub = "model_load"  # raised while loading the checkpoint, whatever module holds the loader
        if sub is None or sub in _SKIPPED_SUBSYSTEMS:
            continue
        rule = FRAME_READINGS.get(sub)
        if rule is None:
            return None  # raised in code of no failure family (the scheduler, a model): other
        if sub == "config" and exc[0].rsplit(".", 1)[-1] not in _CONFIG_TYPES:
            return None
        name = path.replace("\\", "/").rsplit("/", 1)[-1]
        return _Finding(rule, i, end, j, basis=f"frames: {name}:{lineno} {func} ({sub}, {_catalogue.module_path(path)})")
    return None


def _rule_finding(rule: _Rule, i: int, end: int, support: int, found: set[str]) -> _Finding:
    cited = any(rule.cite_of(n) is not None for n in found & set(rule.needles))
    kind = "rule" if cited else "corpus rule"
    return _Finding(rule, i, end, support, basis=f"{kind} {rule.name}", cited=cited)


def _line_finding(log: _Log, i: int, text: str, end: int, hits: dict[int, set[str]],
                  hand_rules: bool) -> _Finding | None:
    """What line ``i`` (``text``: its logical line, to ``end``) says of the crash, if anything:
    nothing when it is printed below error level; else the catalogue's family of its message,
    the hand rules for words the catalogue cannot hold (or reads only as CUDA's generic
    words), and, for an exception of new words, the frames that raised it."""
    level = _explicit_level(log.text(i))
    if (level in _BELOW_ERROR and "nccl warn" not in log.low(i)) or "nccl info" in log.low(i):
        return None  # a warning or an information line never killed anything
    exc = log.exception(i)
    reading = _catalogue_reading(text, exc)
    if reading.below and level is None:
        return None  # the stack prints these words as a warning
    finding = _family_finding(log, reading, i, end)
    weak = finding is not None and reading.family in _WEAK_FAMILIES and hand_rules
    if finding is None and reading.entry is not None and reading.entry.family == _PROCESS_EXIT \
            and _SIGKILLED.search(text):
        return _Finding(_SIGKILL_RULE, i, end, i, basis=f"catalogue: {_PROCESS_EXIT}: {reading.entry.origin}",
                        cited=True)
    if (finding is None or weak) and hand_rules:
        found = set().union(*(hits.get(j, ()) for j in range(i, end + 1)))
        for rule in RULES:
            support = rule.matches(log, i, text, found)
            if support is not None:
                return _rule_finding(rule, i, end, support, found)
    if finding is None and exc is not None and not any(g in log.low(i) for g in _GENERIC) \
            and not _wraps_another(exc):
        return _frames_finding(log, i, end, exc)
    return finding


def _find(log: _Log, hand_rules: bool = True) -> tuple[_Finding | None, _Finding | None]:
    """The first failure of the crash, and the first one of another cause after it.

    Each line that may report a failure is read in log order (``_line_finding``): every
    line of a short crash; in a long one, those with a rule's words, an exception or error
    words. The first line that names a cause wins; else the first frames reading; else the
    first hint (a SIGKILL, an ENOMEM); else the first echo (a closed peer connection, a
    collective timeout), which is then all we have.
    """
    hits = log.find_needles(_NEEDLES, log.crash_start) if hand_rules else {}
    if log.count - log.crash_start <= MAX_CANDIDATES:
        candidates = set(range(log.crash_start, log.count))  # a short crash: every line is read
    else:
        candidates = set(hits) | set(log.find_lines(_ERROR_WORDS, log.crash_start))
    consumed = -1
    first: dict[str, _Finding] = {}
    found_all: list[_Finding] = []
    after_names = 0
    for i in sorted(candidates)[-MAX_CANDIDATES:]:
        if i <= consumed or log.is_frame(i) or log.is_code(i):
            continue
        if "names" in first:
            after_names += 1
            if after_names > _RUNNER_UP_LINES:
                break
        text, end = log.logical(i)
        consumed = end
        finding = _line_finding(log, i, text, end, hits, hand_rules)
        if finding is None:
            continue
        frames = finding.rule.origin == "frames" and finding.rule.strength == "names"
        first.setdefault("frames" if frames else finding.rule.strength, finding)
        found_all.append(finding)
    chosen = next((first[s] for s in _STRENGTHS if s in first), None)
    if chosen is None:
        return None, None
    other = next((f for f in found_all if f.rule.cause is not chosen.rule.cause and f.rule.strength == "names"), None)
    return chosen, other


_PORT_RULE = next(r for r in RULES if r.name == "port")
_SIGKILL_RULE = next(r for r in RULES if r.name == "sigkill")
_SIGKILLED = re.compile(r"(?:exit ?code|return ?code|terminated with)[:= ]{0,3}-9\b|signal 9\b", re.IGNORECASE)
_BIND_FAILED = ("error while attempting to bind",)
_HTTP_BOUND = ("uvicorn running on",)


def _bind_failure_before_ready(log: _Log) -> _Finding | None:
    """The HTTP server's failed bind just before the last ready line, when nothing after that
    line names a cause: the ready line then came from the warm-up request reaching whatever
    else holds the port (uvicorn says "Uvicorn running on" only once it has bound)."""
    if log.crash_start <= 0:
        return None
    start = max(0, log.crash_start - _BACK_WINDOW)
    failed = [i for i in log.find_lines(_BIND_FAILED, start, last=4) if i < log.crash_start]
    if not failed:
        return None
    index = failed[-1]
    if log.find_lines(_HTTP_BOUND, index, last=1) and log.find_lines(_HTTP_BOUND, index, last=1)[0] < log.crash_start:
        return None
    _, end = log.logical(index)
    return _Finding(_PORT_RULE, index, end, index)


def _phase_at(
    log: _Log, finding_lines: list[int], index: int, given: Phase | None
) -> tuple[Phase | None, str | None, str]:
    """Phase, startup stage ("weights", "pool", "capture" or None) and what says so.

    In order: a daemon that saw the server serve; the frames of the failure report
    (start-up frames win: they are the outer ones); the last progress line before the
    error; progress lines anywhere in the log (serving lines mean serving; start-up markers
    without a ready line mean start-up); the phase the daemon saw; else unknown.
    """
    if given is Phase.SERVING:
        return Phase.SERVING, None, "daemon"
    report = "".join(log.low(i) + "\n" for i in finding_lines)
    progress = log.nearest_progress(index)
    startup_kw = next((k for k in (*_CAPTURE_FRAMES, *_WEIGHTS_FRAMES, *_STARTUP_FRAMES) if k in report), None)
    if startup_kw is not None:
        source = f"frames: {startup_kw.strip(' =(.')}"
        if any(k in report for k in _CAPTURE_FRAMES):
            return Phase.STARTING, "capture", source
        if any(k in report for k in _WEIGHTS_FRAMES):
            return Phase.STARTING, "weights", source
        stage = progress[0][1] if progress and progress[0][0] is Phase.STARTING else None
        return Phase.STARTING, stage, source
    serving_kw = next((k for k in _SERVING_FRAMES if k in report), None)
    if serving_kw is not None:
        return Phase.SERVING, None, f"frames: {serving_kw}"
    if progress is not None:
        (phase, stage), marker = progress
        return phase, stage, f"markers: last progress line before the error is {marker!r}"
    anywhere = log.progress_anywhere()
    if anywhere is not None:
        (phase, stage), marker = anywhere
        if phase is Phase.SERVING:
            return phase, None, f"markers: {marker!r} in the log"
        return phase, stage, f"markers: {marker!r}, no ready line"
    if given is Phase.STARTING:
        return Phase.STARTING, None, "daemon"
    return None, None, "unknown"


# The functions that print a message say when it can be printed: the catalogue records each
# message's function ("... logger.error in _launch_subprocesses").
_STARTUP_FUNCS = frozenset({"launch", "ready", "init", "initialize", "load", "capture", "warmup", "profile", "dummy",
                            "allocate", "configure", "startup", "subprocesses"})
_SERVING_FUNCS = frozenset({"event", "forward", "batch", "generate", "decode", "prefill", "step", "busy", "serve"})
_ORIGIN_FUNC = re.compile(r" in (\w+)$")
_PRINTER_LINES = 400  # lines of the crash read for a message printed by start-up or serving code only


def _phase_by_printer(log: _Log) -> tuple[Phase, str] | None:
    """The phase the crash's own messages say by the code that prints them: a message of
    the stack printed only by start-up code (SGLang's "Rank <*> scheduler is dead", logged
    while waiting for the schedulers to be ready) means the server never came up."""
    seen: set[Phase] = set()
    said = ""
    for i in range(log.crash_start, min(log.count, log.crash_start + _PRINTER_LINES)):
        if log.is_frame(i) or log.is_code(i) or not log.low(i).strip():
            continue
        found = _catalogue.catalogue().matches(_strip_prefix(log.text(i)))
        primary = _catalogue.catalogue().primary(found)
        m = _ORIGIN_FUNC.search(primary.entry.origin) if primary is not None else None
        if m is None or primary is None:
            continue
        func = m.group(1).lower()
        if func.startswith("__"):
            continue  # a constructor or a dunder runs in any phase
        words = set(func.strip("_").split("_"))
        phase = (Phase.STARTING if words & _STARTUP_FUNCS
                 else Phase.SERVING if words & _SERVING_FUNCS else None)
        if phase is not None:
            seen.add(phase)
            said = said or f"catalogue: {primary.entry.head[:60]!r} is printed by {m.group(1)} ({phase} code)"
    return (seen.pop(), said) if len(seen) == 1 else None


def _evidence(log: _Log, lines: list[int], support: int | None = None) -> tuple[str, ...]:
    """The error's lines in order, then the line that supports reading it that way."""
    order = sorted(set(lines))
    if support is not None and support not in order:
        order.append(support)
    return tuple(log.text(i).strip()[:MAX_EVIDENCE_CHARS] for i in order)


_PHASE_DEPENDENT = frozenset({Cause.CUDA_OOM_RUNTIME, Cause.CUDA_OOM_STARTUP, Cause.KV_POOL_TOO_SMALL})
_MIN_FRACTION = re.compile(r"raise --mem-fraction-static above ([0-9]{1,3}(?:\.[0-9]{1,6})?)", re.IGNORECASE)
_KILLED_WHO = re.compile(r"Subprocess (\S{1,80}) \(pid=\d{1,10}\)|Rank (\d{1,5}) scheduler|(\w{1,80}) exited with"
                         r"|(Scheduler) or DataParallelController \d{1,10} terminated")


def _killed_summary(log: _Log, f: _Finding) -> str:
    """The line a hint adds to the evidence: what it shows and what it does not."""
    if f.rule.name == "enomem":
        return "ENOMEM from an allocation, no OOM-killer record and no out-of-memory error: not evidence of host OOM"
    if f.rule.name == "ray_worker_died":
        return "worker died; Ray lists the OOM killer among possible causes, no OOM-killer record"
    m = _KILLED_WHO.search(log.text(f.index))
    who = None
    if m:
        who = m.group(1) or (f"rank {m.group(2)} scheduler" if m.group(2) else m.group(3) or "a scheduler")
    return f"{who or 'a server process'} killed by SIGKILL, no OOM-killer record"


def _from_finding(log: _Log, f: _Finding, other: _Finding | None, given: Phase | None) -> Diagnosis:
    rule = f.rule
    phase, stage, source = _phase_at(log, log.report_lines(f.index, f.end), f.index, given)
    if phase is None and rule.usual_phase is not None and rule.phase_in_text:
        phase, source = rule.usual_phase, f"evidence: this message is printed only while {rule.usual_phase}"
    if phase is None:
        printed = _phase_by_printer(log)
        if printed is not None:
            phase, source = printed
    phase_known = phase is not None
    phase = phase or rule.usual_phase or Phase.STARTING
    cause, override = rule.cause, rule.remedy
    if rule.phased:
        cause = Cause.CUDA_OOM_RUNTIME if phase is Phase.SERVING else Cause.CUDA_OOM_STARTUP
        if cause is Cause.CUDA_OOM_STARTUP and stage in _CLEAR_GPU_STAGES:
            override = Remedy.CLEAR_GPU  # the weights/pool did not fit: a lower fraction won't help
    if cause is Cause.KV_POOL_TOO_SMALL and phase is Phase.SERVING:
        override = Remedy.RESTART  # pool exhausted by load: a higher fraction costs activations
    # Certain: the evidence is a message of the stack's own code (a catalogue entry, or a rule
    # citing the line that prints it) that names the cause, and the phase is known where the
    # remedy depends on it. A frames reading, a corpus-only rule or a hint never is.
    certain = rule.strength == "names" and f.cited and (phase_known or cause not in _PHASE_DEPENDENT)
    runner_up = rule.runner_up
    if not certain:
        if rule.phased:
            runner_up = Cause.CUDA_OOM_RUNTIME if cause is Cause.CUDA_OOM_STARTUP else Cause.CUDA_OOM_STARTUP
            override = Remedy.FRACTION_DOWN  # either phase: one rung down is the least harm
        elif cause in _MEMORY_CAUSES:
            override = Remedy.RESTART  # never raise the fraction or halve the host cache on a guess
        if runner_up is None and other is not None:
            runner_up = other.rule.cause
    exc = log.exception_near(f.index)
    header = exc[2] if exc else f.index
    text, _ = log.logical(f.index)
    m = _MIN_FRACTION.search(text) if cause is Cause.KV_POOL_TOO_SMALL else None
    evidence = _evidence(log, [header, *range(f.index, f.end + 1)], f.support)
    if rule.strength == "hint":
        evidence = (*evidence, _killed_summary(log, f))
    if rule.origin == "frames":
        evidence = (*evidence, f"read by the code that raised it: {f.basis.removeprefix('frames: ')}")
    if not phase_known:
        source = f"unknown (assumed {phase}, the usual phase of this error)"
    return Diagnosis(
        cause=cause,
        phase=phase,
        evidence=evidence,
        evidence_lineno=log.lineno(header),
        exc_type=exc[0] if exc else None,
        exc_message=(exc[1][:MAX_EVIDENCE_CHARS] or None) if exc else None,
        location=log.location(header) if exc else None,
        rank=log.rank_near(f.index),
        remedy_override=override if (override is not cause.remedy or not certain) else None,
        min_fraction=float(m.group(1)) if m else None,
        certain=certain,
        phase_source=source,
        runner_up=runner_up if runner_up is not cause else None,
        basis=f.basis,
        unrecognised=None if certain and cause is not Cause.OTHER else _catalogue.normalise(log.text(header).strip())[:300],
    )


_MEMORY_CAUSES = frozenset({*_PHASE_DEPENDENT, Cause.HOST_OOM})


def _other(log: _Log, given: Phase | None, exit_status: ExitStatus | None) -> Diagnosis:
    """No rule matched: report the first exception of the crash, if any, as ``other``."""
    start = max(log.crash_start, log.count - _OTHER_SCAN_LINES)
    cause = Cause.OTHER
    if exit_status is not None and exit_status.code == 2:  # argparse's exit code
        usage = log.find_lines(("usage:",), start, last=1)
        if usage:
            cause = Cause.CONFIG_ERROR
            return Diagnosis(
                cause, given or Phase.STARTING, _evidence(log, usage[:1]), log.lineno(usage[0]),
                phase_source="daemon" if given else "evidence: argparse exits before start-up",
            )
    killed = exit_status is not None and exit_status.signal == 9
    sigkill = ("main process killed by SIGKILL, no OOM-killer record",) if killed else ()
    for i in range(start, log.count):
        exc = log.exception(i)
        if exc is None or log.is_code(i) or any(g in log.low(i) for g in _GENERIC):
            continue
        _, end = log.logical(i)
        phase, _, source = _phase_at(log, log.report_lines(i, end), i, given)
        return Diagnosis(
            cause=cause,
            phase=phase or Phase.STARTING,
            evidence=(*_evidence(log, list(range(i, end + 1))), *sigkill),
            evidence_lineno=log.lineno(i),
            exc_type=exc[0],
            exc_message=exc[1][:MAX_EVIDENCE_CHARS] or None,
            location=log.location(i),
            rank=log.rank_near(i),
            certain=False,
            phase_source=source if phase else "unknown (assumed starting)",
            runner_up=Cause.HOST_OOM if killed else None,
            unrecognised=_catalogue.normalise(log.text(i).strip())[:300],
        )
    phase, _, source = _phase_at(log, log.report_lines(log.count - 1, log.count - 1), log.count - 1, given)
    return Diagnosis(
        cause=cause,
        phase=phase or Phase.STARTING,
        evidence=sigkill,
        certain=False,
        phase_source=source if phase else "unknown (assumed starting)",
        runner_up=Cause.HOST_OOM if killed else None,
    )


_KERNEL_KILL = re.compile(r"Kill(?:ed)? process (\d{1,10})|oom-kill:[^\n]{0,400}?\bpid=(\d{1,10})", re.IGNORECASE)


def kernel_oom_line(kernel_log: str | None, pids: Collection[int]) -> str | None:
    """The first kernel OOM-killer line that names one of ``pids``."""
    if not kernel_log or not pids:
        return None
    wanted = {int(p) for p in pids}
    for line in tail_text(kernel_log).splitlines():
        low = line.lower()
        if "out of memory" not in low and "oom" not in low:
            continue
        for m in _KERNEL_KILL.finditer(line[:MAX_LINE_CHARS]):
            if int(m.group(1) or m.group(2)) in wanted:
                return line.strip()[:MAX_EVIDENCE_CHARS]
    return None


_OOM_KILL_LINE = re.compile(r"^oom_kill (\d{1,18})\s*$", re.MULTILINE)


def read_oom_kill_count(memory_events_text: str) -> int | None:
    """The ``oom_kill`` count of a cgroup v2 ``memory.events`` file's text, or None.

    ``memory.events`` holds ``low``, ``high``, ``max``, ``oom``, ``oom_kill`` and
    ``oom_group_kill`` lines of ``name count``; ``oom_kill`` counts the processes the
    kernel's OOM killer killed in the cgroup. None when the text has no such line.
    """
    if not isinstance(memory_events_text, str):
        return None
    m = _OOM_KILL_LINE.search(memory_events_text)
    return int(m.group(1)) if m else None


def _diagnose(
    tail: bytes | str,
    exit_status: ExitStatus | None,
    phase: Phase | None,
    kernel_log: str | None,
    pids: Collection[int],
    oom_kill_delta: int | None,
    ready_at: int | None = None,
    site_rules: Sequence[SiteRule] = (),
    hand_rules: bool = True,
) -> Diagnosis:
    log = _Log(tail_text(tail), lines_after_ready=_lines_after(tail, ready_at))
    if site_rules:
        taught = _site_reading(log, site_rules, phase)
        if taught is not None:
            return taught
    finding, other = _find(log, hand_rules)
    if finding is None or finding.rule.strength != "names":
        finding = _bind_failure_before_ready(log) or finding
    killed = _killed_quietly(log, exit_status) if finding is None or finding.rule.strength == "echo" else None
    if killed is not None:
        diagnosis = killed
    else:
        diagnosis = _from_finding(log, finding, other, phase) if finding else _other(log, phase, exit_status)
    record = kernel_oom_line(kernel_log, pids)
    if record is None and oom_kill_delta is not None and oom_kill_delta > 0:
        record = f"cgroup memory.events: oom_kill +{oom_kill_delta} while the server ran"
    if record and diagnosis.cause in _CONSEQUENTIAL:
        return replace(
            diagnosis,
            cause=Cause.HOST_OOM,
            evidence=(record, *(e for e in diagnosis.evidence if "no OOM-killer record" not in e)),
            evidence_lineno=diagnosis.evidence_lineno if diagnosis.evidence else None,
            remedy_override=None,
            certain=True,
            runner_up=diagnosis.cause if diagnosis.cause is not Cause.OTHER else None,
            min_fraction=None,
        )
    return diagnosis


# Lines that say the server failed, though they name nothing: after one of them, a death by a
# signal is SGLang's own teardown (it SIGKILLs its tree), not a kill from outside.
_FAILURE_MARKS = (*_GENERIC, "traceback (most recent call last)", "kill_process_tree", "crashed", "died",
                  "terminated with", "exit code")


def _killed_quietly(log: _Log, exit_status: ExitStatus | None) -> Diagnosis | None:
    """A main process killed by a signal with nothing logged since it was last ready but
    serving lines (or a peer's echo): a local death of this rank, by that signal."""
    if exit_status is None or exit_status.signal is None or log.ready_index is None:
        return None
    start = log.crash_start
    if log.find_lines(_FAILURE_MARKS, start, last=1):
        return None
    if any(log.exception(i) is not None for i in range(start, log.count)):
        return None
    name = exit_status.describe().removeprefix("killed by ")
    return Diagnosis(
        cause=Cause.OTHER,
        phase=Phase.SERVING,
        evidence=(f"main process killed by {name} after it was ready; no error was logged since",),
        certain=False,
        phase_source="daemon: it was ready" if log.ready_index else "markers: a ready line before the end",
        runner_up=Cause.HOST_OOM if exit_status.signal == 9 else None,
        basis="signal",
        killed=name,
    )


def _site_reading(log: _Log, rules: Sequence[SiteRule], given: Phase | None) -> Diagnosis | None:
    """The first line of the crash (log order) that a site rule matches, read as that rule
    says: its cause, its phase (else the phase read as usual), certain only if it says so."""
    compiled = [(n, rule, re.compile(rule.match, re.IGNORECASE)) for n, rule in enumerate(rules, 1)]
    for i in range(log.crash_start, log.count):
        if log.is_frame(i) or log.is_code(i):
            continue
        text = log.text(i)
        for n, rule, rx in compiled:
            if rx.search(text) is None:
                continue
            _, end = log.logical(i)
            phase, _, source = _phase_at(log, log.report_lines(i, end), i, given)
            if rule.phase is not None:
                phase, source = rule.phase, f"site rule {n}"
            exc = log.exception_near(i)
            header = exc[2] if exc else i
            return Diagnosis(
                cause=rule.cause,
                phase=phase or Phase.STARTING,
                evidence=_evidence(log, [header, *range(i, end + 1)]),
                evidence_lineno=log.lineno(header),
                exc_type=exc[0] if exc else None,
                exc_message=(exc[1][:MAX_EVIDENCE_CHARS] or None) if exc else None,
                location=log.location(header) if exc else None,
                rank=log.rank_near(i),
                certain=rule.certain,
                phase_source=source if phase else "unknown (assumed starting)",
                basis=f"site rule {n}: {rule.match[:120]}",
            )
    return None


def _lines_after(tail: bytes | str, ready_at: int | None) -> int | None:
    """How many line ends the tail holds from ``ready_at`` (a byte offset; a character
    offset for text) on: the lines logged since the server was last ready."""
    if ready_at is None:
        return None
    rest = tail[max(0, ready_at):]
    return rest.count(b"\n") if isinstance(rest, bytes | bytearray | memoryview) else str(rest).count("\n")


def diagnose(
    tail: bytes | str,
    *,
    exit_status: ExitStatus | None = None,
    phase: Phase | None = Phase.STARTING,
    kernel_log: str | None = None,
    pids: Collection[int] = (),
    oom_kill_delta: int | None = None,
    ready_at: int | None = None,
    site_rules: Sequence[SiteRule] = (),
    hand_rules: bool = True,
) -> Diagnosis:
    """Why the server died, from the tail of its output.

    ``phase`` is what the daemon saw (SERVING once /health answered 200); ``None`` means
    unknown (``explain`` on a file) and lets the log alone decide. ``kernel_log`` is kernel
    messages text; its OOM-killer lines count only for pids in ``pids`` (the server's tree).
    ``oom_kill_delta`` is how many ``oom_kill`` events the service cgroup's ``memory.events``
    counted while this server ran (None: unknown); a positive one is an OOM-killer record.
    ``ready_at`` is where in ``tail`` (a byte offset) the server was last ready, when the
    daemon saw it ready: what was logged before it did not kill the server while serving.
    ``site_rules`` (``[[diagnosis.rule]]``) are tried first, on every line of the crash.
    ``hand_rules=False`` reads with the catalogue and the frames alone (the rules written
    from logs switched off): how it does on words it was never shown.
    ``evidence_lineno`` is 1-based within the tail that was read. Never raises.
    """
    try:
        return _diagnose(tail, exit_status, phase, kernel_log, pids, oom_kill_delta, ready_at, site_rules, hand_rules)
    except Exception as exc:  # the daemon needs an answer whatever the bytes say
        return Diagnosis(
            cause=Cause.OTHER,
            phase=phase if isinstance(phase, Phase) else Phase.STARTING,
            exc_type=INTERNAL_ERROR_TYPE,
            exc_message=f"{type(exc).__name__}: {exc}"[:MAX_EVIDENCE_CHARS],
            certain=False,
            phase_source="daemon" if isinstance(phase, Phase) else "unknown",
        )


# --------------------------------------------------------------------------- what happens next


def describe_action(d: Diagnosis, *, fraction: float | None = None) -> str:
    """One sentence: what the supervisor does about this crash, and why."""
    now = f" from {fraction:.2f}" if fraction is not None else ""
    remedy, cause = d.remedy, d.cause
    if remedy is Remedy.FRACTION_DOWN:
        return (
            f"Lower --mem-fraction-static{now} to the next rung down and restart, because {cause.summary} "
            "means activations or CUDA graphs did not fit outside the static pool."
        )
    if remedy is Remedy.FRACTION_UP:
        return (
            f"Raise --mem-fraction-static{now} one rung (never to a fraction that ran out of memory while "
            f"serving) and restart, because {cause.summary} means the KV pool did not fit after the weights; "
            "lowering it would make this worse."
        )
    if remedy is Remedy.HICACHE_DOWN:
        return f"Halve --hicache-size and restart, because {cause.summary} killed or refused the server."
    if remedy is Remedy.CLEAR_GPU:
        if cause is Cause.PORT_IN_USE:
            return "Kill whatever holds the port, then restart, because the server could not bind it."
        return (
            f"Kill whatever still holds the GPU (orphaned schedulers, other processes) and restart with the "
            f"same fraction{now}, because the weights or KV pool did not fit; a lower fraction would not help."
        )
    if remedy is Remedy.GIVE_UP:
        return f"Give up and alert a human, because {cause.summary} is not something a restart can fix."
    if cause is Cause.KV_POOL_TOO_SMALL:
        return (
            "Restart with backoff, keeping the fraction, because the KV/request pool ran out under load; "
            "lowering the fraction would make it worse (consider a lower --max-running-requests)."
        )
    return f"Restart with backoff, because {cause.summary} is often transient; give up if it keeps happening."
