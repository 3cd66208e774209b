"""Host memory, and the hints of it that are not evidence (a SIGKILL, an ENOMEM)."""

from __future__ import annotations

import re

from supervisor.core.diagnosis.rule import _before_sigquit, _ci, _pinned_host_context, _Rule
from supervisor.core.diagnosis.rules.cuda_errors import _CUDA_ERROR_PATTERN
from supervisor.core.model import Cause

RULES: tuple[_Rule, ...] = (
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
            "insufficient shared memory",
        ),
        origin="ray",
        origins=(
            ("not enough host memory", "sglang"), ("can't allocate memory", "torch"), ("std::bad_alloc", "c++"),
            ("insufficient shared memory", "torch"),
            ("killed due to memory pressure", "kernel"),
        ),
        cites=(("not enough host memory", "sglang 0.5.23 srt/mem_cache/pool_host/base.py:252: 'Not enough host memory available. Requesting <*> but only have <*> free.'"),
               
            ("running low on memory", "ray/_private/memory_monitor: 'Task was killed due to the node running low on memory'"),
            ("exceeds the memory usage threshold", "ray memory monitor: '... which exceeds the memory usage threshold of 0.95. Ray killed this worker'"),
            ("can't allocate memory", "c10/core/impl/alloc_cpu.cpp: 'DefaultCPUAllocator: can't allocate memory: you tried to allocate'"),
            ("std::bad_alloc", "libstdc++: 'what():  std::bad_alloc'"),
            ("insufficient shared memory", "torch/utils/data/_utils/signal_handling: 'This might be caused by insufficient shared memory (shm)'"),
            ("killed due to memory pressure", "systemd-oomd: 'Killed ... due to memory pressure'"),
        ),
    ),
    _Rule("python_memoryerror", Cause.HOST_OOM, ("memoryerror",), pattern=re.compile(r"(?<![\w.])MemoryError\b"),
          origin="python", cites=(("memoryerror", "CPython builtin exception MemoryError"),)),
)

HINTS: tuple[_Rule, ...] = (
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
)
