"""A fake ``pynvml`` with the real module's names, for testing the NVML backend without a GPU.

Mirrors nvidia-ml-py where the probe can tell the difference: the ``NVML_ERROR_*`` codes,
``NVMLError`` whose ``__new__`` maps a code to a subclass (``NVMLError(NVML_ERROR_GPU_IS_LOST)``
is an ``NVMLError_GpuIsLost``), the subclasses generated from the constant names exactly as
``_extractNVMLErrorsAsClasses`` does, ``Uninitialized`` before ``nvmlInit``, ``str`` uuids
and names, and ``usedGpuMemory = None`` when the driver cannot tell.

Tests drive it through ``STATE``: the devices, an error code per function name, and
functions that block until ``STATE.release`` is set (a call stuck in the driver).
Call ``reset()`` first; insert it with ``monkeypatch.setitem(sys.modules, "pynvml", ...)``.
"""

from __future__ import annotations

import string
import sys
import threading
from dataclasses import dataclass, field

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    """As in pynvml: constructing it with a code yields the code's subclass."""

    _valClassMapping: dict[int, type] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    value: int

    def __new__(cls, value: int) -> NVMLError:  # noqa: PYI034 - mirrors pynvml
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def nvmlExceptionClass(nvmlErrorCode: int) -> type:  # noqa: N802, N803 - pynvml's names
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses() -> None:  # noqa: N802 - pynvml's name and algorithm
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(this_module, err_name)

        def gen_new(val: int):  # noqa: ANN202
            def new(typ: type, *args: object) -> NVMLError:
                return NVMLError.__new__(typ, val)

            return new

        new_error_class = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()


# --------------------------------------------------------------------------- fake state


@dataclass
class FakeDevice:
    uuid: str
    total: int
    used: int
    name: str = "NVIDIA H200"
    processes: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class FakeState:
    devices: list[FakeDevice] = field(default_factory=list)
    initialized: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML_ERROR_*
    hang: set[str] = field(default_factory=set)  # function names that block until release
    release: threading.Event = field(default_factory=threading.Event)
    calls: list[str] = field(default_factory=list)


STATE = FakeState()


def reset(devices: list[FakeDevice] | None = None) -> FakeState:
    """Fresh state with ``devices`` (default: none) and nothing failing."""
    global STATE
    STATE.release.set()  # free a thread a previous test left blocked
    STATE = FakeState(devices=list(devices or []))
    return STATE


def _enter(name: str, *, needs_init: bool = True) -> None:
    state = STATE
    state.calls.append(name)
    if name in state.hang:
        state.release.wait()
    if name in state.errors:
        raise NVMLError(state.errors[name])
    if needs_init and not state.initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


class c_nvmlMemory_t:  # noqa: N801 - pynvml's name
    def __init__(self, total: int, free: int, used: int) -> None:
        self.total, self.free, self.used = total, free, used


class _ProcessInfo:
    """What ``nvmlStructToFriendlyObject`` gives for a process entry."""

    def __init__(self, pid: int, used: int | None) -> None:
        self.pid = pid
        self.usedGpuMemory = used  # noqa: N815 - pynvml's name
        self.gpuInstanceId = 0xFFFFFFFF  # noqa: N815
        self.computeInstanceId = 0xFFFFFFFF  # noqa: N815


def _device(handle: object) -> FakeDevice:
    if not isinstance(handle, FakeDevice):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return handle


# --------------------------------------------------------------------------- API (pynvml names)


def nvmlInitWithFlags(flags: int) -> None:  # noqa: N802
    _enter("nvmlInit", needs_init=False)
    STATE.initialized = True


def nvmlInit() -> None:  # noqa: N802
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:  # noqa: N802
    _enter("nvmlShutdown")
    STATE.initialized = False


def nvmlErrorString(result: int) -> str:  # noqa: N802
    return NVMLError._errcode_to_string.get(result, "Unknown Error")


def nvmlDeviceGetCount() -> int:  # noqa: N802
    _enter("nvmlDeviceGetCount")
    return len(STATE.devices)


def nvmlDeviceGetHandleByIndex(index: int) -> FakeDevice:  # noqa: N802
    _enter("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(STATE.devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return STATE.devices[index]


def nvmlDeviceGetHandleByUUID(uuid: str) -> FakeDevice:  # noqa: N802
    _enter("nvmlDeviceGetHandleByUUID")
    for d in STATE.devices:
        if d.uuid == uuid:
            return d
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetUUID(handle: object) -> str:  # noqa: N802
    _enter("nvmlDeviceGetUUID")
    return _device(handle).uuid


def nvmlDeviceGetName(handle: object) -> str:  # noqa: N802
    _enter("nvmlDeviceGetName")
    return _device(handle).name


def nvmlDeviceGetMemoryInfo(handle: object, version: int | None = None) -> c_nvmlMemory_t:  # noqa: N802
    _enter("nvmlDeviceGetMemoryInfo")
    d = _device(handle)
    return c_nvmlMemory_t(d.total, d.total - d.used, d.used)


def nvmlDeviceGetComputeRunningProcesses(handle: object) -> list[_ProcessInfo]:  # noqa: N802
    _enter("nvmlDeviceGetComputeRunningProcesses")
    return [_ProcessInfo(pid, used) for pid, used in _device(handle).processes]
