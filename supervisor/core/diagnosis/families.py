"""The catalogue's families (and the frames' subsystems) as pseudo-rules: what each means."""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _Rule
from supervisor.core.model import Cause, Phase, Remedy


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

# What a value or the resource a message names means (``meaning``): pseudo-rules read before
# the catalogue's family, which is often the module's (meaning before place). An import or ABI
# failure is the environment whichever package raised it; it is read in the frames' slot, so a
# line that names a cause anywhere in the crash still wins over it.
MEANING_READINGS: dict[str, _Rule] = {
    "port": _Rule("meaning port", Cause.PORT_IN_USE, (), origin="meaning"),
    "bind_refused": _Rule("meaning bind_refused", Cause.CONFIG_ERROR, (), origin="meaning",
                          runner_up=Cause.PORT_IN_USE),
    "address": _Rule("meaning address", Cause.CONFIG_ERROR, (), origin="meaning"),
    "model_file": _Rule("meaning model_file", Cause.MODEL_LOAD_ERROR, (), origin="meaning"),
    "shared_memory": _Rule("meaning shared_memory", Cause.HOST_OOM, (), origin="meaning"),
    "host_memory": _Rule("meaning host_memory", Cause.HOST_OOM, (), origin="meaning"),
    "big_enomem": _Rule("meaning big_enomem", Cause.HOST_OOM, (), origin="meaning", runner_up=Cause.OTHER),
    "sigbus": _Rule("meaning sigbus", Cause.OTHER, (), origin="meaning", strength="hint", runner_up=Cause.HOST_OOM),
    "environment": _Rule("exception environment", Cause.OTHER, (), origin="frames"),
    "oom": _Rule("kernel oom", Cause.HOST_OOM, (), origin="kernel"),
    "xid": _Rule("kernel xid", Cause.GPU_HW_ERROR, (), origin="kernel"),
}
ENVIRONMENT_TYPES = frozenset({"ImportError", "ModuleNotFoundError"})
ENVIRONMENT_WORDS = ("undefined symbol", "cannot open shared object file")
_MEMORY_FAMILIES = frozenset({"host.memory", "cuda.memory", "kv_pool.startup", "kv_pool.exhausted"})

# Causes that are often the consequence of another failure (a peer killed by the kernel
# shows up as an NCCL timeout); a kernel OOM-killer line overrides them.
_CONSEQUENTIAL = frozenset({Cause.NCCL_ERROR, Cause.WATCHDOG_HANG, Cause.OTHER})

# Lines that report a failure without naming it; never evidence of a cause.
_GENERIC = (
    "hit an exception", "sigquit", "enginedeaderror", "engine loop has died", "engine loop is not running",
    "is already dead", "output_handler failed", "scheduler is dead", "exception in callback",
    "unhandled error", "keyboardinterrupt", "systemexit", "cancellederror", "child process",
)


# A family whose words say little ("unknown error" of CUDA's table): a hand rule that reads the
# same line (nvidia-smi's "Unable to determine the device handle") goes first.
_WEAK_FAMILIES = frozenset({"cuda.other"})  # never certain either: its words say only "a CUDA error"
_NCCL_MEMORY = _family("cuda.memory via nccl", Cause.CUDA_OOM_STARTUP, phased=True, usual_phase=Phase.STARTING)
