"""CUDA faults (deterministic ones cannot be fixed by a restart), and any other CUDA error."""

from __future__ import annotations

import re

from supervisor.core.diagnosis.rule import _ci, _Rule
from supervisor.core.model import Cause, Remedy

_CUDA_ERROR_PATTERN = _ci(
    r"\bcuda (?:driver |runtime )?error(?!s)|cudaError|CUDA_ERROR_|CUBLAS_STATUS_|CUDNN_STATUS_"
    r"|AcceleratorError|Cuda failure|Triton Error \[CUDA\]"
)

FAULTS: tuple[_Rule, ...] = (
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
)

OTHER: tuple[_Rule, ...] = (
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
               ("cuda driver error", "torch 2.14.1 cuda/_utils.py:138: 'CUDA driver error: <*> (<*>)'"),
               ("cuda runtime error", "torch (old) THCGeneral: 'cuda runtime error (%d) : %s'"),
               ("cudaerror", "cuda_runtime_api.h cudaError_t names"), ("cuda_error_", "cuda.h CUresult names"),
               ("cublas_status_", "cublas_api.h cublasStatus_t names"), ("cudnn_status_", "cudnn.h cudnnStatus_t names"),
               ("acceleratorerror", "torch/__init__.py AcceleratorError (torch >= 2.8)"),
               ("cuda failure", "nccl src/include/checks.h: 'Cuda failure '%s''"),
               ("triton error [cuda]", "triton 3.8.0 backends/nvidia/driver.c:76: 'Triton Error [CUDA]: <*>'")),
    ),
)
