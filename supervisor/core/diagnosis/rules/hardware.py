"""The GPU itself: a restart cannot fix it, whatever frames surround it. (The NVIDIA driver's
Xid records are read as kernel records, ``kernel.record_in``, in every mode.)"""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _Rule
from supervisor.core.model import Cause

RULES: tuple[_Rule, ...] = (
    # -- the GPU itself: a restart cannot fix it, whatever frames surround it
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
