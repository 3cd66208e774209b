"""Device memory: another process holding part of the GPU, and CUDA OOM (runtime or
startup by phase)."""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _ci, _Rule
from supervisor.core.model import Cause, Phase, Remedy

RULES: tuple[_Rule, ...] = (
    # -- another process holds part of the GPU: clear it
    _Rule(
        "unbalanced",
        Cause.CUDA_OOM_STARTUP,
        ("memory capacity is unbalanced",),
        remedy=Remedy.CLEAR_GPU,
        usual_phase=Phase.STARTING,
        phase_in_text=True,
        cites=(("memory capacity is unbalanced", "sglang 0.5.23 srt/distributed/bootstrap.py:450: 'The memory capacity is "
                "unbalanced. Some GPUs may be occupied by other processes.'"),),
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
)
