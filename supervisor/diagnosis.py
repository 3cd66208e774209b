"""Crash diagnosis: read a dead SGLang server's log the way an experienced engineer does.

Pure: no I/O, no clock, no asyncio. ``diagnose`` takes the tail of the server's output (and,
when the daemon has them, the exit status, the phase it saw and kernel OOM-killer lines)
and returns a ``model.Diagnosis``: the cause, the evidence line(s) and their line number,
the exception, the innermost frame, the rank and the phase.

How it reads a log (``../shared/sglang-facts.md`` says why each rule holds):

- The cause is the **first specific error** in the crash, not the last line. Generic lines
  (``Scheduler hit an exception``, ``SIGQUIT received``, ``Received sigquit``, ``Killed``,
  ``EngineDeadError``, ``output_handler failed``...) match no rule and so carry no cause.
- A line is a candidate when it holds one of a rule's needles (cheap substring search over
  the lowered tail); the rule's linear regex and context check then confirm it. Within
  one line, rules are tried in a fixed precedence: hardware, host memory, KV pool, CUDA
  OOM, specific CUDA faults, port, NCCL, other CUDA errors, watchdog, model, config. So a
  wrapper's message (``Capture cuda graph failed: <real error>``, ``MQEngineDeadError ...
  OutOfMemoryError(...)``) is read for the real error it holds.
- Source lines shown in tracebacks are not evidence (``raise RuntimeError(f"NCCL error...``
  is code, not an error); frame lines are not either.
- Startup vs serving comes from the failure report around the evidence (init, weight
  loading, KV-pool, CUDA-graph capture and profiling frames mean startup; forward/batch/
  engine-loop frames mean serving; startup frames win because they are the outer ones),
  then from the nearest progress line before it (``Load weight``, ``Capture cuda graph``,
  vs ``Prefill batch``, HTTP request lines, ``ready to roll``), then from the phase the
  daemon saw. A daemon that saw the server serve is believed outright.
- Errors before the last ``ready to roll`` line, or followed by many batch lines, did not
  kill the server and are not the cause.
- A kernel OOM-killer line for one of the server's pids (``kernel_log``) makes it host OOM
  unless the log names a specific non-consequential cause.

Only the last ``MAX_TAIL_BYTES`` of the input are read; no regex can backtrack beyond a
fixed bound; ``diagnose`` never raises.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Collection
from dataclasses import dataclass
from itertools import accumulate

from supervisor.model import Cause, Diagnosis, ExitStatus, Phase, Remedy
from supervisor.startup_facts import line_rank

MAX_TAIL_BYTES = 4 * 1024 * 1024  # how much of the end of the output is read
MAX_LINE_CHARS = 4096  # longer lines are read up to this many characters
MAX_LINES = 200_000  # lines read, the last ones of the tail
MAX_CANDIDATES = 2000  # candidate lines examined, the last ones of the tail
MAX_EVIDENCE_CHARS = 500  # each evidence line is cut to this length
KEPT_SERVING_BATCHES = 200  # batch lines after an error that prove the server outlived it
INTERNAL_ERROR_TYPE = "supervisor.diagnosis.InternalError"  # exc_type when diagnosis itself failed

_BACK_WINDOW = 150  # lines scanned up from the evidence for its traceback
_AFTER_WINDOW = 40  # lines scanned down from it for the rest of the failure report
_OTHER_SCAN_LINES = 5000  # lines scanned for an exception line when no rule matched


# --------------------------------------------------------------------------- line shapes

_PREFIX = re.compile(
    r"[\s|`'\">]+"  # indentation, CI-view "  | ", quotes, markdown backticks
    r"|(?:#033|\x1b)\[[0-9;]{0,20}m"  # ANSI colour, raw or syslog-escaped
    r"|\[[^\]\n]{0,100}\]:?"  # "[2025-08-02 19:24:30 TP3]", "[rank0]:"
    r"|\([\w.-]{1,60}(?: pid=\d{1,10})?(?:, ip=[\d.]{1,40})?\)"  # "(WorkerDict pid=1)"
    r"|[\w.-]{1,40} {1,8}\|"  # docker compose "sglang-1  |"
    r"|\d{4}-\d\d-\d\d[T ][\d:.,]{5,20}Z?"  # "2025-04-06T07:44:23.51Z", "2024-12-19 21:40:35"
    r"|(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?: \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,6})?)?"
    r"(?: \d{1,10})? \[?[\w.-]{1,60}:\d{1,6}\]"  # vLLM "ERROR 03-23 21:43:38 [worker.py:620]"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):"  # uvicorn "ERROR:    "
    r"|kernel:"
)
_EXC = re.compile(r"([A-Za-z_]\w{0,100}(?:\.[A-Za-z_]\w{0,100}){0,8})(?::(?: (.*))?$|\((.*)$)")
_EXC_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Failure", "Fault")
_FRAME = re.compile(r'File "([^"\n]{1,500})", line (\d{1,7}), in ([\w<>.-]{1,200})')
_TRACEBACK = "traceback (most recent call last)"
_DIGITS = re.compile(r"\d+")
_CARETS = re.compile(r"[\^~\s]+")  # the markers under a source line (Python >= 3.11)
# An exception message that continues on the next lines (NCCL names the CUDA failure there).
_DETAILS_FOLLOW = ("unhandled cuda error", "last error:")


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
    if not name.rsplit(".", 1)[-1].endswith(_EXC_SUFFIXES):
        return None
    if m.group(3) is not None:  # vLLM's repr form: OutOfMemoryError('CUDA out of memory...')
        message = m.group(3).rstrip(")").strip("'\"")
    else:
        message = (m.group(2) or "").strip()
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


_CUDA_ERROR_PATTERN = _ci(
    r"\bcuda (?:driver |runtime )?error(?!s)|cudaError|CUDA_ERROR_|CUBLAS_STATUS_|CUDNN_STATUS_"
    r"|AcceleratorError|Cuda failure|Triton Error \[CUDA\]"
)

RULES: tuple[_Rule, ...] = (
    # -- the GPU itself: a restart cannot fix it
    _Rule("xid", Cause.GPU_HW_ERROR, ("xid",), context=_hw_xid),
    _Rule(
        "gpu_lost",
        Cause.GPU_HW_ERROR,
        (
            "fallen off the bus", "gpu is lost", "gpu_is_lost", "uncorrectable ecc", "ecc error",
            "system not yet initialized", "cudaerrorsystemnotready", "busy or unavailable",
            "cudaerrordevicesunavailable", "no cuda-capable device", "no cuda gpus are available",
            "rminitadapter failed", "unable to determine the device handle", "found no nvidia driver",
        ),
    ),
    # -- host memory (checked before CUDA OOM: Ray's OutOfMemoryError is about host RAM)
    _Rule(
        "pinned_host",
        Cause.HOST_OOM,
        ("invalid argument", "out of memory"),
        pattern=_CUDA_ERROR_PATTERN,
        context=_pinned_host_context,
    ),
    _Rule(
        "host_memory",
        Cause.HOST_OOM,
        (
            "not enough host memory", "running low on memory", "killed due to memory pressure",
            "cannot allocate memory", "can't allocate memory", "std::bad_alloc",
            "insufficient shared memory", "bus error", "sigbus", "oom-kill", "invoked oom-killer",
        ),
    ),
    _Rule("kernel_oom", Cause.HOST_OOM, ("killed process", "kill process"), pattern=_ci(r"out of memory|\boom\b")),
    _Rule("python_memoryerror", Cause.HOST_OOM, ("memoryerror",), pattern=re.compile(r"(?<![\w.])MemoryError\b")),
    _Rule(
        "sigkill",
        Cause.HOST_OOM,
        ("exit code", "exitcode", "return code", "returncode", "signal 9"),
        pattern=_ci(r"(?:exit ?code|return ?code)[:= ]{0,3}-9\b|killed by signal 9\b|signal 9 \(SIGKILL\)"),
        context=_before_sigquit,
    ),
    # -- the KV / request-slot pool: raise the fraction at startup, never lower it
    _Rule(
        "kv_pool_startup",
        Cause.KV_POOL_TOO_SMALL,
        (
            "increase --mem-fraction-static", "larger than the profiled value",
            "no available memory for the cache blocks",
            "maximum number of tokens that can be stored in kv cache",
            "larger than the available kv cache memory",
        ),
        usual_phase=Phase.STARTING,
    ),
    _Rule(
        "kv_pool_exhausted",  # raised only by the scheduler's batch loop
        Cause.KV_POOL_TOO_SMALL,
        (
            "alloc_req_slots runs out of memory", "runs out of memory. please set a smaller number",
            "prefill out of memory", "decode out of memory", "out of memory. try to lower your batch size",
        ),
        usual_phase=Phase.SERVING,
    ),
    # -- another process holds part of the GPU: clear it
    _Rule(
        "unbalanced",
        Cause.CUDA_OOM_STARTUP,
        ("memory capacity is unbalanced",),
        remedy=Remedy.CLEAR_GPU,
    ),
    # -- CUDA OOM: runtime or startup by phase
    _Rule(
        "cuda_oom",
        Cause.CUDA_OOM_RUNTIME,
        (
            "cuda out of memory", "cuda error: out of memory", "cuda driver error: out of memory",
            "cuda failure 'out of memory'", "torch.outofmemoryerror", "torch.cuda.outofmemoryerror",
            "hip out of memory", "npu out of memory", "xpu out of memory", "mps backend out of memory",
            "cublas_status_alloc_failed", "cudaerrormemoryallocation", "resource_exhausted: out of memory",
        ),
        phased=True,
        usual_phase=Phase.SERVING,  # startup OOMs come with init frames or progress lines
    ),
    _Rule(  # "CUDA error (/path/kernel.h:188): out of memory"
        "cuda_oom_at",
        Cause.CUDA_OOM_RUNTIME,
        ("out of memory",),
        pattern=_ci(r"cuda error \([^)\n]{1,300}\): out of memory"),
        phased=True,
        usual_phase=Phase.SERVING,
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
    ),
    _Rule(
        "cuda_fault",
        Cause.CUDA_ERROR,
        (
            "illegal memory access", "device-side assert triggered", "illegal instruction was encountered",
            "misaligned address", "unspecified launch failure", "cudaerrorillegaladdress",
            "cuda_error_illegal_address",
        ),
    ),
    # -- a port someone else holds (HTTP, dist-init, ZMQ)
    _Rule("port", Cause.PORT_IN_USE, ("address already in use", "eaddrinuse", "errno 98", "address in use")),
    _Rule("port_taken", Cause.PORT_IN_USE, ("already in use",), pattern=_ci(r"\bport\b[^\n]{0,60}?already in use")),
    # -- NCCL / distributed communication (a collective timeout too: it is NCCL's watchdog)
    _Rule(
        "nccl",
        Cause.NCCL_ERROR,
        (
            "nccl error", "ncclinternalerror", "ncclsystemerror", "ncclunhandledcudaerror",
            "ncclremoteerror", "ncclinvalidusage", "collective operation timeout",
            "process group watchdog", "distbackenderror", "distnetworkerror", "nccl communicator",
        ),
    ),
    _Rule(  # torch's NCCL watchdog; its warnings ("using GPU 0 to perform barrier") do not count
        "nccl_timeout",
        Cause.NCCL_ERROR,
        ("processgroupnccl",),
        pattern=_ci(
            r"checktimeout|detected by watchdog|failed or timed out|taking the entire process down|was aborted"
        ),
    ),
    # gloo failures (its transport or mesh setup), not "[Gloo] Rank 0 is connected to 7 peer ranks"
    _Rule("gloo", Cause.NCCL_ERROR, ("gloo/transport/", "connectfullmesh failed")),
    # -- any other CUDA error
    _Rule(
        "cuda_error",
        Cause.CUDA_ERROR,
        ("cuda error", "cuda driver error", "cuda runtime error", "cudaerror", "cuda_error_", "cublas_status_",
         "cudnn_status_", "acceleratorerror", "cuda failure", "triton error [cuda]"),
        pattern=_CUDA_ERROR_PATTERN,
    ),
    # -- SGLang's own scheduler watchdog (not NCCL's, matched above)
    _Rule(
        "watchdog",
        Cause.WATCHDOG_HANG,
        ("(self.watchdog_timeout=", "scheduler watchdog timeout", "scheduler debug info:"),
        usual_phase=Phase.SERVING,  # it fires only with a batch in flight
    ),
    # -- the model cannot be loaded
    _Rule(
        "model_files",
        Cause.MODEL_LOAD_ERROR,
        (
            "are not supported for now", "is not supported for now", "does not recognize this architecture",
            "unrecognized model in", "failed to be inspected", "safetensorerror",
            "error while deserializing header", "headertoolarge", "metadataincompletebuffer",
            "incomplete metadata", "does not appear to have a file named", "is not a valid model identifier",
            "repository not found", "gatedrepoerror", "can't load the configuration", "can't load tokenizer",
            "error(s) in loading state_dict", "size mismatch for", "unrecognized configuration class",
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
    ),
    _Rule(  # a checkpoint that does not match the model code
        "loader_mismatch",
        Cause.MODEL_LOAD_ERROR,
        ("keyerror", "assertionerror"),
        pattern=re.compile(r"(?<![\w.])(?:KeyError|AssertionError)\b"),
        context=_loader_context,
    ),
    # -- the server's arguments (argparse, or an exception that names a flag or a constraint)
    _Rule(
        "argparse",
        Cause.CONFIG_ERROR,
        ("error: unrecognized arguments", "error: argument", "error: ambiguous option",
         "error: the following arguments are required", "invalid choice:"),
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
        context=_raised,  # an exception, not a warning that mentions a limit
    ),
    _Rule(
        "flag_named",
        Cause.CONFIG_ERROR,
        ("valueerror", "assertionerror", "argumenterror", "argumenttypeerror"),
        pattern=re.compile(r"(?<![\w-])--[a-z][a-z0-9-]{1,60}"),
        context=_raised_by(("ValueError", "AssertionError", "ArgumentError", "ArgumentTypeError")),
    ),
)
_NEEDLES: tuple[str, ...] = tuple(dict.fromkeys(n for rule in RULES for n in rule.needles))

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
    "profile_run", "_dummy_run", "determine_num_available_blocks", "determine_available_memory",
    "initialize_kv_cache",
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
    "process_batch_result", "get_next_batch_to_run", "get_model_worker_batch",
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


class _Log:
    """A log tail split into lines, with substring search over its lowered text.

    The crash is searched for only after the last line that proves the server outlived
    everything before it: the last ``ready to roll``, or the batch line that has
    ``KEPT_SERVING_BATCHES - 1`` more after it. In a long serving log that is a short
    stretch at the end, so the rule needles scan little text.
    """

    def __init__(self, text: str) -> None:
        parts = text.rsplit("\n", MAX_LINES)
        self.skipped = 0  # lines dropped from the front (beyond MAX_LINES)
        if len(parts) > MAX_LINES:
            self.skipped = parts[0].count("\n") + 1
            parts = parts[1:]
        self._lines = parts
        self._low_text = "\n".join(parts).lower()  # lower() never makes or takes a newline
        self._low_lines = self._low_text.split("\n")
        self._starts = list(accumulate((len(line) + 1 for line in self._low_lines), initial=0))
        self.count = len(parts)
        ready = self.last_line(("ready to roll",), self.count)
        outlived = self.nth_last_line(_BATCH_LINES, KEPT_SERVING_BATCHES)
        self.crash_start = max(ready, outlived) + 1  # where the crash can begin
        self.first_sigquit = self.first_line(("received sigquit", "sigquit received"), self.crash_start)

    def lineno(self, i: int) -> int:
        """1-based line number of line ``i`` in the text given."""
        return i + 1 + self.skipped

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
            if not (self.is_frame(i) or self.is_code(i) or _CARETS.fullmatch(_strip_prefix(self.text(i)))):
                break  # not part of a traceback
            found.append(i)
        return found

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

    def nearest_progress(self, i: int) -> tuple[Phase, str | None] | None:
        """The phase (and startup stage) the last progress line before ``i`` shows."""
        last_startup = self.last_line(tuple(_STARTUP_PROGRESS), i)
        last_serving = self.last_line(_SERVING_PROGRESS, i)
        if last_startup < 0 and last_serving < 0:
            return None
        if last_serving > last_startup:
            return Phase.SERVING, None
        low = self.low(last_startup)
        stage = next((st for key, st in _STARTUP_PROGRESS.items() if key in low), None)
        return Phase.STARTING, stage

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


def _find(log: _Log) -> _Finding | None:
    """The first specific error of the crash."""
    hits = log.find_needles(_NEEDLES, log.crash_start)
    consumed = -1
    for i in sorted(hits)[-MAX_CANDIDATES:]:
        if i <= consumed or log.is_frame(i) or log.is_code(i):
            continue
        text, end = log.logical(i)
        consumed = end
        found = set().union(*(hits.get(j, ()) for j in range(i, end + 1)))
        for rule in RULES:
            support = rule.matches(log, i, text, found)
            if support is not None:
                return _Finding(rule, i, end, support)
    return None


def _phase_at(log: _Log, finding_lines: list[int], index: int, given: Phase | None) -> tuple[Phase | None, str | None]:
    """Phase and startup stage ("weights", "pool", "capture" or None) of an error."""
    if given is Phase.SERVING:
        return Phase.SERVING, None
    report = "".join(log.low(i) + "\n" for i in finding_lines)
    progress = log.nearest_progress(index)
    if any(k in report for k in (*_WEIGHTS_FRAMES, *_CAPTURE_FRAMES, *_STARTUP_FRAMES)):
        if any(k in report for k in _CAPTURE_FRAMES):
            return Phase.STARTING, "capture"
        if any(k in report for k in _WEIGHTS_FRAMES):
            return Phase.STARTING, "weights"
        stage = progress[1] if progress and progress[0] is Phase.STARTING else None
        return Phase.STARTING, stage
    if any(k in report for k in _SERVING_FRAMES):
        return Phase.SERVING, None
    if progress is not None:
        return progress
    return given, None


def _evidence(log: _Log, lines: list[int], support: int | None = None) -> tuple[str, ...]:
    """The error's lines in order, then the line that supports reading it that way."""
    order = sorted(set(lines))
    if support is not None and support not in order:
        order.append(support)
    return tuple(log.text(i).strip()[:MAX_EVIDENCE_CHARS] for i in order)


def _from_finding(log: _Log, f: _Finding, given: Phase | None) -> Diagnosis:
    phase, stage = _phase_at(log, log.report_lines(f.index, f.end), f.index, given)
    phase = phase or f.rule.usual_phase or Phase.STARTING
    cause, override = f.rule.cause, f.rule.remedy
    if f.rule.phased:
        cause = Cause.CUDA_OOM_RUNTIME if phase is Phase.SERVING else Cause.CUDA_OOM_STARTUP
        if cause is Cause.CUDA_OOM_STARTUP and stage in _CLEAR_GPU_STAGES:
            override = Remedy.CLEAR_GPU  # the weights/pool did not fit: a lower fraction won't help
    if cause is Cause.KV_POOL_TOO_SMALL and phase is Phase.SERVING:
        override = Remedy.RESTART  # pool exhausted by load: a higher fraction costs activations
    exc = log.exception_near(f.index)
    header = exc[2] if exc else f.index
    return Diagnosis(
        cause=cause,
        phase=phase,
        evidence=_evidence(log, [header, *range(f.index, f.end + 1)], f.support),
        evidence_lineno=log.lineno(header),
        exc_type=exc[0] if exc else None,
        exc_message=(exc[1][:MAX_EVIDENCE_CHARS] or None) if exc else None,
        location=log.location(header) if exc else None,
        rank=log.rank_near(f.index),
        remedy_override=override if override is not cause.remedy else None,
    )


def _other(log: _Log, given: Phase | None, exit_status: ExitStatus | None) -> Diagnosis:
    """No rule matched: report the first exception of the crash, if any, as ``other``."""
    start = max(log.crash_start, log.count - _OTHER_SCAN_LINES)
    cause = Cause.OTHER
    if exit_status is not None and exit_status.code == 2:  # argparse's exit code
        usage = log.find_lines(("usage:",), start, last=1)
        if usage:
            cause = Cause.CONFIG_ERROR
            return Diagnosis(cause, given or Phase.STARTING, _evidence(log, usage[:1]), log.lineno(usage[0]))
    for i in range(start, log.count):
        exc = log.exception(i)
        if exc is None or log.is_code(i) or any(g in log.low(i) for g in _GENERIC):
            continue
        _, end = log.logical(i)
        phase, _ = _phase_at(log, log.report_lines(i, end), i, given)
        return Diagnosis(
            cause=cause,
            phase=phase or Phase.STARTING,
            evidence=_evidence(log, list(range(i, end + 1))),
            evidence_lineno=log.lineno(i),
            exc_type=exc[0],
            exc_message=exc[1][:MAX_EVIDENCE_CHARS] or None,
            location=log.location(i),
            rank=log.rank_near(i),
        )
    phase, _ = _phase_at(log, log.report_lines(log.count - 1, log.count - 1), log.count - 1, given)
    return Diagnosis(cause=cause, phase=phase or Phase.STARTING)


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


def _diagnose(
    tail: bytes | str,
    exit_status: ExitStatus | None,
    phase: Phase | None,
    kernel_log: str | None,
    pids: Collection[int],
) -> Diagnosis:
    log = _Log(tail_text(tail))
    finding = _find(log)
    diagnosis = _from_finding(log, finding, phase) if finding else _other(log, phase, exit_status)
    killed = kernel_oom_line(kernel_log, pids)
    if killed and diagnosis.cause in _CONSEQUENTIAL:
        return Diagnosis(cause=Cause.HOST_OOM, phase=diagnosis.phase, evidence=(killed,), rank=diagnosis.rank)
    return diagnosis


def diagnose(
    tail: bytes | str,
    *,
    exit_status: ExitStatus | None = None,
    phase: Phase | None = Phase.STARTING,
    kernel_log: str | None = None,
    pids: Collection[int] = (),
) -> Diagnosis:
    """Why the server died, from the tail of its output.

    ``phase`` is what the daemon saw (SERVING once /health answered 200); ``None`` means
    unknown (``explain`` on a file) and lets the log alone decide. ``kernel_log`` is kernel
    messages text; its OOM-killer lines count only for pids in ``pids`` (the server's tree).
    ``evidence_lineno`` is 1-based within the tail that was read. Never raises.
    """
    try:
        return _diagnose(tail, exit_status, phase, kernel_log, pids)
    except Exception as exc:  # the daemon needs an answer whatever the bytes say
        return Diagnosis(
            cause=Cause.OTHER,
            phase=phase if isinstance(phase, Phase) else Phase.STARTING,
            exc_type=INTERNAL_ERROR_TYPE,
            exc_message=f"{type(exc).__name__}: {exc}"[:MAX_EVIDENCE_CHARS],
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
