"""The GPU itself: a restart cannot fix it, whatever frames surround it."""

from __future__ import annotations

import re

from supervisor.core.diagnosis.log import _Log
from supervisor.core.diagnosis.rule import _Rule
from supervisor.core.model import Cause

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
)
