"""The families of the message catalogue, and the subsystems of the module table (issue 23).

A family is a cause the supervisor can act on; every message the stack can print gets exactly
one, decided here by a few general rules on what the message *is* -- its words, the exception
type, the module it is printed in (through the module table below) and the source it comes
from -- never by looking at crash logs. The rules run in the order of ``RULES``; the first that
holds decides. Why each family gets what it gets:

``kv_pool.startup``
    The KV/request-slot pool does not fit at start-up. SGLang says so in its own words ("Not
    enough memory. Please try to increase --mem-fraction-static", "leave no GPU memory for the
    KV cache"), vLLM in its ("No available memory for the cache blocks", "larger than the
    available KV cache memory"). Checked before any memory word: the remedy is the opposite of
    a CUDA OOM's (raise the static fraction), so these must never fall into ``cuda.memory``.
``kv_pool.exhausted``
    The pool runs out while serving ("Prefill out of memory", "Decode out of memory",
    "alloc_req_slots runs out of memory", "Out of memory even after retracting"): SGLang's
    scheduler, not the device allocator; also before the memory words.
``port.bind``
    The listening address is taken: "address already in use", asyncio's "error while attempting
    to bind on address", "port ... is in use". Checked early: strerror(EADDRINUSE) and the
    bind errors mention nothing else.
``host.memory``
    Host RAM, pinned and shared memory: "DefaultCPUAllocator: can't allocate memory",
    std::bad_alloc, pinned-memory and cudaHostAlloc failures, insufficient shared memory (shm,
    /dev/shm), Ray's memory monitor, "not enough host memory" (the hierarchical cache). Before
    ``cuda.memory`` since "Tried to allocate" is also the CPU allocator's phrase.
``cuda.memory``
    Device memory exhausted: cudart's "out of memory" (cudaErrorMemoryAllocation), the caching
    allocator's "CUDA out of memory. Tried to allocate", ``OutOfMemoryError``, cuBLAS/cuDNN
    ``*_STATUS_ALLOC_FAILED``, NCCL's "Failed to CUDA calloc", and the "out of memory" of the
    HIP/XPU/NPU/MPS device allocators.
``cuda.hardware``
    The GPU itself, in the words of CUDA's error table: ECC and "uncorrectable" errors, "fallen
    off the bus", GPU lost, NVLink errors, "hardware stack error", "system not yet
    initialized", "CUDA-capable device(s) is/are busy or unavailable", RM/driver init failures.
``cuda.launch``
    A kernel faulted (CUDA's table again): illegal memory access/address/instruction,
    unspecified launch failure, misaligned address, device-side assert, launch timed out, too
    many resources requested for launch.
``cuda.toolchain``
    A deterministic build/driver mismatch: no kernel image is available, PTX compiled with an
    unsupported toolchain, PTX JIT failures, invalid device function, driver version
    insufficient, unsupported compute capability. Restarting cannot help.
``cuda.environment``
    The environment, not the GPU: invalid device ordinal, no CUDA-capable device, "Found no
    NVIDIA driver on your system", CUDA_VISIBLE_DEVICES, a stub driver, a CPU-only torch.
``nccl.echo``
    What a rank sees when a *peer* died: connection closed/reset by peer, collective operation
    timeout, the c10d watchdog that caught or aborted, "remote process exited", closed sockets,
    broken pipes. Before ``nccl.error``: an echo is not this rank's fault.
``watchdog``
    SGLang's scheduler watchdog ("watchdog timeout", "(self.watchdog_timeout=..."). Checked
    first, and for SGLang's own sources only: torch's watchdog is c10d's (``nccl.echo``).
``process.exit``
    A child process ended: "crashed with exit code", "scheduler died during initialization
    (exit code: ...)", "terminated with signal/exit code", multiprocessing's exitcode lines.
    Before ``hint.memory``: such lines often add "a common cause is the OS OOM killer".
``nccl.error``
    NCCL/c10d/gloo errors of this rank: ncclGetErrorString's table (but "remote process
    exited", an echo), "NCCL error in: ...", ``DistBackendError``, communicator init failures,
    NCCL's own WARN strings, NCCL/c10d/gloo/process-group words. Not "whatever a
    ``distributed`` module raises": most of that is validation (a size not divisible, a KV
    connector's bookkeeping), no NCCL error. After the CUDA families, so NCCL's "Failed to CUDA
    calloc" stays a device OOM; a CUDA wrapper that NCCL prints ("Cuda failure '%s'") is
    ``cuda.other`` like every wrapper.
``hint.memory``
    Words that point at memory without being evidence: strerror(ENOMEM) "Cannot allocate
    memory", the OOM killer, any other "out of memory"/OOM mention left by the rules above.
``generic``
    A failure reported without its name: a message that only wraps the exception its code
    caught ("Capture cuda graph failed: {e}", "Worker failed with error '{e}'": the source
    formats the ``except ... as e`` name into it; the diagnosis reads what it holds), "Scheduler hit an exception", "SIGQUIT received",
    "Received sigquit from a child process", ``EngineDeadError``/"engine loop has died",
    "kill_process_tree called", "Exception in callback", "Traceback", segmentation faults.
``model.load``
    Checkpoint/config/tokenizer loading, and a model architecture the server does not support
    ("Model architectures <*> are not supported for now"): what safetensors, huggingface_hub and transformers'
    loading code say, what is raised in a ``model_load`` module, and the words of loading
    anywhere ("Error(s) in loading state_dict", PytorchStreamReader, safetensors headers,
    missing/unexpected keys, "does not appear to have a file named").
``cuda.other``
    Every other CUDA runtime/driver/Triton/kernel error: the rest of cudart's table and its
    ``cudaError*`` names, the wrappers ("CUDA error: <*>", "CUDA driver error: <*>", "Triton
    Error [CUDA]: <*>", "Cuda failure '<*>'") whose inner text the diagnosis reads again,
    cuBLAS/cuDNN statuses, and what is raised in a ``cuda`` module (Triton, FlashInfer,
    sgl-kernel, torch.cuda, attention backends) -- but not an ``ImportError`` there (a package
    that cannot be loaded: an install or ABI problem, ``other``), nor its argument checks: a
    ``ValueError``/``TypeError``/``NotImplementedError``/``AssertionError``... there ("head_dim
    <*> is not supported") is a kernel refusing its input, ``other`` (or ``config.args`` when
    it names a flag), not a CUDA fault.
``config.args``
    argparse's own messages and server-argument validation: what is raised or logged at error
    level in a ``config`` module (server_args, arg_utils, config classes), ``ArgumentError``,
    a raised message that names a command-line flag (``--something``), and a validation error
    that a size must be divisible by another (attention heads by the tensor-parallel size):
    the parallel layout the operator chose.
``other``
    Everything else the stack prints.

The module and source rules only decide for what is raised or logged as an error
(``exception``, ``error``, ``critical``, a library's ``lib``/``warn``/``table`` strings), and
the broad topic words (NCCL, loading, CUDA) only from ``warning`` up: an info line of a
distributed module that names NCCL is not an NCCL error. Info/debug lines get a family only
from the specific words of the families above (a port in use, a process that died...).

The module table maps a package-relative module path to a subsystem by the ordered rules of
``SUBSYSTEM_RULES`` (directory and file names), then is compressed to the fewest prefixes that
keep every assignment: a directory whose files mostly share a subsystem becomes one ``dir/`` row,
its exceptions rows of their own (the consumer takes the longest matching prefix).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence

FAMILIES = (
    "cuda.memory", "cuda.hardware", "cuda.launch", "cuda.toolchain", "cuda.environment", "cuda.other",
    "host.memory", "hint.memory", "kv_pool.startup", "kv_pool.exhausted", "nccl.error", "nccl.echo",
    "port.bind", "config.args", "model.load", "watchdog", "process.exit", "generic", "other",
)
SUBSYSTEMS = ("config", "model_load", "cuda", "distributed", "memory", "http", "dispatch", "scheduler", "model", "other")

ERRORISH = frozenset({"exception", "error", "critical", "lib", "warn", "table"})
TOPICAL = ERRORISH | {"warning"}  # the levels the broad topic rules (NCCL, loading, CUDA words) speak for
VALIDATION = frozenset({"ValueError", "TypeError", "NotImplementedError", "AssertionError", "KeyError", "IndexError",
                        "AttributeError"})
LOAD_DISTS = frozenset({"safetensors", "huggingface_hub", "transformers"})
# The C library's errno texts ("No such file or directory"): copies linked into a library are not its words.
STRERRORS = frozenset(os.strerror(n).lower() for n in range(1, 134))
# A package that cannot be imported is an install or ABI problem (``other``), wherever it is raised.
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})


def _rx(*alternatives: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{a})" for a in alternatives))


# --------------------------------------------------------------------------- the words

KV_STARTUP = _rx(
    r"not enough memory\. please try to increase --mem-fraction-static",
    r"leave no gpu memory for the kv cache",
    r"no available memory for the cache blocks",
    r"larger than the available kv cache memory",
    r"(?:increas|rais)(?:e|ing) (?:the )?(?:--mem-fraction-static|`?mem_fraction_static|`?gpu_memory_utilization)",
    r"(?:kv cache|kv pool|cache blocks|max_total_num_tokens).{0,60}(?:is negative|<= ?<\*>|not enough memory|"
    r"no (?:gpu )?memory (?:left|available))",
)
KV_EXHAUSTED = _rx(
    r"\b(?:prefill|decode) out of memory",
    r"alloc_req_slots runs out of memory",
    r"out of memory\. try to lower your batch size",
    r"out of memory even after retracting",
    r"(?:kv cache|token|req_to_token|request slot|block) pool.{0,40}(?:is full|exhausted|runs? out)",
)
PORT_BIND = _rx(
    r"address already in use", r"attempting to bind", r"eaddrinuse", r"address in use",
    r"\bport\b.{0,40}\b(?:is )?(?:already )?in use",
    r"(?:failed|unable|cannot|could not|can't) (?:to )?bind (?:to |on )?(?:the )?(?:port|address|socket|<\*>:<\*>)",
    r"(?:socket|port|address|server).{0,40}(?:failed to bind|bind failed|cannot bind|could not bind)",
    r"\bcall to bind failed",
)
HOST_MEMORY = _rx(
    r"defaultcpuallocator", r"can't allocate memory", r"bad_alloc", r"pin_memory.{0,30}(?:fail|error)",
    r"pinned memory.{0,40}(?:fail|exhaust|not enough|insufficient|cannot allocate|out of)",
    r"(?:fail|unable|cannot|could not).{0,40}pinned memory", r"cudahostalloc", r"cuda host ?alloc",
    r"cudahostregister.{0,30}fail", r"(?:not enough|insufficient|out of) (?:host|cpu|system|pinned) memory",
    r"(?:host|cpu|system) memory.{0,40}(?:not enough|insufficient|exhausted|exceed)", r"memory monitor",
    r"running low on memory", r"killed due to memory pressure", r"memory usage threshold",
)
# shared memory is the host's (/dev/shm) unless a kernel speaks of it (its SMEM: tiles, stages, blocks)
SHARED_MEMORY = _rx(
    r"shared memory.{0,40}(?:insufficient|not enough|no space|exhaust|too small|fail)", r"/dev/shm",
    r"(?:not enough|insufficient|out of) shared memory", r"\bshm\b.{0,40}(?:fail|insufficient|not enough|no space|too small)",
    # NCCL's own words when /dev/shm is full: it cannot create or grow its segment
    r"(?:error|fail\w*) (?:while )?(?:creating|<\*>|to (?:create|extend|allocate|map|open)) (?:the )?shared memory",
    r"failed to (?:create|extend) shared memory", r"failed to extend <\*> to <\*>",
)
KERNEL_SMEM = re.compile(r"tile|stage|smem|occupancy|kernel|block|warp|cta|configuration|per sm")
CUDA_MEMORY = _rx(
    r"\bcuda out of memory", r"^out of memory$", r"outofmemoryerror", r"_status_alloc_failed",
    r"\b(?:hip|xpu|npu|mps|gpu|device|cuda)(?: backend)? out of memory", r"cudaerrormemoryallocation",
    r"failed to cuda (?:c|m)alloc", r"cuda ?malloc.{0,40}(?:fail|out of memory)", r"\bcumemalloc\b.{0,40}fail",
    r"(?:not enough|insufficient) (?:gpu|device|cuda) memory", r"out of (?:gpu|device) memory",
    r"tried to allocate .{0,40}gpu", r"^cuda out of memory\. tried to allocate", r"\boom\b.{0,12}on device",
    r"oom trying to allocate workspace",
)
CUDA_HARDWARE = _rx(
    r"\becc\b", r"uncorrectable", r"fallen off the bus", r"\bgpu (?:is |has been |was )?lost", r"\bnvlink\b.{0,60}error",
    r"hardware stack error", r"hardware error", r"system not yet initialized", r"busy or unavailable",
    r"\bxid\b", r"\brm ?init", r"invalid access of peer gpu memory", r"row remap", r"page retirement",
    r"cudaerror(?:eccuncorrectable|hardwarestackerror|nvlinkuncorrectable|devicesunavailable|systemnotready)",
)
CUDA_LAUNCH = _rx(
    r"illegal (?:memory access|address|instruction)", r"unspecified launch failure", r"misaligned address",
    r"device-side assert", r"launch (?:timed out|timeout)", r"too many resources requested for launch",
    r"invalid program counter", r"kernel launch (?:failed|failure|error)", r"warp (?:out-of-range|illegal)",
    r"cudaerror(?:illegaladdress|illegalinstruction|launchfailure|misalignedaddress|assert|launchtimeout|"
    r"launchoutofresources|invalidpc)",
)
CUDA_TOOLCHAIN = _rx(
    r"no kernel image is available", r"unsupported (?:ptx|toolchain)", r"ptx jit", r"ptx was compiled",
    r"invalid device function", r"driver version is insufficient", r"insufficient driver",
    r"unsupported compute capability", r"compute capability.{0,40}(?:not supported|unsupported|too (?:old|low))",
    r"(?:display driver|cuda driver) combination", r"forward compatibility was attempted",
    r"device kernel image is invalid", r"requires a newer (?:cuda )?driver", r"not supported in the installed cuda driver",
    r"\bptxas\b.{0,40}(?:fail|error)", r"\bsm_<\*> is not (?:a )?(?:compatible|supported)",
    r"not compatible with the current pytorch installation", r"driver .{0,30}too old",
    r"cudaerror(?:noKernelImageForDevice|unsupportedptxversion|invalidptx|jitcompiler|invaliddevicefunction|"
    r"insufficientdriver|callrequiresnewerdriver|systemdrivermismatch|compatnotsupported)".lower(),
)
CUDA_ENVIRONMENT = _rx(
    r"invalid device ordinal", r"no cuda-capable device", r"found no nvidia driver", r"might not have a cuda gpu",
    r"cuda_visible_devices.{0,80}(?:invalid|not|exceed|inconsistent|mismatch|empty|wrong)",
    r"(?:invalid|inconsistent|exceeds?|not visible).{0,80}cuda_visible_devices",
    r"no (?:cuda|nvidia) gpus? (?:are |is |were )?(?:available|found|detected)", r"cuda is not available",
    r"not compiled with cuda", r"stub library", r"nvidia driver on your system", r"libcuda\.so",
    r"cudaerror(?:invaliddevice|nodevice|stublibrary)$",
)
NCCL_ECHO = _rx(
    r"connection (?:closed|reset) by (?:peer|remote)", r"closed by (?:peer|remote)", r"collective operation timeout",
    r"watchdog caught", r"remote process exited", r"socket (?:closed|has been closed)", r"connection reset",
    r"broken pipe", r"peer (?:closed|disconnected|is dead|died)", r"heartbeat monitor", r"ncclremoteerror",
    r"communicator (?:was |has been |is )?abort", r"client socket has timed out", r"connection (?:refused|lost)",
    r"(?:nccl|c10d|gloo|process ?group|collective).{0,60}(?:\babort(?:ed)?\b|\btimed out\b|\btimeout\b)",
    r"timed out waiting for (?:peers?|ranks?|all ranks|the store|clients?)",
)
WATCHDOG = _rx(r"watchdog timeout", r"\(self\.watchdog_timeout=", r"\bwatchdog_timeout\b.{0,40}(?:exceed|expired|hit)")
PROCESS_EXIT = _rx(
    r"crashed with exit code", r"died during initialization", r"\bexitcode\b", r"terminated with (?:signal|exit)",
    r"(?:subprocess|process(?! ?group)|rank|worker|child|scheduler|detokenizer|engine core|proc)\b.{0,60}"
    r"(?:exit ?code|\bdied\b|(?<!be )exited (?:with|unexpectedly|before|during|while)|terminated (?:with|unexpectedly|due)|"
    r"was killed|killed by signal|is dead)",
    r"exit(?:ed)? (?:with )?(?:code|status) <\*>.{0,40}(?:signal|sigkill)",
)
CUDA_WRAPPER = re.compile(
    r"^(?:<\*> )?(?:cuda|triton|cuda driver|cuda runtime|cudart|hip|cublas|cudnn)[ _]?(?:error|failure)\b[^a-z]{0,12}"
    r"(?:\[cuda\])?[^a-z]{0,6}<\*>\W*$"
)
NCCL_ERROR = _rx(
    r"\bnccl\b", r"nccl[a-z]*error", r"distbackenderror", r"\bc10d\b", r"processgroup", r"\bgloo\b",
    r"communicator.{0,40}(?:init|fail|error)", r"process group.{0,40}(?:fail|error|not initialized)",
)
HINT_MEMORY = _rx(r"cannot allocate memory", r"oom[- _]?kill", r"\boom\b", r"out of memory", r"\bran out of memory")
GENERIC = _rx(
    r"hit an exception", r"sigquit", r"enginedeaderror", r"engine loop has died", r"engine core.{0,30}(?:died|dead)",
    r"kill_process_tree", r"exception in callback", r"traceback \(most recent call last\)", r"segmentation fault",
    r"core dumped", r"fatal python error", r"unhandled exception", r"uncaught exception",
)
MODEL_LOAD = _rx(
    r"(?:model )?architectures? <\*> (?:is|are) not supported", r"unsupported (?:model )?architectures?\b",
    r"does not (?:recognize|support) this architecture",
    r"error\(s\) in loading state_dict", r"pytorchstreamreader", r"safetensor", r"deserializ", r"headertoolarge",
    r"metadataincompletebuffer", r"(?:missing|unexpected) keys?\b", r"size mismatch for", r"does not appear to have a file named",
    r"repository not found", r"revision not found", r"entry not found", r"gated repo", r"trust_remote_code",
    r"unrecognized (?:model|configuration|processing class)", r"config\.json", r"state_dict",
    r"(?:checkpoint|weights?|tokenizer|model files?).{0,40}(?:not found|missing|mismatch|corrupt|failed to load|"
    r"could not be loaded|cannot be loaded|unable to load)",
    r"(?:failed|unable|cannot|could not) (?:to )?load (?:the )?(?:model|weights|checkpoint|tokenizer|config)",
)
CUDA_OTHER = _rx(
    r"\bcuda (?:error|failure|driver error|runtime error)", r"triton error", r"\bcudaerror", r"cu[a-z]*_status_",
    r"\bcublas\b.{0,60}(?:fail|error)", r"\bcudnn\b.{0,60}(?:fail|error)", r"\bnvrtc\b.{0,60}(?:fail|error)",
    r"\bcuda\b.{0,80}\b(?:fail|failed|failure|error)\b",
)
# A message that only wraps another error ("Capture cuda graph failed: <*>", "Worker failed with
# error '<*>'"): it names nothing of its own; the diagnosis reads what it holds.
GENERIC_WRAPPER = re.compile(
    r"^(?:<\*> ?)?[a-z0-9 _.'\-\[\]()]{3,60}?\b(?:failed|failure|error|exception|crashed)"
    r"(?: with(?: (?:error|exception))?)?(?: in)?[:!,]? ?'?<\*>'?(?: ?<\*>)*(?:[,.;]? ?please check [a-z .]{0,60})?[.!]?"
    r"(?:$| (?=possible solutions|open an issue|\d\.))"
)
DIVISIBLE = re.compile(r"\b(?:must be|is not|not|be) (?:evenly )?divisible by\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]+(?:-[a-z0-9]+)+\b|(?<![\w-])--(?:host|port|model|tp|dp|trust)\b")

EXC_FAMILY = {
    "OutOfMemoryError": "cuda.memory",
    "EngineDeadError": "generic",
    "DistBackendError": "nccl.error", "DistError": "nccl.error", "DistNetworkError": "nccl.echo",
    "DistStoreError": "nccl.echo",
    "ArgumentError": "config.args", "ArgumentTypeError": "config.args",
    "SafetensorError": "model.load", "UnpicklingError": "model.load", "RepositoryNotFoundError": "model.load",
    "RevisionNotFoundError": "model.load", "EntryNotFoundError": "model.load", "GatedRepoError": "model.load",
    "LocalEntryNotFoundError": "model.load", "HFValidationError": "model.load",
}
SUBSYSTEM_FAMILY = {"model_load": "model.load", "config": "config.args", "cuda": "cuda.other"}


def classify(pattern: str, level: str, exc: str, module: str, subsystem: str | None, dist: str, *,
             wraps: bool = False) -> str:
    """The one family of a message (see the module docstring for the order and the why).
    ``wraps``: the source formats the exception it caught into the message."""
    text = pattern.lower()
    errorish, topical = level in ERRORISH, level in TOPICAL
    # the kernel's signal names: SIGBUS is a mapped page the kernel could not back -- on these
    # hosts /dev/shm (host memory) full; a SIGKILL points at the OOM killer without being evidence
    if level == "table" and module == "signal":
        return {"SIGBUS": "host.memory", "SIGKILL": "hint.memory"}.get(pattern, "other")
    # an error table speaks for its own strings (ncclGetErrorString: "unhandled cuda error" is NCCL's)
    if level == "table" and dist.startswith("nvidia-nccl"):
        return "nccl.echo" if NCCL_ECHO.search(text) else "nccl.error"
    if exc in ("OutOfMemoryError", "EngineDeadError"):
        return EXC_FAMILY[exc]
    if exc in IMPORT_ERRORS:
        return "other"  # a package that cannot be imported: an install or ABI problem
    first = text.split("\n", 1)[0]
    if wraps and GENERIC_WRAPPER.search(first) and not NCCL_ERROR.search(first) and not CUDA_WRAPPER.search(first):
        return "generic"  # it only wraps the error it caught (its advice lines, if any, with it)
    if dist == "sglang" and WATCHDOG.search(text):
        return "watchdog"
    for family, words in (
        ("kv_pool.startup", KV_STARTUP), ("kv_pool.exhausted", KV_EXHAUSTED), ("port.bind", PORT_BIND),
        ("host.memory", HOST_MEMORY),
    ):
        if words.search(text):
            return family
    if SHARED_MEMORY.search(text) and subsystem != "cuda" and not KERNEL_SMEM.search(text):
        return "host.memory"
    for family, words in (
        ("cuda.memory", CUDA_MEMORY), ("cuda.hardware", CUDA_HARDWARE), ("cuda.launch", CUDA_LAUNCH),
        ("cuda.toolchain", CUDA_TOOLCHAIN), ("cuda.environment", CUDA_ENVIRONMENT), ("nccl.echo", NCCL_ECHO),
        ("process.exit", PROCESS_EXIT),
    ):
        if words.search(text):
            return family
    if CUDA_WRAPPER.search(text):
        return "cuda.other"
    if exc in ("DistBackendError", "DistError") or (
            errorish and dist.startswith("nvidia-nccl") and text.strip(" .") not in STRERRORS) or (
            topical and NCCL_ERROR.search(text)):
        return "nccl.error"
    for family, words in (("hint.memory", HINT_MEMORY), ("generic", GENERIC)):
        if words.search(text):
            return family
    if topical:
        for family, words in (("model.load", MODEL_LOAD), ("cuda.other", CUDA_OTHER)):
            if words.search(text):
                return family
    if exc in EXC_FAMILY:
        return EXC_FAMILY[exc]
    if dist == "nvidia-cuda-runtime":
        return "cuda.other"
    if topical and dist in LOAD_DISTS:
        return "model.load"
    if errorish and subsystem in ("config", "model_load"):
        return SUBSYSTEM_FAMILY[subsystem]
    if level in ("exception", "error") and exc in VALIDATION and DIVISIBLE.search(text):
        return "config.args"  # a size that must divide another (heads by --tp-size): the parallel layout chosen
    if level in ("exception", "error") and FLAG.search(pattern):
        return "config.args"
    if errorish and subsystem == "cuda" and exc not in VALIDATION | IMPORT_ERRORS:
        return "cuda.other"
    return "other"


# --------------------------------------------------------------------------- the module table

SUBSYSTEM_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(rx)) for name, rx in (
    # the stack's crash-report helpers (py-spy dumps, CUDA core dumps, debug dumps): they run
    # after a failure and report on their own tools ("Pyspy failed ... py-spy: not found"); a
    # "cuda" in their name (sglang's cudacore_pyspy_dump_utils.py) is not the CUDA subsystem
    ("other", r"(?:^|/)\w*(?:pyspy|py_spy|coredump|core_dump|crash_dump|debug_dump)\w*\.py$"),
    # generic plumbing a traceback passes through (the diagnosis skips these frames)
    ("dispatch", r"^torch/(?:_ops\.py|nn/modules/module\.py|utils/_contextlib\.py|_dynamo/|_compile\.py|autograd/|"
                 r"_tensor\.py|overrides\.py|fx/|_functorch/|_higher_order_ops/|utils/_python_dispatch\.py|"
                 r"_jit_internal\.py|jit/|multiprocessing/|_utils\.py|_utils_internal\.py|__init__\.py$|utils/_device\.py|"
                 r"_guards\.py)"),
    ("dispatch", r"^(?:threading|runpy|selectors|socket|subprocess|contextlib|functools)\.py$|"
                 r"^(?:asyncio|concurrent|multiprocessing)/"),
    ("config", r"^argparse\.py$"),
    # the HTTP side: servers, entry points, the tokenizer/detokenizer processes
    ("http", r"^(?:uvicorn|fastapi|starlette)/"),
    ("http", r"^(?:sglang/srt|vllm)/entrypoints/|^sglang/(?:cli/|launch_server\.py)|^sglang/srt/(?:managers/"
             r"(?:tokenizer_|detokenizer_|multi_tokenizer)|rust_server/|observability/|grpc)"),
    # argument parsing and validation, config classes
    ("config", r"^sglang/srt/(?:server_args\w*\.py|arg_groups/|configs/|environ\.py|utils/server_args\w*\.py|"
               r"utils/field_validators\.py)"),
    ("config", r"^vllm/(?:config/|engine/arg_utils\.py|envs\.py)"),
    ("model", r"^transformers/models/[^/]+/modeling_"),
    ("model_load", r"^(?:transformers|huggingface_hub|safetensors|tokenizers)/"),
    ("config", r"(?:^|/)(?:server_args|arg_utils|args|cli_args|configs?)(?:\.py$|/)"),
    # checkpoints, weights, tokenizers, the hub
    ("model_load", r"^torch/(?:serialization\.py|_weights_only_unpickler\.py|hub\.py|package/)"),
    ("model_load", r"(?:^|/)(?:model_loader|weight_sync|weight_cache|checkpoint_engine|connector|tokenizers?|"
                   r"transformers_utils|hf_transformers)(?:/|\.py$)|(?:^|/)(?:hf_transformers_utils|weight_utils|"
                   r"weight_loader|hf_utils|model_file_verifier|runai_utils|hf_transformers_patches|"
                   r"patch_tokenizer)\.py$"),
    # memory pools, KV cache, allocators
    ("memory", r"(?:^|/)(?:mem_cache|kv_offload|simple_kv_offload|device_allocator|kv_canary|hisparse)/|memory_pool|"
               r"allocator|kv_cache|pool_configurator|memory_saver|host_shared_memory|block_pool|offloader|"
               r"^torch/(?:storage\.py|_storage)"),
    # collectives, process groups, NCCL/gloo wrappers, custom all-reduce
    ("distributed", r"^torch/distributed/|(?:^|/)(?:distributed|device_communicators|communication|comm|eplb|"
                    r"elastic_ep|parallel_state)(?:/|\.py$)|custom_all_reduce|all_reduce|pynccl|nccl|gloo|"
                    r"dp_attention|model_parallel"),
    # the scheduler / engine loop
    ("scheduler", r"^sglang/srt/managers/|^sglang/srt/(?:model_executor/(?:model_runner|forward_batch|runner/|runner_utils|"
                  r"\w*graph_runner)|"
                  r"speculative|disaggregation|sampling|constrained|batch_overlap|two_batch_overlap|dllm|"
                  r"beam_search|session|multiplex)|^vllm/(?:v1/(?:engine|core|worker|sample|spec_decode|"
                  r"executor|structured_output|request|outputs)|engine/|worker/|core/|executor/|sequence\.py|"
                  r"sampling_params\.py)"),
    # kernels, Triton, JIT compilation, custom ops, attention backends
    ("cuda", r"^(?:triton|sgl_kernel|flashinfer|triton_kernels|deep_gemm|b12x)/|^(?:build_backend|build_utils)\.py$|"
             r"^torch/(?:cuda|_inductor|backends|xpu|mps|mtia|accelerator|cpu|_library|_custom_op|"
             r"utils/cpp_extension)|^torch/_custom_ops\.py$"),
    ("cuda", r"(?:^|/)(?:kernels?|jit|jit_kernel|compilation|attention|ops|hardware_backend|platforms|"
             r"batch_invariant_ops|kernel_plugins|deep_gemm_wrapper|vllm_flash_attn|_custom_ops)(?:/|\.py$)|"
             r"cuda(?!_graph_runner)|triton|kernel|custom_op"),
    # model definitions and layers
    ("model", r"^(?:sglang/srt|vllm/model_executor|vllm)/(?:models|layers|lora|multimodal)/|^torch/nn/|"
              r"^vllm/model_executor/"),
    # the packages' generic helpers
    ("dispatch", r"^sglang/srt/utils(?:/|\.py$)|^sglang/utils\.py$|^vllm/utils/|^vllm/(?:logger|forward_context)\.py$"),
))


def subsystem_of(path: str) -> str:
    for name, rx in SUBSYSTEM_RULES:
        if rx.search(path):
            return name
    return "other"


def module_table(paths: Iterable[str]) -> list[tuple[str, str]]:
    """``(prefix, subsystem)`` rows for every module path, compressed: each directory gets the
    subsystem most of its direct children have (a file counts its own, a subdirectory its
    default; ties go to the one with more files), a row only where that differs from its
    parent's, and the files that differ from it rows of their own. The default is what a path
    the pinned trees do not have (an older release's module) resolves to."""
    tree: dict[str, object] = {}
    for path in paths:
        node = tree
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part + "/", {})  # type: ignore[assignment]
        node[parts[-1]] = subsystem_of(path)  # type: ignore[index]
    rows: list[tuple[str, str]] = []

    known: dict[int, tuple[str, Counter[str]]] = {}

    def summary(node: dict[str, object]) -> tuple[str, Counter[str]]:
        """A directory's default and its files' subsystems (computed once per directory)."""
        if id(node) not in known:
            votes: Counter[str] = Counter()
            weight: Counter[str] = Counter()
            for child in node.values():
                if isinstance(child, dict):
                    top, files = summary(child)
                    votes[top] += 1
                    weight.update(files)
                else:
                    votes[str(child)] += 1
                    weight[str(child)] += 1
            known[id(node)] = (max(sorted(votes), key=lambda s: (votes[s], weight[s])), weight)
        return known[id(node)]

    def default(node: dict[str, object]) -> str:
        return summary(node)[0]

    def walk(prefix: str, node: dict[str, object], inherited: str | None) -> None:
        top = default(node)
        if top != inherited:
            rows.append((prefix, top))
        for name, child in sorted(node.items()):
            if isinstance(child, dict):
                walk(prefix + name, child, top)
            elif child != top:
                rows.append((prefix + name, str(child)))

    for name, child in sorted(tree.items()):
        if isinstance(child, dict):
            walk(name, child, None)
        else:
            rows.append((name, str(child)))
    return rows


def lookup(module: str, rows: Sequence[tuple[str, str]]) -> str | None:
    """The subsystem of a package-relative module path (rows longest prefix first)."""
    for prefix, name in rows:
        if module.startswith(prefix):
            return name
    return None
