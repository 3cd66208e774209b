"""A stand-in SGLang server and GPU: real processes, real HTTP, SGLang's log lines and deaths.

Run as ``python -m supervisor.sim.simulator [SGLang flags] [--sim-* flags]``. It accepts
SGLang's launch flags, forks one ``sglang::scheduler_TP{n}`` child per rank and one
``sglang::detokenizer``, prints SGLang-format startup lines with numbers from a per-rank
memory model (total, weights, static pool = fraction x total, CUDA graphs, headroom), then
serves ``/health``, ``/generate``, ``/v1/completions`` and ``/server_info`` over aiohttp.

Requests really drive the schedulers: the main process hands each request's token count
to the rank-0 scheduler of a DP group, which batches what arrives within a short window
into a prefill batch of up to ``--chunked-prefill-size`` tokens. When the batch's
activation memory (tokens x ``--sim-act-mb-per-token``) exceeds the rank's headroom, the
scheduler dies the SGLang way: ``Scheduler hit an exception:`` with a torch CUDA OOM
traceback, SIGQUIT to the main process, which logs the SIGQUIT line, SIGKILLs its tree and
itself (exit status -9). ``--sim-fail MODE`` injects the other failures (see ``MODES``).

With ``--sim-gpu-dir`` (or ``SGLANG_SIM_GPU_DIR``) each scheduler records the memory it
holds in the simulated-GPU directory (``supervisor.sim.simgpu``) and checks the card's free
memory before loading, so a GPU still held by an orphan fails the launch like the real
thing. Timings are compressed: a load takes about ``--sim-load-s`` x 1.3 seconds.

This module is a test tool standing in for an external program: it does its own I/O and
reads the clock. The schedulers are plain blocking processes; the main process runs one
asyncio loop and forks its children before starting it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import math
import os
import resource
import select
import shutil
import signal
import socket
import sys
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import psutil
from aiohttp import ClientSession, ClientTimeout, web
from setproctitle import setproctitle

from supervisor.sim import simgpu

GIB = simgpu.GIB
MIB = 1024**2
VERSIONS = ("0.5.6", "0.5.23")
DEFAULT_VERSION = "0.5.23"  # the release the real-SGLang tier runs; conformance is checked against it
MODES = (
    "runtime_oom",  # after S s: a runtime CUDA OOM, same path as a real overload
    "hang",  # after S s: /health, /generate, ... accept and never reply
    "host_oom",  # after S s: scheduler TP0 SIGKILLed (kernel OOM killer), no traceback
    "startup_oom",  # CUDA OOM while capturing CUDA graphs
    "kv_pool",  # "Not enough memory. Please try to increase --mem-fraction-static"
    "model_load",  # the weights cannot be read: traceback, exit 1
    "exit0",  # after S s: exit 0 (SGLang as PID 1 in a container)
    "segfault",  # after S s: the main process dies by SIGSEGV
    "orphan",  # after S s: runtime OOM, scheduler TP0 survives holding its GPU memory
    "stuck",  # after S s: runtime OOM, the schedulers' GPU memory never frees
    "ignore_sigterm",  # SIGTERM starts a drain that never ends
)
SERVING_FAULTS = frozenset({"runtime_oom", "hang", "host_oom", "exit0", "segfault", "orphan", "stuck"})

MODEL_TYPE = "DeepseekV3ForCausalLM"
KV_BYTES_PER_TOKEN = 70272  # DeepSeek-V3 MLA: (512 + 64) values x 2 bytes x 61 layers
DEFAULT_CONTEXT_LEN = 163840
DEFAULT_CHUNKED_PREFILL = 8192
DEFAULT_MAX_RUNNING = 2048
DEFAULT_MAX_NEW_TOKENS = 128
SEED_FRACTION, SEED_HEADROOM_GB = 0.93, 0.82  # the seed run's fraction and what it left

# Compressed timings (seconds).
BATCH_WINDOW_S = 0.03  # requests arriving this close together form one prefill batch
PREFILL_S_PER_TOKEN = 4e-6  # a full 8192-token chunk takes ~33 ms
DECODE_STEP_S = 0.004  # one decode step for every running request
DECODE_LOG_INTERVAL = 40  # SGLang logs every 40th decode step
CHILD_MONITOR_S = 0.25  # 0.5.6 mode: 0.5.23's 1 s child monitor, compressed
CHILD_MONITOR_S_V23 = 1.0  # 0.5.23: SubprocessWatchdog(interval=1.0)
DRAIN_POLL_S = 0.25  # 0.5.6 mode: SGLang's 5 s "Gracefully exiting" poll, compressed
DRAIN_POLL_S_V23 = 5.0  # 0.5.23: sigterm_watchdog sleeps 5 s between checks (--sim-drain-poll-s)
REAP_WAIT_S = 2.0  # how long the main process waits for killed children before dying
WARMUP_TRIES = 20  # 0.5.23 tries /model_info 120 times, 1 s apart, 5 s timeout each (compressed)
WARMUP_POLL_S = 0.05
WARMUP_TRY_TIMEOUT_S = 0.5
SCHEDULER_EXIT_TIMEOUT_S = 15.0  # 0.5.23's _SCHEDULER_EXIT_TIMEOUT_SECS after ShutdownReq

# 0.5.23's admission and retraction constants (srt/environ.py, schedule_policy.py), with their
# defaults; the simulator does not read the env vars.
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO x schedule_conservativeness 1.0
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
# A non-streaming request's output goes to the tokenizer every 50 tokens while it decodes
# (output_streamer.py, SGLANG_FORCE_STREAM_INTERVAL): what /health counts as a sign of life.
FORCE_STREAM_INTERVAL = 50

# 0.5.23's crash diagnostics (TokenizerManager.dump_requests_before_crash). The 5 s sleep is a
# literal ``time.sleep(5)`` in SGLang; the simulator reads it from this env var so fast tests
# can shorten it. The others are SGLang's own env vars, honoured with SGLang's defaults.
ENV_DIAG_SLEEP = "SGLANG_SIM_CRASH_DIAG_SLEEP_S"  # default 5.0
# How long SIGKILLed children take to go. The real 0.5.23 on the CPU: gone with main (within
# 0.1 s); the 1.5 s once reported is a GPU server freeing its memory: set it to mimic that.
ENV_TEARDOWN = "SGLANG_SIM_CHILD_TEARDOWN_S"  # default 0.0
ENV_PYSPY = "SGLANG_PYSPY_DUMP_BEFORE_CRASH"  # default true
ENV_COREDUMP = "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"  # default true
ENV_COREDUMP_WAIT = "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS"  # default 60.0
ENV_TEST_CRASH = "SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS"  # SGLang's test hook, default 0 (off)
ENV_KERNEL_LOG = "SGLANG_SIM_KERNEL_LOG"  # host_oom: append a kernel OOM-killer line here
ENV_MEMORY_EVENTS = "SGLANG_SIM_MEMORY_EVENTS"  # host_oom: bump oom/oom_kill in this memory.events
MEMORY_EVENTS_KEYS = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")

SGLANG = "/sgl-workspace/sglang/python/sglang/srt"
TORCH = "/usr/local/lib/python3.12/dist-packages/torch"
# What a node's scheduler logs when a peer node's rank went away (real SGLang 0.5.23 on the
# CPU with gloo, tests/real/test_real_group.py; either node, the survivor): its next
# collective fails on the closed pair.
PEER_LOST_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/sglang/python/sglang/srt/managers/scheduler.py", line 2794, in run_scheduler_process\n'
    "    scheduler.event_loop_normal()\n"
    '  File "/sglang/python/sglang/srt/managers/scheduler.py", line 1012, in recv_requests\n'
    "    recv_reqs = broadcast_pyobj(\n"
    '  File "/sglang/python/sglang/srt/utils/common.py", line 1181, in broadcast_pyobj\n'
    "    dist.broadcast(tensor_size, src=src, group=dist_group)\n"
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
    "peer [{addr}]. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
    "before reporting an error.\n"
)
FRAME_REPR = "<frame at 0x7f3a5c1e4a40, file '/usr/lib/python3.12/selectors.py', line 468, code select>"


# --------------------------------------------------------------------------- flags


def _env_bool(name: str, default: bool) -> bool:
    """SGLang's EnvBool: true/1/yes/y and false/0/no/n, case-insensitive."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("true", "1", "yes", "y")


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


def _build_parser(version: str) -> argparse.ArgumentParser:
    """SGLang's launch flags this simulator understands, plus its own ``--sim-*`` flags.

    Like SGLang, argparse's prefix matching is on (``--tp 2`` means ``--tp-size 2``). 0.5.23's
    parser is ``argparse.ArgumentParser(prog="sglang serve")`` also under
    ``python -m sglang.launch_server``; 0.5.6's had no prog (``launch_server.py``).
    """
    v56 = version == "0.5.6"
    p = argparse.ArgumentParser(prog="launch_server.py" if v56 else "sglang serve")
    add = p.add_argument
    add("--model-path", required=True)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    add("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    add("--mem-fraction-static", type=float, default=None)
    hicache = ["--enable-hierarchical-cache"] + (["--enable-hicache"] if version != "0.5.6" else [])
    add(*hicache, dest="enable_hierarchical_cache", action="store_true")
    add("--hicache-size", type=int, default=0)
    add("--hicache-ratio", type=float, default=2.0 if v56 else None)  # 0.5.23: None -> 2.0
    add("--chunked-prefill-size", type=int, default=None)
    add("--max-running-requests", type=int, default=None)
    add("--max-total-tokens", type=int, default=None)
    add("--context-length", type=int, default=None)
    add("--trust-remote-code", action="store_true")
    add("--served-model-name", default=None)
    add("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"])
    add("--watchdog-timeout", type=float, default=300.0)
    add("--enable-metrics", action="store_true")
    add("--log-level", default="info")
    add("--reasoning-parser", default=None)
    add("--tool-call-parser", default=None)
    add("--base-gpu-id", type=int, default=0)
    add("--crash-dump-folder", default=None)
    # Several nodes (issue 16's recipe: two "nodes" as two servers on one host, gloo on the CPU)
    add("--nnodes", type=int, default=1)
    add("--node-rank", type=int, default=0)
    add("--dist-init-addr", default=None)
    if v56:
        add("--cuda-graph-max-bs", type=int, default=None)
    else:  # removed in 0.5.23: "--cuda-graph-max-bs" is then an ambiguous prefix of these two
        add("--cuda-graph-max-bs-decode", type=int, default=None)
        add("--cuda-graph-max-bs-prefill", type=int, default=None)
        # Flags of the real CPU recipe (accepted so one config drives both the real server and us).
        add("--device", default=None)
        add("--attention-backend", default=None)
        add("--disable-cuda-graph", action="store_true")
        add("--sleep-on-idle", action="store_true")
        add("--skip-server-warmup", action="store_true")

    sim = p.add_argument_group("simulator")
    s = sim.add_argument
    s("--sim-gpu-dir", default=os.environ.get("SGLANG_SIM_GPU_DIR") or None)
    s("--sim-gpus", type=int, default=8)
    s("--sim-gpu-total-gb", type=float, default=96.0)
    s("--sim-weights-gb", type=float, default=72.33)
    s("--sim-graph-gb", type=float, default=None)
    s("--sim-act-mb-per-token", type=float, default=0.25)
    s("--sim-min-kv-gb", type=float, default=1.0)
    s("--sim-load-s", type=float, default=1.0)
    s("--sim-version", choices=VERSIONS, default=version)
    s("--sim-fail", choices=MODES, default=None, metavar="MODE")
    s("--sim-fail-after-s", type=float, default=1.0)
    s("--sim-crash-stamp", default=None)
    s("--sim-log-rate", type=float, default=0.0)
    s("--sim-flood", type=int, default=0)
    s("--sim-kernel-log", default=os.environ.get(ENV_KERNEL_LOG) or None)
    s("--sim-memory-events", default=os.environ.get(ENV_MEMORY_EVENTS) or None)
    s("--sim-drain-poll-s", type=float, default=DRAIN_POLL_S if v56 else DRAIN_POLL_S_V23)
    s("--sim-health-delay-s", type=float, default=0.02)
    s("--sim-health-timeout-s", type=float, default=2.0)  # SGLang's 20 s, compressed
    s("--sim-host-mem-gb", type=float, default=None)  # host RAM for the hicache check
    return p


def _reap(pending: set[int], timeout: float, pause: float) -> None:
    """Reap these children as they exit, for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                pending.discard(pid)
        if pending:
            time.sleep(pause)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like SGLang: an unknown flag is an argparse error (exit 2, usage line)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--sim-version", choices=VERSIONS, default=DEFAULT_VERSION)
    known, _ = pre.parse_known_args(argv)
    return _build_parser(known.sim_version).parse_args(argv)


def default_fraction(total_gb: float, chunked_prefill: int, tp_size: int) -> float:
    """0.5.6 mode: SGLang's computed ``--mem-fraction-static`` when the flag is absent."""
    reserved_mb = 512 + 1.5 * max(chunked_prefill, 2048) + tp_size / 8 * 1024
    if total_gb > 60:
        reserved_mb = max(reserved_mb, 10 * 1024)
    return round((total_gb * 1024 - reserved_mb) / (total_gb * 1024), 3)


def default_chunked_prefill_v23(total_gb: float) -> int:
    """0.5.23 ``handle_gpu_memory_settings``: chunked_prefill_size by GPU memory (MiB)."""
    gpu_mem = total_gb * 1024
    if gpu_mem < 20 * 1024:
        return 2048
    if gpu_mem < 60 * 1024:
        return 4096
    if gpu_mem < 160 * 1024:
        return 8192
    return 16384


def default_decode_max_bs_v23(total_gb: float, tp_size: int) -> int:
    """0.5.23 ``handle_gpu_memory_settings``: the decode CUDA-graph max batch size."""
    gpu_mem = total_gb * 1024
    if gpu_mem < 20 * 1024:
        return 8
    if gpu_mem < 35 * 1024:
        return 48 if tp_size < 4 else 160
    if gpu_mem < 60 * 1024:
        return 32 if tp_size < 4 else 160
    if gpu_mem < 160 * 1024:
        return 256 if tp_size < 4 else 512
    return 512


def default_fraction_v23(total_gb: float, chunked_prefill: int, tp_size: int, *, cuda_graph: bool = True) -> float:
    """0.5.23 ``handle_gpu_memory_settings`` for this simulated GPU (memory_hook.py).

    ``reserved = 512 + 1.5 x max(chunked, 2048) + tp x pp / 8 x 1024 + graph reserve`` MiB,
    at least 10 GiB on cards above 60 GiB, fraction ``round((mem - reserved) / mem, 3)``. The
    graph reserve is ``decode max_bs x 2`` (the prefill-graph reserve is left out: breakable
    prefill graphs are off for this model's backend). H200 (143771 MiB) at TP 8: 0.897; an
    80 GB card (81559 MiB) at TP 8: 0.818.
    """
    gpu_mem = total_gb * 1024
    reserved = 512 + 1.5 * max(chunked_prefill, 2048) + tp_size / 8 * 1024
    if cuda_graph:
        reserved += default_decode_max_bs_v23(total_gb, tp_size) * 2
    if gpu_mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem - reserved) / gpu_mem, 3)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything the main process and its forked children need, resolved from the flags."""

    sglang_args: dict[str, Any]
    version: str
    model_path: str
    served_model_name: str
    host: str
    port: int
    tp_size: int
    dp_size: int
    base_gpu_id: int
    fraction: float
    chunked_prefill: int
    max_running: int
    max_total_tokens: int | None
    context_len: int
    kv_bytes_per_token: int
    hicache_size_gb: int
    hicache_ratio: float
    hicache: bool
    gpu_dir: str | None
    gpus: int
    total_gb: float
    weights_gb: float
    graph_gb: float
    act_bytes_per_token: float
    min_kv_gb: float
    load_s: float
    fail: str | None
    fail_after_s: float
    crash_stamp: str | None
    log_rate: float
    flood: int
    kernel_log: str | None
    memory_events: str | None
    drain_poll_s: float
    device: str
    cuda_graph: bool
    skip_warmup: bool
    health_delay_s: float
    health_timeout_s: float
    host_mem_gb: float | None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> SimConfig:
        v56 = a.sim_version == "0.5.6"
        device = getattr(a, "device", None) or "cuda"
        cuda_graph = not getattr(a, "disable_cuda_graph", False)
        if v56:
            chunked = a.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL
        else:
            chunked = a.chunked_prefill_size or default_chunked_prefill_v23(a.sim_gpu_total_gb)
        fraction = a.mem_fraction_static
        if fraction is None:
            if v56:
                fraction = default_fraction(a.sim_gpu_total_gb, chunked, a.tp_size)
            else:
                fraction = default_fraction_v23(a.sim_gpu_total_gb, chunked, a.tp_size, cuda_graph=cuda_graph)
        graph_gb = a.sim_graph_gb
        if graph_gb is None:
            graph_gb = a.sim_gpu_total_gb * (1 - SEED_FRACTION) - SEED_HEADROOM_GB
        if not cuda_graph:
            graph_gb = 0.0
        sglang_args = {k: v for k, v in vars(a).items() if not k.startswith("sim_")}
        sglang_args["mem_fraction_static"] = fraction
        sglang_args["chunked_prefill_size"] = chunked
        if not v56 and sglang_args.get("hicache_ratio") is None:
            sglang_args["hicache_ratio"] = 2.0
        fp8 = a.kv_cache_dtype.startswith("fp8")
        return cls(
            sglang_args=sglang_args,
            version=a.sim_version,
            model_path=a.model_path,
            served_model_name=a.served_model_name or a.model_path,
            host=a.host,
            port=a.port,
            tp_size=a.tp_size,
            dp_size=a.dp_size,
            base_gpu_id=a.base_gpu_id,
            fraction=fraction,
            chunked_prefill=chunked,
            max_running=a.max_running_requests or DEFAULT_MAX_RUNNING,
            max_total_tokens=a.max_total_tokens,
            context_len=a.context_length or DEFAULT_CONTEXT_LEN,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN // 2 if fp8 else KV_BYTES_PER_TOKEN,
            hicache_size_gb=a.hicache_size,
            hicache_ratio=a.hicache_ratio if a.hicache_ratio is not None else 2.0,
            hicache=a.enable_hierarchical_cache,
            gpu_dir=a.sim_gpu_dir,
            gpus=a.sim_gpus,
            total_gb=a.sim_gpu_total_gb,
            weights_gb=a.sim_weights_gb,
            graph_gb=graph_gb,
            act_bytes_per_token=a.sim_act_mb_per_token * MIB,
            min_kv_gb=a.sim_min_kv_gb,
            load_s=a.sim_load_s,
            fail=a.sim_fail,
            fail_after_s=a.sim_fail_after_s,
            crash_stamp=a.sim_crash_stamp,
            log_rate=a.sim_log_rate,
            flood=a.sim_flood,
            kernel_log=a.sim_kernel_log,
            memory_events=a.sim_memory_events,
            drain_poll_s=a.sim_drain_poll_s,
            device=device,
            cuda_graph=cuda_graph,
            skip_warmup=bool(getattr(a, "skip_server_warmup", False)),
            health_delay_s=a.sim_health_delay_s,
            health_timeout_s=a.sim_health_timeout_s,
            host_mem_gb=a.sim_host_mem_gb,
            nnodes=a.nnodes,
            node_rank=a.node_rank,
            dist_init_addr=a.dist_init_addr,
        )


# --------------------------------------------------------------------------- memory model


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's GPU memory, the way SGLang's ModelRunner profiles it (all in GiB)."""

    total_gb: float
    free_at_start_gb: float  # the card's free memory before loading (others may hold some)
    weights_gb: float
    fraction: float
    graph_gb: float
    kv_bytes_per_token: int
    max_total_tokens: int | None = None
    slack_from_free: bool = False  # 0.5.23: slack = pre_model_load_memory x (1 - fraction)

    @property
    def avail_after_weights_gb(self) -> float:
        return self.free_at_start_gb - self.weights_gb

    @property
    def profiled_kv_gb(self) -> float:
        """What the static pool leaves for the KV cache: SGLang's ``rest_memory``."""
        base = self.free_at_start_gb if self.slack_from_free else self.total_gb
        return self.avail_after_weights_gb - base * (1 - self.fraction)

    @property
    def minimum_fraction(self) -> float:
        """0.5.23's ``minimum viable = 1 - available/pre``: the fraction where rest_memory hits 0."""
        return 1 - self.avail_after_weights_gb / self.free_at_start_gb

    @property
    def kv_tokens(self) -> int:
        tokens = int(max(0.0, self.profiled_kv_gb) * GIB // self.kv_bytes_per_token)
        return min(tokens, self.max_total_tokens) if self.max_total_tokens else tokens

    @property
    def kv_gb(self) -> float:
        return self.kv_tokens * self.kv_bytes_per_token / GIB

    @property
    def avail_after_pool_gb(self) -> float:
        return self.avail_after_weights_gb - self.kv_gb

    @property
    def headroom_gb(self) -> float:
        """Free memory after CUDA-graph capture: what is left for activations."""
        return self.avail_after_pool_gb - self.graph_gb

    @property
    def held_gb(self) -> float:
        """The static footprint: weights, KV pool and CUDA graphs (activations come on top)."""
        return self.weights_gb + self.kv_gb + self.graph_gb

    def activation_fits(self, activation_bytes: float) -> bool:
        """Whether one batch's activations fit in what graph capture left (else a CUDA OOM).

        PyTorch's caching allocator reuses the peak it already reserved, so a batch needs
        ``activation_bytes`` of headroom in all, whatever came before it.
        """
        return activation_bytes <= self.headroom_gb * GIB


def boundary_fraction(total_gb: float, graph_gb: float, act_bytes_per_token: float, burst_tokens: int, *,
                      free_gb: float | None = None, version: str = DEFAULT_VERSION) -> float:
    """The ``--mem-fraction-static`` above which a prefill batch of ``burst_tokens`` OOMs.

    One rank of the simulator, without ``--max-total-tokens``; ``free_gb`` is the card's free
    memory before loading (the total when nobody else holds any). The headroom left after
    graph capture is ``free - weights - kv - graph`` with SGLang's ``kv = (free - weights) -
    base x (1 - fraction)`` (``base`` is ``free`` in 0.5.23, ``total`` in 0.5.6), so the weights
    cancel: ``headroom = base x (1 - fraction) - graph``, and the batch OOMs when
    ``burst_tokens x act_bytes_per_token > headroom``:

    ``boundary = 1 - (graph + burst x act / GiB) / base``

    Below the boundary the batch fits; above ``boundary + kv_bytes_per_token / (base x
    GiB)`` (under 1e-6: the KV pool is a whole number of tokens) it OOMs. The weights decide only
    whether the server starts at all (``RankMemory.minimum_fraction``). A burst is at most one
    ``--chunked-prefill-size`` chunk: longer prompts are prefilled a chunk at a time.
    """
    base = total_gb if free_gb is None or version == "0.5.6" else free_gb
    return 1 - (graph_gb + burst_tokens * act_bytes_per_token / GIB) / base


# --------------------------------------------------------------------------- log output


def emit(text: str) -> None:
    """Write whole lines to stdout in one go (unbuffered), so other processes don't split them."""
    view = memoryview((text.rstrip("\n") + "\n").encode())
    while view:
        try:
            view = view[os.write(1, view) :]
        except BrokenPipeError:
            return


def log(msg: str, tag: str | None = None) -> None:
    """An SGLang log line: ``[YYYY-mm-dd HH:MM:SS TPn] msg`` (no tag in the main process)."""
    t = time.time()  # wall-clock timestamp, as SGLang's logging prints it
    now = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    if _env_bool("SGLANG_LOG_MS", False):  # SGLang's ``maybe_ms``
        now += f".{int(t * 1000) % 1000:03d}"
    emit(f"[{now} {tag}] {msg}" if tag else f"[{now}] {msg}")


def append_line(path: str | None, line: str) -> None:
    if path:
        with Path(path).open("a") as f:
            f.write(line + "\n")


def read_memory_events(path: str) -> dict[str, int]:
    """A cgroup v2 ``memory.events`` file (``key value`` lines) as a dict; missing keys are 0."""
    counts = dict.fromkeys(MEMORY_EVENTS_KEYS, 0)
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                counts[key] = int(value)
    return counts


def bump_memory_events(path: str) -> None:
    """What the kernel does to the cgroup's ``memory.events`` on an OOM kill: ``oom`` and
    ``oom_kill`` go up by one. Created in the cgroup v2 format if missing; written atomically."""
    counts = read_memory_events(path)
    counts["oom"] += 1
    counts["oom_kill"] += 1
    tmp = Path(path).resolve().parent / f".memory.events.{os.getpid()}"
    tmp.write_text("".join(f"{k} {v}\n" for k, v in counts.items()))
    tmp.replace(path)


def crash_stamp(path: str | None) -> None:
    """Record the moment the simulator causes a death (CLOCK_MONOTONIC is system-wide)."""
    append_line(path, str(time.monotonic_ns()))


def fmt_size(nbytes: float) -> str:
    """Sizes the way PyTorch's caching allocator prints them."""
    if nbytes <= 1024:
        return f"{int(nbytes)} bytes"
    for unit, scale in (("KiB", 1024), ("MiB", MIB)):
        if nbytes <= scale * 1024:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / GIB:.2f} GiB"


def cuda_oom_message(tried: float, gpu: int, total: float, free: float, graph: float) -> str:
    """PyTorch's ``CUDA out of memory`` message for one failed allocation (bytes in)."""
    in_use = max(0.0, total - free)
    reserved_unused = 0.04 * GIB
    return (
        f"CUDA out of memory. Tried to allocate {fmt_size(tried)}. GPU {gpu} has a total capacity of "
        f"{fmt_size(total)} of which {fmt_size(max(free, 0))} is free. Including non-PyTorch memory, "
        f"this process has {fmt_size(in_use)} memory in use. Of the allocated memory "
        f"{fmt_size(max(0.0, in_use - reserved_unused - 0.3 * GIB))} is allocated by PyTorch, with "
        f"{fmt_size(graph)} allocated in private pools (e.g., CUDA Graphs), and "
        f"{fmt_size(reserved_unused)} is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


# --------------------------------------------------------------------------- tracebacks

Frame = tuple[str, int, str, str]  # file, line, function, source line

_SCHED = f"{SGLANG}/managers/scheduler.py"
_WORKER = f"{SGLANG}/managers/tp_worker.py"
_RUNNER = f"{SGLANG}/model_executor/model_runner.py"
_LOADER = f"{SGLANG}/model_loader/loader.py"
_DEEPSEEK = f"{SGLANG}/models/deepseek_v2.py"
_TORCH_CTX: Frame = (f"{TORCH}/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)")

INIT_FRAMES: tuple[Frame, ...] = (
    (_SCHED, 2680, "run_scheduler_process", "scheduler = Scheduler("),
    (_SCHED, 320, "__init__", "self.init_model_worker()"),
    (_SCHED, 475, "init_model_worker", "self.tp_worker = TpModelWorker("),
    (_WORKER, 247, "__init__", "self._model_runner = ModelRunner("),
    (_RUNNER, 330, "__init__", "self.initialize(min_per_gpu_memory)"),
)
DEVICE_FRAMES = INIT_FRAMES[:-1] + (
    (_RUNNER, 318, "__init__", "torch.get_device_module(self.device).set_device(self.gpu_id)"),
    (f"{TORCH}/cuda/__init__.py", 567, "set_device", "torch._C._cuda_setDevice(device)"),
)
LOAD_FRAMES = INIT_FRAMES + (
    (_RUNNER, 420, "initialize", "self.load_model()"),
    (_RUNNER, 842, "load_model", "self.model = get_model("),
    (f"{SGLANG}/model_loader/__init__.py", 28, "get_model", "return loader.load_model("),
)
LOAD_OOM_FRAMES = LOAD_FRAMES + (
    (_LOADER, 594, "load_model", "model = _initialize_model("),
    (_LOADER, 262, "_initialize_model", "return model_class("),
    (_DEEPSEEK, 2870, "__init__", "self.model = DeepseekV2Model("),
    (f"{TORCH}/utils/_device.py", 104, "__torch_function__", "return func(*args, **kwargs)"),
)
LOAD_FILE_FRAMES = LOAD_FRAMES + (
    (_LOADER, 601, "load_model", "self.load_weights_and_postprocess("),
    (_LOADER, 609, "load_weights_and_postprocess", "model.load_weights(weights)"),
    (_DEEPSEEK, 3120, "load_weights", "for name, loaded_weight in weights:"),
    (f"{SGLANG}/model_loader/weight_utils.py", 481, "safetensors_weights_iterator",
     'with safe_open(st_file, framework="pt") as f:'),
)
_SCHED23 = f"{SGLANG}/managers/scheduler.py"
POOL_FRAMES_V23: tuple[Frame, ...] = (
    (_SCHED23, 6362, "run_scheduler_process", "scheduler = Scheduler(server_args, port_args)"),
    (_SCHED23, 568, "__init__", "self.init_model_worker()"),
    (_SCHED23, 1137, "init_model_worker", "self.init_memory_pools()"),
    (_SCHED23, 1090, "init_memory_pools", "self.tp_worker.alloc_memory_pool("),
    (_WORKER, 409, "alloc_memory_pool", "self.model_runner.alloc_memory_pool("),
    (_RUNNER, 982, "alloc_memory_pool", "result = self.kv_cache_configurator.configure("),
    (f"{SGLANG}/mem_cache/kv_cache_configurator.py", 476, "configure",
     "config = self._resolve_memory_pool_config(pre_model_load_memory)"),
    (f"{SGLANG}/mem_cache/kv_cache_configurator.py", 3182, "_resolve_memory_pool_config",
     "available_bytes = self._profile_available_bytes(pre_model_load_memory)"),
    (f"{SGLANG}/mem_cache/kv_cache_configurator.py", 3050, "_profile_available_bytes", "raise ValueError("),
)
POOL_ZERO_FRAMES_V23: tuple[Frame, ...] = POOL_FRAMES_V23[:7] + (
    (f"{SGLANG}/mem_cache/kv_cache_configurator.py", 477, "configure", "return KVCacheConfigResult("),
    ("<string>", 12, "__init__", ""),
    (f"{SGLANG}/model_executor/pool_configurator.py", 99, "__post_init__", "raise RuntimeError(msg)"),
)
CRASH_HOOK_FRAMES: tuple[Frame, ...] = (
    (_SCHED23, 6368, "run_scheduler_process", "scheduler.run_event_loop()"),
    (_SCHED23, 1996, "run_event_loop", "dispatch_event_loop(self)"),
    (f"{SGLANG}/managers/scheduler_components/event_loop_dispatch.py", 41, "dispatch_event_loop",
     "scheduler.event_loop_overlap()"),
    _TORCH_CTX,
    (_SCHED23, 2071, "event_loop_overlap", "self.process_batch_result(tmp_batch, tmp_result)"),
    (_SCHED23, 5092, "process_batch_result", "self.batch_result_processor.process_batch_result_decode(batch, result)"),
    (f"{SGLANG}/managers/scheduler_components/batch_result_processor.py", 1041, "process_batch_result_decode",
     "self.stream_output(batch.reqs, batch.return_logprob)"),
    (_SCHED23, 2481, "<lambda>", "stream_output=lambda *a, **kw: self.output_streamer.stream_output(*a, **kw),"),
    (f"{SGLANG}/managers/scheduler_components/output_streamer.py", 148, "stream_output",
     "self._trigger_crash_for_tests("),
    (f"{SGLANG}/managers/scheduler_components/output_streamer.py", 157, "_trigger_crash_for_tests",
     "raise RuntimeError("),
)
POOL_FRAMES = INIT_FRAMES + (
    (_RUNNER, 447, "initialize", "self.init_memory_pool("),
    (_RUNNER, 1402, "init_memory_pool", "raise RuntimeError("),
)
HOST_POOL_FRAMES = (
    (_SCHED, 2680, "run_scheduler_process", "scheduler = Scheduler("),
    (_SCHED, 338, "__init__", "self.init_cache_with_memory_pool()"),
    (_SCHED, 612, "init_cache_with_memory_pool", "self.tree_cache = HiRadixCache("),
    (f"{SGLANG}/mem_cache/hiradix_cache.py", 63, "__init__",
     "self.token_to_kv_pool_host = MLATokenToKVPoolHost("),
    (f"{SGLANG}/mem_cache/memory_pool_host.py", 86, "__init__", "raise ValueError("),
)
GRAPH_FRAMES = INIT_FRAMES + (
    (_RUNNER, 468, "initialize", "self.init_cuda_graphs()"),
    (_RUNNER, 1734, "init_cuda_graphs", "self.cuda_graph_runner = CudaGraphRunner(self)"),
    (f"{SGLANG}/model_executor/cuda_graph_runner.py", 379, "__init__", "raise Exception("),
)
RUNTIME_FRAMES: tuple[Frame, ...] = (
    (_SCHED, 2706, "run_scheduler_process", "scheduler.event_loop_overlap()"),
    _TORCH_CTX,
    (_SCHED, 1014, "event_loop_overlap", "batch_result = self.run_batch(batch)"),
    (_SCHED, 1985, "run_batch", "batch_result = self.model_worker.forward_batch_generation("),
    (_WORKER, 371, "forward_batch_generation", "logits_output, can_run_cuda_graph = self.model_runner.forward("),
    (_RUNNER, 2070, "forward", "output = self._forward_raw("),
    (_RUNNER, 2115, "_forward_raw", "ret = self.forward_extend("),
    (_RUNNER, 1989, "forward_extend", "return self.model.forward("),
    _TORCH_CTX,
    (_DEEPSEEK, 2919, "forward", "hidden_states = self.model("),
)
STACK_FRAMES: tuple[Frame, ...] = (  # an idle 0.5.23 scheduler, as py-spy shows it
    (_SCHED23, 6368, "run_scheduler_process", ""),
    (_SCHED23, 1996, "run_event_loop", ""),
    (_SCHED23, 2064, "event_loop_overlap", ""),
    (f"{SGLANG}/managers/scheduler_components/request_receiver.py", 118, "recv_requests", ""),
    ("/usr/local/lib/python3.12/dist-packages/zmq/sugar/socket.py", 1080, "recv_pyobj", ""),
)
GRAPH_HINT = (
    "\nPossible solutions:\n"
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
    "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)\n"
    "3. disable torch compile by not using --enable-torch-compile\n"
    "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance loss)\n"
    "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n"
)


def render_traceback(frames: Sequence[Frame], exception: str) -> str:
    """A Python traceback with the given frames, ending in ``exception``."""
    lines = ["Traceback (most recent call last):"]
    for path, lineno, func, code in frames:
        lines += [f'  File "{path}", line {lineno}, in {func}', f"    {code}"]
    return "\n".join([*lines, exception])


class InitFailure(Exception):
    """A scheduler that cannot start: its traceback, and whether it SIGQUITs the parent."""

    def __init__(self, traceback: str, *, sigquit: bool = True) -> None:
        super().__init__(traceback)
        self.traceback = traceback
        self.sigquit = sigquit


# --------------------------------------------------------------------------- ranks and children


@dataclass(frozen=True, slots=True)
class Rank:
    dp: int
    tp: int
    dp_size: int
    gpu: int
    tp_size: int = 1
    v56: bool = True

    @property
    def tag(self) -> str:
        """The log prefix after the time. 0.5.23 (configure_scheduler_process): ``DPn`` when DP
        is on, ``TPn`` only when tp_size > 1, so nothing at TP 1. 0.5.6: ``TPn`` always."""
        if self.v56:
            return f"DP{self.dp} TP{self.tp}" if self.dp_size > 1 else f"TP{self.tp}"
        parts = ([f"DP{self.dp}"] if self.dp_size > 1 else []) + ([f"TP{self.tp}"] if self.tp_size > 1 else [])
        return " ".join(parts)

    @property
    def name(self) -> str:
        return "scheduler" + "".join(f"_{part}" for part in self.tag.split())

    @property
    def title(self) -> str:
        """``sglang::scheduler{prefix.replace(' ', '_')}``: ``sglang::scheduler`` at TP 1 in 0.5.23."""
        return f"sglang::{self.name}"

    @property
    def leader(self) -> bool:
        return self.tp == 0


def plan_ranks(cfg: SimConfig, visible: str | None = None) -> list[Rank]:
    """The ranks and their GPUs. As in CUDA, rank i runs on visible device base + i: with
    ``CUDA_VISIBLE_DEVICES`` (integer indices) that is the i-th listed card, else card i."""
    devices = [int(x) for x in visible.split(",") if x.strip().isdigit()] if visible else []

    def card(n: int) -> int:
        return devices[n] if n < len(devices) else n

    return [
        Rank(dp, tp, cfg.dp_size, card(cfg.base_gpu_id + dp * cfg.tp_size + tp), cfg.tp_size, cfg.version == "0.5.6")
        for dp in range(cfg.dp_size)
        for tp in range(cfg.tp_size)
    ]


@dataclass(slots=True)
class Child:
    pid: int
    name: str
    sock: socket.socket  # the main process's end of the pair
    rank: Rank | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    watch_name: str | None = None  # 0.5.23's SubprocessWatchdog name (scheduler_0, detokenizer), if watched


def _set_pdeathsig(sig: int = int(signal.SIGKILL)) -> None:
    """Die with ``sig`` when the parent dies (Linux prctl PR_SET_PDEATHSIG; 0 clears it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, sig, 0, 0, 0)


TEARDOWN_SIGNAL = signal.SIGUSR2  # main -> child: "you are SIGKILLed" (0.5.23 mode)


def _teardown_handler(ack_fd: int) -> Callable[[int, Any], None]:
    """A SIGKILLed SGLang child takes ~1.5 s to go (it holds GBs of memory; measured on the real
    server): it must not die with its parent (PDEATHSIG), it says so to the parent through
    ``ack_fd``, prints nothing more, and dies by SIGKILL after SGLANG_SIM_CHILD_TEARDOWN_S."""
    def handler(signum: int, frame: Any) -> None:
        _set_pdeathsig(0)
        with contextlib.suppress(OSError):
            os.write(ack_fd, b"k")
        time.sleep(max(0.0, _env_float(ENV_TEARDOWN, 0.0)))
        os.kill(os.getpid(), signal.SIGKILL)
    return handler


def _child_setup(title: str, parent_pid: int, pdeathsig: bool, *, v56: bool = True, ack_fd: int | None = None) -> None:
    setproctitle(title)
    if v56:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # the main process drains and then ends us
    else:  # 0.5.23: schedulers and detokenizer have no SIGTERM handler: a group SIGTERM kills them
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if ack_fd is not None:
            signal.signal(TEARDOWN_SIGNAL, _teardown_handler(ack_fd))
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    if pdeathsig:
        _set_pdeathsig()
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(0)


def _idle_child(sock: socket.socket) -> int:
    """The detokenizer / DP controller: holds its title, exits when its parent goes away."""
    while sock.recv(4096):
        pass
    return 0


# --------------------------------------------------------------------------- the scheduler (child side)


@dataclass(slots=True)
class Req:
    rid: int
    tokens: int
    max_new: int
    arrival: float
    prefill_left: int
    generated: int = 0
    started: bool = False  # part of its prefill is done (a chunked prefill in progress)

    @property
    def kv_tokens(self) -> int:
        """The KV slots it holds once prefilled: its prompt and what it generated so far."""
        return self.tokens + self.generated


class Scheduler:
    """One TP rank: loads, profiles memory, and (rank 0 of a DP group) runs the batches."""

    def __init__(self, cfg: SimConfig, rank: Rank, sock: socket.socket, parent_pid: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.sock = sock
        self.parent_pid = parent_pid
        self.orphan = cfg.fail == "orphan" and rank.leader and rank.dp == 0
        self.mem: RankMemory | None = None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.serving = False
        self.next_decode = 0.0
        self.next_log = 0.0
        self.decode_steps = 0
        self.generated_since_log = 0
        self.last_log_time = time.monotonic()
        self.stream_outputs = 0  # SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS counts these
        self.peak_act_bytes = 0.0  # the largest activation so far: PyTorch's allocator keeps it reserved
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # 0.5.23's NewTokenRatioTracker.current
        self.retracted_pending = 0  # the last retraction's count, for the next metrics report
        self.retracted_total = 0  # sglang:num_retracted_requests_total
        self.metrics = bool(cfg.sglang_args.get("enable_metrics"))
        self.reported_running = self.reported_retracted = 0
        try:
            self.crash_after = int(os.environ.get(ENV_TEST_CRASH) or 0)
        except ValueError:
            self.crash_after = 0

    # -- plumbing

    def log(self, msg: str) -> None:
        log(msg, self.rank.tag or None)

    def send(self, msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def write_gpu(self, held_gb: float) -> None:
        if self.cfg.gpu_dir:
            simgpu.write_process(
                self.cfg.gpu_dir, os.getpid(), {self.rank.gpu: int(held_gb * GIB)}, title=self.rank.title
            )

    def quit_parent(self, traceback: str) -> NoReturn:
        """SGLang's ``except`` in run_scheduler_process: log, SIGQUIT the parent, wait to be killed."""
        self.log(f"Scheduler hit an exception: {traceback}")
        if self.cfg.version != "0.5.6":  # the crash is now, not the tree kill seconds later
            crash_stamp(self.cfg.crash_stamp)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.parent_pid, signal.SIGQUIT)
        if self.cfg.version != "0.5.6" and not self.orphan:
            # 0.5.23: the except/finally of run_scheduler_process end, and the process exits 0
            # (after a moment of cleanup) unless the parent's tree kill comes first.
            time.sleep(0.2)
            os._exit(0)
        while True:  # the parent's tree kill ends us; an orphan keeps holding its memory
            signal.pause()

    def run(self) -> int:
        try:
            self.mem = self.init()
        except InitFailure as e:
            if e.sigquit:
                self.quit_parent(e.traceback)
            self.log(f"Scheduler hit an exception: {e.traceback}")
            return 1
        self.send({"op": "ready", "pid": os.getpid(), **self.facts()})
        code = self.serve() if self.rank.leader else self.follow()
        if self.orphan:  # the parent is gone: keep holding the GPU until someone kills us
            while True:
                signal.pause()
        if self.cfg.gpu_dir and self.cfg.fail != "stuck":
            simgpu.remove_process(self.cfg.gpu_dir, os.getpid())
        return code

    def facts(self) -> dict[str, Any]:
        m = self.mem
        assert m is not None
        return {
            "gpu": self.rank.gpu,
            "title": self.rank.title,
            "weight": round(m.weights_gb, 2),
            "kvcache": round(m.kv_gb, 2),
            "token_capacity": m.kv_tokens,
            "graph": round(m.graph_gb, 2),
            "headroom": round(m.headroom_gb, 2),
            "held_bytes": int(m.held_gb * GIB + self.peak_act_bytes),
        }

    # -- startup

    def free_gb_on_card(self) -> float:
        cfg = self.cfg
        if not cfg.gpu_dir:
            return cfg.total_gb
        cards = {g.index: g for g in simgpu.read_gpus(cfg.gpu_dir)}
        card = cards.get(self.rank.gpu)
        if card is None:
            raise InitFailure(render_traceback(DEVICE_FRAMES, "RuntimeError: CUDA error: invalid device ordinal"))
        return card.free_bytes / GIB

    def total_gb_on_card(self) -> float:
        if not self.cfg.gpu_dir:
            return self.cfg.total_gb
        return next(g.total_bytes for g in simgpu.read_gpus(self.cfg.gpu_dir) if g.index == self.rank.gpu) / GIB

    def init(self) -> RankMemory:
        cfg, v56 = self.cfg, self.cfg.version == "0.5.6"
        self.log("Init torch distributed begin." if v56 else "Init parallel begin.")
        free = self.free_gb_on_card()
        total = self.total_gb_on_card()
        time.sleep(0.02)
        if v56:
            self.log(f"Init torch distributed ends. mem usage={total - free:.2f} GB")
        else:
            self.log("Init parallel ends. elapsed=0.02 s")
            self.log("Memory baseline taken. mem usage=0.00 GB")
        self.log(f"Load weight begin. avail mem={free:.2f} GB")
        time.sleep(cfg.load_s)
        if cfg.fail == "model_load":
            path = f"{cfg.model_path.rstrip('/')}/model-00001-of-000163.safetensors"
            exc = f"FileNotFoundError: [Errno 2] No such file or directory: '{path}'"
            raise InitFailure(render_traceback(LOAD_FILE_FRAMES, exc), sigquit=False)
        if free < cfg.weights_gb:
            tried = 1.75 * GIB
            msg = cuda_oom_message(tried, self.rank.gpu, total * GIB, min(free * GIB, tried / 3), 0)
            raise InitFailure(render_traceback(LOAD_OOM_FRAMES, f"torch.OutOfMemoryError: {msg}"))
        mem = RankMemory(total, free, cfg.weights_gb, cfg.fraction, cfg.graph_gb, cfg.kv_bytes_per_token,
                         cfg.max_total_tokens, slack_from_free=not v56)
        self.write_gpu(mem.weights_gb)
        elapsed = f"elapsed={cfg.load_s:.2f} s, " if not v56 else ""
        dtype = "dtype=torch.bfloat16, " if v56 else ""
        self.log(f"Load weight end. {elapsed}type={MODEL_TYPE}, {dtype}avail mem={mem.avail_after_weights_gb:.2f} GB, "
                 f"mem usage={mem.weights_gb:.2f} GB.")
        if v56 and (cfg.fail == "kv_pool" or mem.profiled_kv_gb < cfg.min_kv_gb):
            exc = ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                   f"Current value: self.server_args.mem_fraction_static={cfg.fraction}")
            raise InitFailure(render_traceback(POOL_FRAMES, exc))
        if not v56:
            self.check_pool_v23(mem)
        half = mem.kv_gb / 2
        kv_dtype = "" if v56 else "dtype: torch.bfloat16, "
        self.log(f"KV Cache is allocated. {kv_dtype}#tokens: {mem.kv_tokens}, K size: {half:.2f} GB, V size: {half:.2f} GB")
        self.log(f"Memory pool end. avail mem={mem.avail_after_pool_gb:.2f} GB")
        self.write_gpu(mem.weights_gb + mem.kv_gb)
        self.alloc_host_pool(mem)
        if cfg.cuda_graph:
            self.capture_graphs(mem)
        self.write_gpu(mem.held_gb)
        if v56 or self.rank.tp == 0:  # 0.5.23 logs the summary on TP rank 0 only
            avail = "available_cpu_mem" if cfg.device == "cpu" else "available_gpu_mem"
            self.log(f"max_total_num_tokens={mem.kv_tokens}, chunked_prefill_size={cfg.chunked_prefill}, "
                     f"max_prefill_tokens=16384, max_running_requests={cfg.max_running}, "
                     f"context_len={cfg.context_len}, {avail}={mem.headroom_gb:.2f} GB")
        return mem

    def check_pool_v23(self, mem: RankMemory) -> None:
        """0.5.23's KV-pool guards (kv_cache_configurator.py, pool_configurator.py).

        ``rest_memory = available - pre x (1 - fraction)``; at or below 0 it is the "Loaded weights
        leave no GPU memory" ValueError naming the minimum viable fraction, a pool of no token at
        all is the older "Not enough memory" RuntimeError. ``--sim-fail kv_pool`` forces the
        ValueError as if the weights needed 0.02 more of the card than the fraction gives.
        """
        cfg = self.cfg
        forced = cfg.fail == "kv_pool"
        if forced or mem.profiled_kv_gb <= 0:
            minimum = min(0.9999, cfg.fraction + 0.02) if forced else mem.minimum_fraction
            suggested = math.ceil(minimum * 1000) / 1000
            exc = ("ValueError: Loaded weights leave no GPU memory for the KV cache under "
                   f"--mem-fraction-static={cfg.fraction}. Raise --mem-fraction-static above {suggested:.3f} "
                   f"(minimum viable = 1 - available/pre = {minimum:.4f}). If using speculative decoding, "
                   "draft weights are now counted.")
            raise InitFailure(render_traceback(POOL_FRAMES_V23, exc))
        if mem.kv_tokens <= 0:
            exc = ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                   f"Current value: mem_fraction_static={cfg.fraction}")
            raise InitFailure(render_traceback(POOL_ZERO_FRAMES_V23, exc))

    def alloc_host_pool(self, mem: RankMemory) -> None:
        cfg = self.cfg
        if not cfg.hicache:
            return
        size_gb = cfg.hicache_size_gb or mem.kv_gb * cfg.hicache_ratio
        index = self.rank.dp * cfg.tp_size + self.rank.tp
        if cfg.host_mem_gb is not None:
            available = cfg.host_mem_gb - index * size_gb  # the ranks before us took theirs
            if size_gb > available - 10:  # SGLang keeps 10 GB for everything else
                exc = (f"ValueError: Not enough host memory available. Requesting {size_gb * GIB / 1e9:.2f} GB "
                       f"but only have {max(available, 0) * GIB / 1e9:.2f} GB free. Please reduce the size "
                       "of the hierarchical cache.")
                raise InitFailure(render_traceback(HOST_POOL_FRAMES, exc))
        if cfg.version == "0.5.6":
            self.log(f"Allocating {size_gb:.2f} GB host memory for hierarchical KV cache.")
        else:
            tokens = int(size_gb * GIB // cfg.kv_bytes_per_token)
            self.log(f"Allocating MLA hierarchical KV host pool: {tokens} tokens, {size_gb:.2f} GB host memory.")

    def capture_graphs(self, mem: RankMemory) -> None:
        cfg = self.cfg
        self.log(f"Capture cuda graph begin. This can take up to several minutes. avail mem={mem.avail_after_pool_gb:.2f} GB")
        capture_s = 0.3 * cfg.load_s
        time.sleep(capture_s)
        if cfg.fail == "startup_oom" or mem.headroom_gb < 0:
            tried = 448 * MIB
            free = max(0.0, min(mem.avail_after_pool_gb * GIB, tried / 4))
            msg = cuda_oom_message(tried, self.rank.gpu, mem.total_gb * GIB, free, mem.graph_gb * GIB * 0.9)
            raise InitFailure(render_traceback(GRAPH_FRAMES, f"Exception: Capture cuda graph failed: {msg}{GRAPH_HINT}"))
        if cfg.version == "0.5.6":
            self.log(f"Capture cuda graph end. Time elapsed: {capture_s:.2f} s. mem usage={mem.graph_gb:.2f} GB. "
                     f"avail mem={mem.headroom_gb:.2f} GB.")
        else:
            self.log(f"Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 24, 32], elapsed={capture_s:.2f} s, "
                     f"mem usage={mem.graph_gb:.2f} GB, avail mem={mem.headroom_gb:.2f} GB.")

    def follow(self) -> int:
        """A TP rank other than 0: runs its leader's batches in real SGLang, so it only follows
        the leader's activation peaks (relayed by the main process) until the socket closes."""
        buf = b""
        while chunk := self.sock.recv(1 << 16):
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if msg["op"] == "peak" and self.mem is not None and msg["bytes"] > self.peak_act_bytes:
                    self.peak_act_bytes = float(msg["bytes"])
                    self.write_gpu(self.mem.held_gb + self.peak_act_bytes / GIB)
        return 0

    # -- serving (leaders only)

    def serve(self) -> int:
        buf = b""
        while True:
            r, _, _ = select.select([self.sock], [], [], self.timeout(time.monotonic()))
            if r:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return 0
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    self.handle(json.loads(line))
            self.step(time.monotonic())

    def timeout(self, now: float) -> float | None:
        deadlines = []
        if self.waiting:
            deadlines.append(self.waiting[0].arrival + BATCH_WINDOW_S)
        if self.running:
            deadlines.append(self.next_decode)
        if self.serving and self.cfg.log_rate > 0:
            deadlines.append(self.next_log)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "req":
            t = int(msg["tokens"])
            self.waiting.append(Req(msg["rid"], t, int(msg["max_new"]), time.monotonic(), max(t, 1)))
        elif op == "info":
            self.send({"op": "info", "rid": msg["rid"], **self.facts()})
        elif op == "serving":
            self.serving = True
            self.next_log = time.monotonic()
        elif op == "fault":
            self.fault(msg["mode"])
        elif op == "peer_lost":
            # a peer node's rank went away: the next collective fails, on either node
            self.quit_parent(PEER_LOST_TRACEBACK.format(addr=msg.get("addr") or "?"))

    def step(self, now: float) -> None:
        if self.serving and self.cfg.log_rate > 0 and now >= self.next_log:
            self.log_decode()
            self.next_log = max(self.next_log + 1 / self.cfg.log_rate, now - 1.0)
        waiting_tokens = sum(r.prefill_left for r in self.waiting)
        if self.waiting and (now >= self.waiting[0].arrival + BATCH_WINDOW_S or waiting_tokens >= self.cfg.chunked_prefill):
            self.prefill()
        if self.running and time.monotonic() >= self.next_decode:
            self.decode()

    def used_tokens(self) -> int:
        return sum(r.kv_tokens for r in self.running)

    def rem_total_tokens(self) -> float:
        """0.5.23's PrefillAdder budget (schedule_policy.py): the free KV slots less what the
        running requests are still expected to need, ``min(max_new - generated, 4096) x
        new_token_ratio`` each. The ratio starts at 0.7 and decays to 0.098, so admission is
        optimistic: when the running requests outgrow it, decode retracts some."""
        assert self.mem is not None
        reserved = sum(min(r.max_new - r.generated, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio for r in self.running)
        return self.mem.kv_tokens - self.used_tokens() - reserved

    def admit(self) -> tuple[int, int, list[Req]]:
        """Take up to a chunk of waiting tokens: (tokens, new sequences, requests fully prefilled).

        A request not yet started is admitted when its prompt and ``min(max_new, 4096)`` fit in
        the budget (``add_one_req``), else prefill waits for running requests to finish. With
        nothing running and nothing admitted it goes in anyway (a request the pool can never
        hold is then aborted at decode, as 0.5.23 aborts the last request it cannot fit).
        """
        budget, seqs, finished = self.cfg.chunked_prefill, 0, []
        rem = self.rem_total_tokens()
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if not req.started:
                need = req.prefill_left + min(max(req.max_new - req.generated, 0), CLIP_MAX_NEW_TOKENS)
                if need > rem and (self.running or seqs):
                    break  # the KV pool is full: wait for running requests to finish
                rem -= need
            req.started = True
            take = min(req.prefill_left, budget)
            req.prefill_left -= take
            budget -= take
            seqs += 1
            if req.prefill_left == 0:
                finished.append(self.waiting.popleft())
        return self.cfg.chunked_prefill - budget, seqs, finished

    def note_activation(self, activation: float) -> None:
        """A batch's activations: a CUDA OOM when they don't fit the headroom; a new peak is
        what the caching allocator now keeps reserved, so the simulated GPU shows it (one
        write per new peak, as NVML would see the process's memory grow)."""
        assert self.mem is not None
        if not self.mem.activation_fits(activation):
            self.runtime_oom(activation)
        if activation > self.peak_act_bytes:
            self.peak_act_bytes = activation
            self.write_gpu(self.mem.held_gb + activation / GIB)
            if self.cfg.tp_size > 1:  # the other TP ranks ran the same batch
                self.send({"op": "peak", "bytes": activation})

    def prefill(self) -> None:
        """Take up to a chunk of waiting tokens into one batch; OOM if its activations don't fit."""
        assert self.mem is not None
        tokens, seqs, finished = self.admit()
        if not tokens:
            return
        usage = (self.used_tokens() + tokens) / max(self.mem.kv_tokens, 1)
        self.log_prefill(seqs, tokens, usage)
        self.note_activation(tokens * self.cfg.act_bytes_per_token)
        time.sleep(tokens * PREFILL_S_PER_TOKEN)
        for req in finished:
            req.generated += 1  # prefill yields the next token (the first, unless it was retracted)
            req.started = False
            self.running.append(req)
        self.next_decode = time.monotonic()
        self.finish([r for r in finished if r.generated >= r.max_new])
        self.stream_output()

    def decode(self) -> None:
        batch = self.update_running_batch()
        for req in batch:
            req.generated += 1
        self.generated_since_log += len(batch)
        self.finish([r for r in batch if r.generated >= r.max_new])
        if any(r.generated % FORCE_STREAM_INTERVAL == 0 for r in self.running):
            self.send({"op": "progress"})  # an output that is not the end: /health sees it too
        self.stream_output()
        self.decode_steps += 1
        if self.decode_steps % DECODE_LOG_INTERVAL == 0:
            self.log_decode()
        elif not self.running:
            self.report_idle()
        self.next_decode = time.monotonic() + DECODE_STEP_S

    def decode_fits(self, reqs: Sequence[Req]) -> bool:
        """0.5.23 ``check_decode_mem`` (page size 1): one free KV slot per request to decode."""
        assert self.mem is not None
        return self.mem.kv_tokens - self.used_tokens() >= len(reqs)

    def update_running_batch(self) -> list[Req]:
        """0.5.23 ``Scheduler.update_running_batch``: the requests this decode step advances.

        Requests whose next token ends them are left out of the check. When the others' next
        tokens do not fit the KV pool: if some are finishing, only those step (their KV frees);
        else some are retracted to the queue. Otherwise the new-token ratio decays a step.
        """
        finishing = [r for r in self.running if r.generated + 1 >= r.max_new]
        staying = [r for r in self.running if r.generated + 1 < r.max_new]
        if self.decode_fits(staying):
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
            return list(self.running)
        if finishing:
            return finishing
        self.retract()
        return list(self.running)

    def retract(self) -> None:
        """0.5.23 ``ScheduleBatch.retract_decode`` and the warning after it (scheduler.py).

        The request with the fewest output tokens (then the longest prompt) goes first, then the
        next, until the rest fit; at least one goes and at least one stays. A last request that
        still does not fit is aborted. Retracted requests free their KV and go back to the queue,
        to be prefilled again (prompt and output so far); the ratio is re-estimated from those
        left: ``min(1, (decoded + 20 x n) / (sum of max_new + 1))``.
        """
        assert self.mem is not None
        old_available = self.mem.kv_tokens - self.used_tokens()
        old_ratio = self.new_token_ratio
        keep = sorted(self.running, key=lambda r: (r.generated, -r.tokens), reverse=True)
        retracted: list[Req] = []
        while len(keep) > 1:
            retracted.append(keep.pop())
            self.running.remove(retracted[-1])
            if self.decode_fits(keep):
                break
        if len(keep) == 1 and not self.decode_fits(keep):
            last = keep.pop()
            self.running.remove(last)
            self.log(f"retract_decode: aborted last request {last.rid} due to OOM")
            self.send({"op": "done", "rid": last.rid, "prompt_tokens": last.tokens, "completion_tokens": last.generated,
                       "abort": "Out of memory even after retracting all other requests in the decode batch. "
                                "Aborting the last request."})
        self.new_token_ratio = min(1.0, (sum(r.generated for r in self.running) + RETRACT_DECODE_STEPS * len(self.running))
                                   / (sum(r.max_new for r in self.running) + 1))
        gained = self.mem.kv_tokens - self.used_tokens() - old_available
        self.retracted_pending = len(retracted)
        self.retracted_total += len(retracted)
        if self.metrics and retracted:  # the counter goes up at once; the gauges wait for a report
            self.send({"op": "metrics", "retracted_total": self.retracted_total})
        self.log(f"KV cache pool is full. Retract requests. #retracted_reqs: {len(retracted)}, "
                 f"#new_tokens_gained: {gained}, #new_token_ratio: {old_ratio:.4f} -> {self.new_token_ratio:.4f}")
        for req in retracted:
            req.prefill_left, req.started = req.kv_tokens, False
            self.waiting.append(req)

    def stream_output(self) -> None:
        """SGLang's OutputStreamer.stream_output, once per processed batch, with its test hook."""
        if self.crash_after <= 0:
            return
        self.stream_outputs += 1
        if self.stream_outputs >= self.crash_after:
            exc = f"RuntimeError: Test crash after stream_output called {self.stream_outputs} times"
            self.quit_parent(render_traceback(CRASH_HOOK_FRAMES, exc))

    def finish(self, done: list[Req]) -> None:
        for req in done:
            self.running.remove(req)
            self.send({"op": "done", "rid": req.rid, "prompt_tokens": req.tokens, "completion_tokens": req.generated})

    def report_metrics(self, *, idle: bool = False) -> None:
        """0.5.23 metrics_reporter: the scheduler's gauges, set at each batch log line
        (``report_prefill_stats`` / ``report_decode_stats``). ``num_retracted_reqs`` is the last
        retraction's count, reported once, then 0; an idle report leaves it as it was."""
        if not self.metrics or self.mem is None:
            return
        if not idle:
            self.reported_retracted, self.retracted_pending = self.retracted_pending, 0
        self.reported_running = len(self.running)
        self.send({"op": "metrics", "retracted_total": self.retracted_total, "gauges": {
            "token_usage": round(self.used_tokens() / max(self.mem.kv_tokens, 1), 2),  # pool_stats_observer.py 155
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting),
            "num_retracted_reqs": self.reported_retracted,
        }})

    def report_idle(self) -> None:
        """0.5.23 ``_maybe_log_idle_metrics``: once idle, a stale running-requests gauge is
        refreshed at once. (Its 30 s periodic idle refresh is not modelled.)"""
        if self.reported_running != len(self.running):
            self.report_metrics(idle=True)

    def log_decode(self) -> None:
        now = time.monotonic()
        throughput = self.generated_since_log / max(now - self.last_log_time, 1e-6)
        self.generated_since_log, self.last_log_time = 0, now
        capacity = self.mem.kv_tokens if self.mem else 1
        used = self.used_tokens()
        self.report_metrics()
        if self.cfg.version == "0.5.6":
            self.log(f"Decode batch. #running-req: {len(self.running)}, #token: {used}, token usage: {used / max(capacity, 1):.2f}, "
                     f"cuda graph: True, gen throughput (token/s): {throughput:.2f}, #queue-req: {len(self.waiting)}, ")
            return
        self.log(f"Decode batch, #running-req: {len(self.running)}, #token: {used}, token usage: {used / max(capacity, 1):.2f}, "
                 f"{self.graph_word()}: {self.cfg.cuda_graph}, gen throughput (token/s): {throughput:.2f}, "
                 f"#queue-req: {len(self.waiting)}, ")

    def graph_word(self) -> str:
        return "cpu graph" if self.cfg.device == "cpu" else "cuda graph"

    def log_prefill(self, seqs: int, tokens: int, usage: float) -> None:
        """0.5.6: ``Prefill batch. #new-seq: ...``; 0.5.23 (metrics_reporter.py): ``Prefill batch, ...``
        with ``#pending-token``, the graph flag and the input throughput."""
        self.report_metrics()
        if self.cfg.version == "0.5.6":
            self.log(f"Prefill batch. #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, "
                     f"token usage: {usage:.2f}, #running-req: {len(self.running)}, #queue-req: {len(self.waiting)}, ")
            return
        self.log(f"Prefill batch, #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, token usage: {usage:.2f}, "
                 f"#running-req: {len(self.running)}, #queue-req: {len(self.waiting)}, #pending-token: 0, "
                 f"{self.graph_word()}: False, input throughput (token/s): {tokens / (tokens * PREFILL_S_PER_TOKEN + BATCH_WINDOW_S):.2f}")

    # -- failures

    def runtime_oom(self, tried: float) -> NoReturn:
        assert self.mem is not None
        m = self.mem
        msg = cuda_oom_message(tried, self.rank.gpu, m.total_gb * GIB, m.headroom_gb * GIB, m.graph_gb * GIB)
        self.quit_parent(render_traceback(RUNTIME_FRAMES, f"torch.OutOfMemoryError: {msg}"))

    def fault(self, mode: str) -> None:
        assert self.mem is not None
        if mode == "host_oom":
            self.host_oom()
        # runtime_oom / orphan / stuck: a full chunk arrives, as if load had come
        tokens = self.cfg.chunked_prefill
        self.log_prefill(max(1, tokens // 512), tokens, 0.0)
        self.runtime_oom(max(tokens * self.cfg.act_bytes_per_token, (self.mem.headroom_gb + 0.25) * GIB))

    def host_oom(self) -> NoReturn:
        """The kernel OOM killer takes this scheduler: no traceback, just SIGKILL.

        The evidence a real OOM kill leaves, where asked for: a kernel-log line in
        ``--sim-kernel-log`` / SGLANG_SIM_KERNEL_LOG, and ``oom``/``oom_kill`` bumped in the
        cgroup v2 ``memory.events`` file named by ``--sim-memory-events`` /
        SGLANG_SIM_MEMORY_EVENTS. Without either it is a bare SIGKILL, which nothing tells
        apart from any other ``kill -9``.
        """
        vm_kb = int(self.cfg.total_gb * 1.9 * 1024 * 1024)
        rss_kb = int(self.cfg.hicache_size_gb * 1024 * 1024 + 20 * 1024 * 1024)
        comm = self.rank.title[:15]  # what the kernel prints: /proc/PID/comm, 15 characters
        append_line(
            self.cfg.kernel_log,
            f"[{time.monotonic():12.6f}] Out of memory: Killed process {os.getpid()} ({comm}) "
            f"total-vm:{vm_kb}kB, anon-rss:{rss_kb}kB, file-rss:81920kB, shmem-rss:0kB, UID:{os.getuid()} "
            f"pgtables:{rss_kb // 512}kB oom_score_adj:0",
        )
        if self.cfg.memory_events:
            bump_memory_events(self.cfg.memory_events)
        # 0.5.6: nobody notices until /health times out; 0.5.23: the crash is this death, not the
        # tree kill that follows seconds later. Either way: stamp now.
        crash_stamp(self.cfg.crash_stamp)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


# --------------------------------------------------------------------------- the main process


class Launcher:
    """Forks the children and owns every way the main process dies."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.phase = "launch"  # -> "serving" once HTTP is up (SGLang's running-phase handler)
        self.skip_pids: set[int] = set()  # the orphan survives the tree kill
        self.v56 = cfg.version == "0.5.6"
        self.ack_r, self.ack_w = (-1, -1) if self.v56 else os.pipe()  # children's teardown acks
        self.monitor_stopped = False  # SGLang stops its SubprocessWatchdog before a tree kill
        self.peer_fds: list[int] = []  # --nnodes: the sockets to the other nodes (our "gloo pairs")

    def fork(self, name: str, title: str, target: Callable[[socket.socket], int], *, pdeathsig: bool = True,
             rank: Rank | None = None) -> Child:
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # child: never returns into the parent's code
            code = 1
            try:
                for c in self.children:
                    c.sock.close()
                ours.close()
                _child_setup(title, parent, pdeathsig, v56=self.v56, ack_fd=None if self.v56 else self.ack_w)
                code = target(theirs)
            finally:
                os._exit(code)
        theirs.close()
        child = Child(pid, name, ours, rank)
        self.children.append(child)
        return child

    def spawn(self) -> None:
        cfg = self.cfg
        parent = os.getpid()
        if cfg.dp_size > 1:
            self.fork("data_parallel_controller", "sglang::data_parallel_controller", _idle_child)
        for rank in plan_ranks(cfg, os.environ.get("CUDA_VISIBLE_DEVICES")):
            orphan = cfg.fail == "orphan" and rank.leader and rank.dp == 0

            def target(sock: socket.socket, rank: Rank = rank) -> int:
                return Scheduler(cfg, rank, sock, parent).run()

            child = self.fork(rank.name, rank.title, target, pdeathsig=not orphan, rank=rank)
            if orphan:
                self.skip_pids.add(child.pid)
        self.fork("detokenizer", "sglang::detokenizer", _idle_child)
        # 0.5.23 watches ``scheduler_{i}`` for each process it started for the schedulers (the DP
        # controller alone when dp > 1: the schedulers are its children there, so their deaths
        # go unseen) and ``detokenizer``.
        watched = [c for c in self.children if c.name == "data_parallel_controller"] or self.schedulers
        for i, c in enumerate(watched):
            c.watch_name = f"scheduler_{i}"
        self.children[-1].watch_name = "detokenizer"

    @property
    def schedulers(self) -> list[Child]:
        return [c for c in self.children if c.rank is not None]

    def close_peers(self) -> None:
        """Our ranks are going: the other nodes' collectives fail at once (their gloo pairs
        see the reset when our scheduler dies, not when our main process is done)."""
        for fd in self.peer_fds:
            with contextlib.suppress(OSError):
                dup = socket.socket(fileno=os.dup(fd))
                dup.shutdown(socket.SHUT_RDWR)
                dup.close()
        self.peer_fds.clear()

    def on_sigquit(self, signum: int, frame: object) -> None:
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # other ranks may SIGQUIT us too: die once
        self.close_peers()
        if self.v56:
            if self.phase == "launch":
                log("Received sigquit from a child process. It usually means the child failed.")
            else:
                log(f"SIGQUIT received. signum={signum}, frame={FRAME_REPR}. It usually means one child failed.")
            self.die(None)
        if self.phase == "launch":  # engine.py's launch_phase_sigquit_handler
            log("Received sigquit from a child process. It usually means the child failed.")
        else:  # tokenizer_manager.py's running_phase_sigquit_handler (loop.add_signal_handler: no args)
            log("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
            self.monitor_stopped = True
            self.crash_diagnostics()
        self.kill_process_tree(include_parent=True)

    def live_schedulers(self) -> list[psutil.Process]:
        """cudacore_pyspy_dump_utils.collect_scheduler_processes: live ``sglang::scheduler*`` descendants."""
        out = []
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline()).startswith("sglang::scheduler"):
                        out.append(p)
        return out

    def crash_diagnostics(self) -> None:
        """0.5.23's dump_requests_before_crash: with SGLANG_PYSPY_DUMP_BEFORE_CRASH or
        SGLANG_CUDA_COREDUMP_BEFORE_CRASH on (both default on), sleep 5 s, then py-spy the live
        schedulers and ask for CUDA coredumps, waiting SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS
        (60 s) for them. With both off it returns at once. This blocks the event loop, as in SGLang."""
        pyspy = _env_bool(ENV_PYSPY, True)
        coredump = _env_bool(ENV_COREDUMP, True)
        if not (pyspy or coredump):  # (--crash-dump-folder's request dump is not simulated)
            return
        log("Sleeping 5 seconds before crash diagnostics to let GPU activity settle.")
        time.sleep(max(0.0, _env_float(ENV_DIAG_SLEEP, 5.0)))
        procs = self.live_schedulers()
        if not procs:
            log("No live scheduler processes found; skipping py-spy and CUDA coredump.")
            return
        if pyspy:
            for p in procs:
                self.pyspy_dump(p)
        if coredump:
            if os.environ.get("CUDA_ENABLE_USER_TRIGGERED_COREDUMP") != "1":
                log("CUDA user-triggered coredump is not enabled. Set CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 "
                    "before CUDA initialization.")
            for p in procs:
                pipe = Path.cwd() / f"corepipe.cuda.{socket.gethostname()}.{p.pid}"
                log(f"CUDA coredump pipe not found for PID {p.pid}: {pipe}. Ensure "
                    "CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 was set before this process initialized CUDA.")
            wait_s = _env_float(ENV_COREDUMP_WAIT, 60.0)
            if wait_s > 0:
                log(f"Waiting {wait_s:.1f} seconds for CUDA coredumps before exiting.")
                time.sleep(wait_s)

    def pyspy_dump(self, p: psutil.Process) -> None:
        """py-spy's stack dump of one scheduler, as SGLang logs it; its failure when py-spy is absent."""
        for attempt, flag in enumerate(["--native", ""]):
            cmd = f"py-spy dump {flag} --pid {p.pid}".replace("  ", " ")
            if shutil.which("py-spy") is None:
                log(f"Pyspy failed ({cmd}). Error: /bin/sh: 1: py-spy: not found\n")
                if attempt == 1:
                    log(f"All pyspy dump attempts failed for PID {p.pid}.")
                continue
            title = " ".join(p.cmdline()).strip()
            stack = "\n".join(f"    {func} ({path.rsplit('/', 1)[-1]}:{line})"
                              for path, line, func, _ in reversed(STACK_FRAMES))
            log(f"Pyspy dump for PID {p.pid} ({cmd}):\nProcess {p.pid}: {title}\n"
                f"Python v3.12.3 (/usr/bin/python3.12)\n\nThread {p.pid} (idle): \"MainThread\"\n{stack}\n")
            return

    def kill_process_tree(self, *, include_parent: bool, stamp: bool = False, teardown: bool = True) -> None:
        """0.5.23's kill_process_tree(os.getpid(), include_parent): log the call, SIGKILL every
        descendant, then SIGKILL ourselves at once (exit status -9), or, without the parent,
        wait until the children are reaped and return. With ``teardown`` the children take
        SGLANG_SIM_CHILD_TEARDOWN_S (default 0) to go; without, they go at once (what the real CPU
        server's drain and port-clash exits show)."""
        pid = os.getpid()
        log(f"kill_process_tree called: parent_pid={pid}, include_parent={include_parent}, pid={pid}")
        self.kill_children(teardown=teardown)
        if stamp:
            crash_stamp(self.cfg.crash_stamp)
        if include_parent:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("unreachable")
        self.reap(_env_float(ENV_TEARDOWN, 0.0) + REAP_WAIT_S)

    def kill_children(self, *, teardown: bool = True) -> None:
        """SGLang's kill_process_tree: SIGKILL every descendant (but an orphan), then reap them.

        0.5.23 mode: a SIGKILLed SGLang child takes ~1.5 s to go (measured), so each one is told
        instead (TEARDOWN_SIGNAL): it stops PDEATHSIG, acknowledges, and dies 1.5 s later. We
        return once they all acknowledged, without waiting for them.
        """
        if self.v56 or not teardown:
            with contextlib.suppress(psutil.Error):
                for p in psutil.Process().children(recursive=True):
                    if p.pid not in self.skip_pids:
                        with contextlib.suppress(psutil.Error):
                            p.kill()
            self.reap(REAP_WAIT_S)
            return
        told = 0
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process().children(recursive=True):
                if p.pid in self.skip_pids:
                    continue
                with contextlib.suppress(psutil.Error):
                    if p.status() == psutil.STATUS_ZOMBIE:
                        continue
                    if p.ppid() == os.getpid() and any(c.pid == p.pid for c in self.children):
                        p.send_signal(TEARDOWN_SIGNAL)
                        told += 1
                    else:  # not one of ours (a grandchild): plain SIGKILL
                        p.kill()
        deadline = time.monotonic() + 1.0
        acks = 0
        while acks < told and time.monotonic() < deadline:
            ready, _, _ = select.select([self.ack_r], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                acks += len(os.read(self.ack_r, 64))

    def reap(self, timeout: float) -> None:
        _reap({c.pid for c in self.children} - self.skip_pids, timeout, 0.01)

    def die(self, code: int | None, *, stamp: bool = True) -> NoReturn:
        """Kill the tree and end: ``code=None`` SIGKILLs ourselves, like SGLang (exit status -9)."""
        if not self.v56:
            if code is None:
                self.kill_process_tree(include_parent=True, stamp=stamp)
            pid = os.getpid()
            log(f"kill_process_tree called: parent_pid={pid}, include_parent=False, pid={pid}")
            self.kill_children()
            self.reap(_env_float(ENV_TEARDOWN, 0.0) + REAP_WAIT_S)
            if stamp:
                crash_stamp(self.cfg.crash_stamp)
            os._exit(code or 0)
        self.kill_children()
        if stamp:
            crash_stamp(self.cfg.crash_stamp)
        if code is None:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code or 0)

    def wait_schedulers_gone(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until no scheduler is alive, reaping the ones that exited."""
        _reap({c.pid for c in self.schedulers} - self.skip_pids, timeout, 0.05)

    def close_children(self) -> None:
        """A clean end: close the pipes so children exit on their own (and free their GPU files)."""
        for c in self.children:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        self.reap(REAP_WAIT_S)
        self.kill_children()

    def segfault(self) -> NoReturn:
        crash_stamp(self.cfg.crash_stamp)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in someone's cwd
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
        raise AssertionError("unreachable")


# 0.5.23's scheduler metrics the simulator serves (srt/observability/metrics_collector.py):
# (name, type, documentation, key in the scheduler's report).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCHEDULER_METRICS = (
    ("sglang:num_running_reqs", "gauge", "The number of running requests.", "num_running_reqs"),
    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", "num_queue_reqs"),
    ("sglang:token_usage", "gauge", "The token usage.", "token_usage"),
    ("sglang:num_retracted_reqs", "gauge", "The number of retracted requests.", "num_retracted_reqs"),
    ("sglang:num_retracted_requests_total", "counter", "Total number of retracted requests.", "retracted_total"),
)


def _go_float(value: float) -> str:
    """prometheus_client's ``floatToGoString`` (finite values): ``3.0``, ``0.25``, ``1.234567e+06``."""
    d = float(value)
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def prometheus_text(cfg: SimConfig, reports: dict[int, dict[str, Any]]) -> str:
    """``GET /metrics`` as 0.5.23 exposes its scheduler metrics: one series per DP group's TP-0
    scheduler, labels ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``
    (and ``dp_rank`` under DP). A labelled series appears once set: the gauges at the first
    batch report, the retraction counter at the first retraction. The real page has many more
    metrics (the tokenizer's histograms, ...); only these are simulated."""
    out: list[str] = []
    for name, kind, doc, key in SCHEDULER_METRICS:
        lines = []
        for dp, report in sorted(reports.items()):
            if key not in report or (kind == "counter" and not report[key]):
                continue
            labels = {"engine_type": "unified", "model_name": cfg.served_model_name, "moe_ep_rank": "0",
                      "pp_rank": "0", "tp_rank": "0", **({"dp_rank": str(dp)} if cfg.dp_size > 1 else {})}
            labelstr = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{name}{{{labelstr}}} {_go_float(report[key])}\n")
        if lines:  # the multiprocess collector shows a metric only once it has a sample
            out += [f"# HELP {name} {doc}\n", f"# TYPE {name} {kind}\n", *lines]
    return "".join(out)


def _words(n: int) -> str:
    vocab = ("the", "model", "answers", "with", "some", "tokens", "of", "text")
    return " ".join(vocab[i % len(vocab)] for i in range(n))


def _count_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    raise ValueError("a prompt is a string or a list of token ids")


def _prompts(value: Any) -> tuple[list[Any], bool]:
    """The prompts of a request and whether it was a single one."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return [value], True
    if isinstance(value, list) and value:
        return value, False
    raise ValueError("no prompt in the request")


class Frontend:
    """The main process's HTTP server and tokenizer manager: routes requests to the schedulers."""

    def __init__(self, cfg: SimConfig, launcher: Launcher) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.state = "launching"  # -> warmup -> serving -> draining
        self.peer_writers: list[asyncio.StreamWriter] = []  # --nnodes: kept open while we run
        self.hung = False
        self.inflight = 0
        self.inflight_rids: set[str] = set()  # 0.5.23's rid_to_state keys, for the drain log
        self.gracefully_exit = False
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.rids = itertools.count(1)
        self.writers: dict[int, asyncio.StreamWriter] = {}  # scheduler pid -> writer
        self.events: asyncio.Queue[tuple[str, Child, dict[str, Any]]] = asyncio.Queue()
        self.progress = asyncio.Event()  # pulsed at each output of a scheduler: an end, or 50 more tokens
        self.leaders = [c for c in launcher.schedulers if c.rank and c.rank.leader]
        self.next_leader = itertools.cycle(range(len(self.leaders)))
        self.tasks: set[asyncio.Task[Any]] = set()
        self.metrics: dict[int, dict[str, Any]] = {}  # DP rank -> its leader's last metrics report

    # -- scheduler pipes

    def spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def connect(self) -> None:
        for child in self.launcher.schedulers:
            reader, writer = await asyncio.open_unix_connection(sock=child.sock)
            self.writers[child.pid] = writer
            self.spawn_task(self.read_from(child, reader))

    async def read_from(self, child: Child, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while line := await reader.readline():
                msg = json.loads(line)
                if msg["op"] == "ready":
                    await self.events.put(("ready", child, msg))
                elif msg["op"] == "peak" and child.rank is not None:  # to the leader's TP peers
                    for peer in self.launcher.schedulers:
                        if peer.rank and peer.rank.dp == child.rank.dp and peer is not child:
                            self.send(peer, msg)
                elif msg["op"] == "metrics" and child.rank is not None:
                    seen = self.metrics.setdefault(child.rank.dp, {})
                    seen["retracted_total"] = msg["retracted_total"]
                    seen.update(msg.get("gauges", {}))
                elif (fut := self.pending.get(msg.get("rid", -1))) and not fut.done():
                    fut.set_result(msg)
                if msg["op"] in ("done", "progress"):
                    self.progress.set()
                    self.progress = asyncio.Event()
        await self.events.put(("eof", child, {}))

    def send(self, child: Child, msg: dict[str, Any]) -> None:
        writer = self.writers.get(child.pid)
        if writer is not None and not writer.is_closing():
            writer.write(json.dumps(msg).encode() + b"\n")

    def submit(self, op: str, leader: Child, **fields: Any) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        rid = next(self.rids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.send(leader, {"op": op, "rid": rid, **fields})
        return rid, fut

    async def call(self, op: str, leader: Child, **fields: Any) -> dict[str, Any]:
        rid, fut = self.submit(op, leader, **fields)
        try:
            return await fut
        finally:
            self.pending.pop(rid, None)

    # -- launch

    async def wait_ready(self) -> None:
        """Wait for every scheduler's ready message; a scheduler gone before that ends the launch."""
        ready: set[int] = set()
        while len(ready) < len(self.launcher.schedulers):
            kind, child, msg = await self.events.get()
            if kind == "ready":
                child.facts = msg
                ready.add(child.pid)
            elif child.pid not in ready:
                self.scheduler_died_at_launch(child)

    def exit_with_traceback(self, traceback: str, *, before: Callable[[], None]) -> NoReturn:
        """An exception out of launch_server: its ``finally`` runs first, then Python prints the
        traceback and exits 1."""
        before()
        emit(traceback)
        crash_stamp(self.cfg.crash_stamp)
        os._exit(1)

    def scheduler_died_at_launch(self, child: Child) -> NoReturn:
        index = self.launcher.schedulers.index(child)
        _, status = os.waitpid(child.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if self.cfg.version != "0.5.6":  # engine.py's _scheduler_died_error, raised out of launch_server
            self.exit_with_traceback(render_traceback(
                [(f"{SGLANG}/entrypoints/http_server.py", 2893, "launch_server",
                  "tokenizer_manager, template_manager, port_args, scheduler_init_result, subprocess_watchdog = ("),
                 (f"{SGLANG}/entrypoints/engine.py", 1349, "_launch_subprocesses", "scheduler_init_result.wait_for_ready()"),
                 (f"{SGLANG}/entrypoints/engine.py", 995, "wait_for_ready",
                  "infos = _wait_for_scheduler_ready(scheduler_pipe_readers, scheduler_procs)"),
                 (f"{SGLANG}/entrypoints/engine.py", 2029, "_wait_for_scheduler_ready",
                  "raise _scheduler_died_error(i, scheduler_procs[i])")],
                f"RuntimeError: Rank {index} scheduler died during initialization (exit code: {code}). "
                "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer. "
                "Run `dmesg -T | grep -i oom` to check.",
            ), before=lambda: self.launcher.kill_process_tree(include_parent=False))
        log(f"Rank {index} scheduler is dead. Please check if there are relevant logs.")
        log(f"Exit code: {code}")
        emit(render_traceback(
            [(f"{SGLANG}/entrypoints/http_server.py", 1410, "launch_server",
              "tokenizer_manager, template_manager, scheduler_info = _launch_subprocesses("),
             (f"{SGLANG}/entrypoints/engine.py", 861, "_launch_subprocesses",
              "data = scheduler_pipe_readers[i].recv()"),
             ("/usr/lib/python3.12/multiprocessing/connection.py", 430, "_recv_bytes", "buf = self._recv(4)"),
             ("/usr/lib/python3.12/multiprocessing/connection.py", 399, "_recv", "raise EOFError")],
            "EOFError",
        ))
        self.launcher.die(1)

    # -- HTTP

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self.access_log], client_max_size=64 * MIB)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/metrics", self.prometheus)
        if self.cfg.version != "0.5.6":
            r.add_post("/freeze_gc", self.freeze_gc)
        if self.cfg.version != "0.5.6":
            r.add_get("/ready", self.ready)
        return app

    @web.middleware
    async def access_log(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        try:
            resp: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            self.log_access(request, exc)
            raise
        self.log_access(request, resp)
        return resp

    @staticmethod
    def log_access(request: web.Request, resp: web.StreamResponse) -> None:
        """Uvicorn's access line, which SGLang keeps on."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        who = f"{peer[0]}:{peer[1]}" if peer else "-"
        v = request.version
        log(f'INFO:     {who} - "{request.method} {request.path_qs} HTTP/{v.major}.{v.minor}" {resp.status} {resp.reason}')

    async def gate(self) -> None:
        """A hung server accepts connections and never answers."""
        if self.hung:
            await asyncio.Event().wait()

    async def health(self, request: web.Request) -> web.Response:
        await self.gate()
        if self.state == "draining" and self.cfg.version != "0.5.6":
            log("Health check request received during shutdown. Returning 503.")
            return web.Response(status=503)
        if self.state != "serving":
            return web.Response(status=503)
        started = time.monotonic()
        rid, fut = self.submit("req", self.leaders[0], tokens=1, max_new=1)
        progress = asyncio.ensure_future(self.progress.wait())
        waiters: set[asyncio.Future[Any]] = {fut, progress}
        try:  # like SGLang: any output from the scheduler while we wait proves it is alive
            done, _ = await asyncio.wait(waiters, timeout=self.cfg.health_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            progress.cancel()
            self.pending.pop(rid, None)
        await self.gate()
        if not done:
            now = time.time()  # wall-clock timestamps, as in SGLang's message
            log(f"Health check failed. Server couldn't get a response from detokenizer for last 20 seconds. "
                f"tic start time: {now - self.cfg.health_timeout_s:.2f}. last_heartbeat time: {now - 25:.2f}")
            return web.Response(status=503)
        await asyncio.sleep(max(0.0, self.cfg.health_delay_s - (time.monotonic() - started)))
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        await self.gate()
        return web.Response(status=200 if self.state == "serving" else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        await self.gate()
        facts = await self.call("info", self.leaders[0])
        memory = {k: facts[k] for k in ("weight", "kvcache", "token_capacity", "graph")}
        return web.json_response({
            **self.cfg.sglang_args,
            "version": self.cfg.version,
            "max_total_num_tokens": facts["token_capacity"],
            "memory_usage": memory,
            "internal_states": [{"memory_usage": memory, "last_gen_throughput": 0.0,
                                 "available_gpu_mem": facts["headroom"]}],
        })

    async def prometheus(self, request: web.Request) -> web.Response:
        """``--enable-metrics``: the scheduler gauges in Prometheus text (prometheus_client
        0.26's ``generate_latest``: labels sorted, values as Go floats). Without the flag the
        real server has no such route: FastAPI's 404 ``{"detail":"Not Found"}``."""
        if not self.cfg.sglang_args.get("enable_metrics"):
            return web.Response(status=404, text='{"detail":"Not Found"}', content_type="application/json")
        await self.gate()
        return web.Response(body=prometheus_text(self.cfg, self.metrics).encode(),
                            headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.cfg.model_path, "tokenizer_path": self.cfg.model_path,
                                  "is_generation": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.served_model_name, "object": "model", "created": int(time.time()),  # wall-clock timestamp (OpenAI field)
            "owned_by": "sglang", "root": self.cfg.model_path, "max_model_len": self.cfg.context_len}]})

    async def freeze_gc(self, request: web.Request) -> web.Response:
        await self.gate()
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.gate()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    async def complete(self, prompt: Any, max_new: int) -> dict[str, Any]:
        """One prompt through a scheduler: prefill (batched with others), then decode."""
        tokens = _count_tokens(prompt)
        if tokens + max_new > self.cfg.context_len:
            raise web.HTTPBadRequest(text=json.dumps({"error": {"message": (
                f"The input ({tokens} tokens) is longer than the model's context length "
                f"({self.cfg.context_len} tokens).")}}), content_type="application/json")
        leader = self.leaders[next(self.next_leader)]
        done = await self.call("req", leader, tokens=tokens, max_new=max_new)
        if done.get("abort"):  # FINISH_ABORT with status 500
            raise web.HTTPInternalServerError(text=json.dumps({"error": {"message": done["abort"]}}),
                                              content_type="application/json")
        return {"text": " " + _words(done["completion_tokens"]), "prompt_tokens": done["prompt_tokens"],
                "completion_tokens": done["completion_tokens"]}

    async def run_prompts(self, request: web.Request, key: str, max_new_of: Callable[[dict[str, Any]], int]
                          ) -> tuple[list[dict[str, Any]], bool] | web.Response:
        """Shared by /generate and /v1/completions: parse, refuse while draining, run every prompt.

        A request counts as in flight from arrival, so one stuck in a hung server keeps a
        SIGTERM drain waiting forever, as in SGLang.
        """
        self.inflight += 1
        rid = uuid.uuid4().hex
        self.inflight_rids.add(rid)
        try:
            await self.gate()
            if self.state == "draining" and self.cfg.version == "0.5.6":
                return web.json_response({"error": {"message": "The server is shutting down."}}, status=503)
            try:
                body = await request.json()
                prompts, single = _prompts(body.get(key, body.get("input_ids")))
                max_new = int(max_new_of(body))
            except (ValueError, TypeError, AttributeError) as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            results = await asyncio.gather(*(self.complete(p, max_new) for p in prompts))
            await self.gate()
            return results, single
        finally:
            self.inflight -= 1
            self.inflight_rids.discard(rid)

    async def generate(self, request: web.Request) -> web.Response:
        out = await self.run_prompts(
            request, "text", lambda b: (b.get("sampling_params") or {}).get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        if isinstance(out, web.Response):
            return out
        results, single = out
        items = [{"text": r["text"], "meta_info": {
            "id": f"{os.getpid():x}{next(self.rids):08x}", "finish_reason": {"type": "length", "length": r["completion_tokens"]},
            "prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"], "cached_tokens": 0,
        }} for r in results]
        return web.json_response(items[0] if single else items)

    async def completions(self, request: web.Request) -> web.Response:
        out = await self.run_prompts(request, "prompt", lambda b: b.get("max_tokens", 16))
        if isinstance(out, web.Response):
            return out
        results, _ = out
        prompt_tokens = sum(r["prompt_tokens"] for r in results)
        completion_tokens = sum(r["completion_tokens"] for r in results)
        return web.json_response({
            "id": f"cmpl-{os.getpid():x}{next(self.rids):08x}", "object": "text_completion", "created": int(time.time()),  # wall-clock timestamp
            "model": self.cfg.served_model_name,
            "choices": [{"index": i, "text": r["text"], "logprobs": None, "finish_reason": "length"}
                        for i, r in enumerate(results)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        })

    # -- lifecycle

    async def bind(self) -> web.AppRunner:
        log(f"INFO:     Started server process [{os.getpid()}]")
        log("INFO:     Waiting for application startup.")
        log("INFO:     Application startup complete.")
        runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.cfg.host, self.cfg.port, backlog=2048).start()
        except OSError as exc:  # the uvicorn way: log the error, shut the app down, exit 1
            log(f"ERROR:    {exc}")
            log("INFO:     Waiting for application shutdown.")
            log("INFO:     Application shutdown complete.")
            self.launcher.die(1)
        log(f"INFO:     Uvicorn running on http://{self.cfg.host}:{self.cfg.port} (Press CTRL+C to quit)")
        return runner

    async def warmup(self) -> None:
        """SGLang's _wait_and_warmup: one real request over HTTP before declaring readiness."""
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        base = f"http://{host}:{self.cfg.port}"
        payload = {"text": "The capital city of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        try:
            async with ClientSession(timeout=ClientTimeout(total=600)) as http:
                async with http.get(f"{base}/get_model_info") as resp:
                    resp.raise_for_status()
                async with http.post(f"{base}/generate", json=payload) as resp:
                    resp.raise_for_status()
        except Exception as exc:  # noqa: BLE001 - SGLang reports any warmup failure and dies
            log(f"Initialization failed. warmup error: {exc!r}")
            self.launcher.die(None)

    async def serve_v23(self) -> web.AppRunner:
        """0.5.23 under uvicorn: the lifespan starts the warm-up thread *before* the port is bound.

        So when the bind fails (``[Errno 98] ... address already in use``) the warm-up may reach
        whoever holds the port and still print the ready line; uvicorn then waits for it in the
        lifespan shutdown, exits 3 (STARTUP_FAILURE), and launch_server's ``finally`` kills the
        children first.
        """
        log(f"INFO:     Started server process [{os.getpid()}]")
        log("INFO:     Waiting for application startup.")
        self.state = "warmup"
        warm = asyncio.ensure_future(self.warmup_v23())
        self.spawn_task(self.sigterm_watchdog())
        log("INFO:     Application startup complete.")
        runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.cfg.host, self.cfg.port, backlog=2048).start()
        except OSError as exc:
            log(f"ERROR:    {exc}")
            log("INFO:     Waiting for application shutdown.")
            await warm
            log("INFO:     Application shutdown complete.")
            self.launcher.kill_process_tree(include_parent=False, stamp=True, teardown=False)
            os._exit(3)
        log(f"INFO:     Uvicorn running on http://{self.cfg.host}:{self.cfg.port} (Press CTRL+C to quit)")
        self.launcher.phase = "serving"
        await warm
        return runner

    async def warmup_v23(self) -> None:
        """0.5.23's _execute_server_warmup: poll ``/model_info`` (120 tries; compressed here), then
        one ``/generate``; a warm-up that never gets through kills the tree."""
        if self.cfg.skip_warmup:
            log("The server is fired up and ready to roll!")
            return
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        base = f"http://{host}:{self.cfg.port}"
        payload = {"text": "The capital city of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        last: BaseException | None = None
        async with ClientSession() as http:
            for _ in range(WARMUP_TRIES):
                await asyncio.sleep(WARMUP_POLL_S)
                try:
                    async with http.get(f"{base}/model_info", timeout=ClientTimeout(total=WARMUP_TRY_TIMEOUT_S)) as resp:
                        if resp.status == 200:
                            break
                        last = AssertionError(f"res=<Response [{resp.status}]>")
                except (TimeoutError, aiohttp.ClientError) as exc:
                    last = exc
            else:
                log(f"Initialization failed. warmup error: Traceback (most recent call last):\n{last!r}")
                self.launcher.kill_process_tree(include_parent=True, stamp=True)
            try:
                async with http.post(f"{base}/generate", json=payload, timeout=ClientTimeout(total=600)) as resp:
                    resp.raise_for_status()
                async with http.post(f"{base}/freeze_gc", timeout=ClientTimeout(total=600)) as resp:
                    resp.raise_for_status()  # _freeze_gc_after_server_warmup
            except Exception as exc:  # noqa: BLE001 - SGLang reports any warmup failure and dies
                log(f"Initialization failed. warmup error: {exc!r}")
                self.launcher.kill_process_tree(include_parent=True, stamp=True)
        log("The server is fired up and ready to roll!")
        if self.state == "warmup":
            self.state = "serving"

    def on_sigterm(self) -> None:
        if self.cfg.node_rank > 0:
            # 0.5.23's engine.py: non-zero ranks cannot drain on their own; rank 0's shutdown
            # stops them (here: its ranks going away), the orchestrator's kill is the backstop.
            log(f"SIGTERM received on node_rank {self.cfg.node_rank}; waiting for the rank-0 ShutdownReq broadcast "
                "to stop the schedulers.")
            return
        if self.cfg.version != "0.5.6":  # loop.add_signal_handler calls it with no arguments
            log("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
            self.gracefully_exit = True
            if self.state != "draining":
                self.state = "draining"
            return
        log(f"SIGTERM received. signum={int(signal.SIGTERM)}, frame=None. Draining requests and shutting down...")
        if self.state == "draining":
            return
        self.state = "draining"
        if self.cfg.fail != "ignore_sigterm":
            self.spawn_task(self.drain())

    async def sigterm_watchdog(self) -> None:
        """0.5.23's TokenizerManager.sigterm_watchdog: it looks every 5 s (``--sim-drain-poll-s``)
        whether a SIGTERM came, then logs the remaining requests every 5 s until none is left,
        asks the schedulers to exit (ShutdownReq, up to 15 s), kills what is left and exits 0."""
        poll = self.cfg.drain_poll_s
        while not self.gracefully_exit:
            await asyncio.sleep(poll)
        if self.cfg.fail == "ignore_sigterm":  # a drain that never ends
            await asyncio.Event().wait()
        while True:
            rids = list(self.inflight_rids)
            log(f"Gracefully exiting... Remaining number of requests {len(rids)}. Remaining requests remaining_rids={rids}.")
            if rids:
                await asyncio.sleep(poll)
            else:
                break
        self.launcher.monitor_stopped = True
        for c in self.launcher.schedulers:  # ShutdownReq: the schedulers free their memory and exit 0
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        await asyncio.to_thread(self.launcher.wait_schedulers_gone, SCHEDULER_EXIT_TIMEOUT_S)
        self.launcher.kill_process_tree(include_parent=False, teardown=False)
        # uvicorn shuts down (measured), then launch_server's finally calls kill_process_tree once more
        log("INFO:     Shutting down")
        log("INFO:     Waiting for application shutdown.")
        log("INFO:     Application shutdown complete.")
        log(f"INFO:     Finished server process [{os.getpid()}]")
        log(f"kill_process_tree called: parent_pid={os.getpid()}, include_parent=False, pid={os.getpid()}")
        os._exit(0)

    async def drain(self) -> NoReturn:
        while self.inflight:
            log(f"Gracefully exiting... Remaining number of requests {self.inflight}.")
            await asyncio.sleep(self.cfg.drain_poll_s)
        self.launcher.close_children()
        os._exit(0)

    async def inject_fault(self) -> None:
        mode = self.cfg.fail
        if mode not in SERVING_FAULTS:
            return
        await asyncio.sleep(self.cfg.fail_after_s)
        if mode == "hang":
            crash_stamp(self.cfg.crash_stamp)
            self.hung = True
        elif mode == "exit0":
            self.launcher.die(0)
        elif mode == "segfault":
            self.launcher.segfault()
        else:
            if mode == "stuck":
                await asyncio.to_thread(self.mark_stuck)
            self.send(self.leaders[0], {"op": "fault", "mode": "host_oom" if mode == "host_oom" else "runtime_oom"})

    def mark_stuck(self) -> None:
        """The schedulers' GPU memory will stay counted after they die (until simgpu.reset)."""
        if not self.cfg.gpu_dir:
            return
        for c in self.launcher.schedulers:
            simgpu.write_process(self.cfg.gpu_dir, c.pid, {c.facts["gpu"]: c.facts["held_bytes"]},
                                 title=c.facts["title"], stuck=True)

    async def monitor_children(self) -> None:
        """0.5.23's SubprocessWatchdog (1 s): a watched child that exited non-zero triggers SIGQUIT,
        which kills the tree. Exit 0 is not a crash; unwatched children (schedulers under a DP
        controller) are not seen at all."""
        watched = [c for c in self.launcher.children if c.watch_name and c.pid not in self.launcher.skip_pids]
        seen: set[int] = set()
        while not self.launcher.monitor_stopped:
            await asyncio.sleep(CHILD_MONITOR_S_V23)
            if self.launcher.monitor_stopped:
                return
            for c in watched:
                if c.pid in seen:
                    continue
                try:
                    pid, status = os.waitpid(c.pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if not pid:
                    continue
                seen.add(c.pid)
                code = os.waitstatus_to_exitcode(status)
                if code == 0:
                    continue
                log(f"Subprocess {c.watch_name} (pid={c.pid}) crashed with exit code {code}. "
                    "Triggering SIGQUIT for cleanup...")
                os.kill(os.getpid(), signal.SIGQUIT)
                return

    def startup_timings_line(self, started: float) -> str:
        load = self.cfg.load_s
        capture = 0.3 * load if self.cfg.cuda_graph else 0.0
        graphs = ", ".join(f"{phase}={capture if phase == 'decode' else 0.0:.2f}" for phase in
                           ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend"))
        return (f"Engine startup timings (s): load_weight={load:.2f}, kv_cache_allocation=0.01, "
                f"scheduler_e2e={time.monotonic() - started:.2f}, cuda_graph={{{graphs}}}, "
                f"tokenizer_e2e={time.monotonic() - started:.2f}")

    def flood(self, count: int) -> NoReturn:
        lines = (f"[{time.strftime('%Y-%m-%d %H:%M:%S')} TP0] Decode batch. #running-req: {i % 64}, #token: {i % 9000}, "
                 f"token usage: 0.01, cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0, \n"
                 for i in range(count))
        while chunk := "".join(itertools.islice(lines, 1000)):
            emit(chunk)
        self.launcher.die(0)

    # -- several nodes (--nnodes): the rendezvous, a peer's loss, node >= 1's dummy server

    async def rendezvous(self) -> list[asyncio.StreamReader]:
        """Node 0 waits at --dist-init-addr until every other node joined; a node >= 1 joins
        it (retrying while node 0 is not up yet), as torch.distributed's init does."""
        host, _, port = (self.cfg.dist_init_addr or "127.0.0.1:0").rpartition(":")
        readers: list[asyncio.StreamReader] = []
        if self.cfg.node_rank == 0:
            joined: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

            async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await joined.put((reader, writer))

            server = await asyncio.start_server(accept, host, int(port), reuse_address=True)
            for _ in range(self.cfg.nnodes - 1):
                reader, writer = await joined.get()
                self.keep_peer(reader, writer, readers)
            server.close()
            return readers
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(0.2)
                continue
            self.keep_peer(reader, writer, readers)
            return readers

    def keep_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  readers: list[asyncio.StreamReader]) -> None:
        sock = writer.get_extra_info("socket")
        self.launcher.peer_fds.append(sock.fileno())
        self.peer_writers.append(writer)
        readers.append(reader)

    async def watch_peers(self, readers: list[asyncio.StreamReader]) -> None:
        """A peer node gone (its ranks died): our rank 0's next collective fails."""
        waits = [asyncio.ensure_future(r.read(1)) for r in readers]
        if not waits:
            return
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.launcher.schedulers:
            self.send(self.launcher.schedulers[0], {"op": "peer_lost", "addr": self.cfg.dist_init_addr})

    async def serve_dummy(self) -> web.AppRunner:
        """A node >= 1 runs no tokenizer: a dummy health server whose /health, /ping and
        /health_generate always answer 200 (anything else 404), then it waits on its ranks."""
        async def ok(request: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        for path in ("/health", "/ping", "/health_generate"):
            app.router.add_get(path, ok)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, self.cfg.host, self.cfg.port).start()
        log(f"Dummy health check server started in background thread at {self.cfg.host}:{self.cfg.port}")
        return runner

    async def join_schedulers(self) -> None:
        """Node >= 1's main joins its scheduler processes: one that ends is logged, and the
        node's launch ends with it."""
        while True:
            await asyncio.sleep(0.1)
            for c in self.launcher.schedulers:
                try:
                    pid, status = os.waitpid(c.pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if pid:
                    log(f"Scheduler or DataParallelController {c.pid} terminated with {os.waitstatus_to_exitcode(status)}")
                    self.launcher.close_peers()
                    self.launcher.kill_process_tree(include_parent=True)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_sigterm)
        started = time.monotonic()
        await self.connect()
        peers = await self.rendezvous() if self.cfg.nnodes > 1 else []
        await self.wait_ready()
        if self.cfg.node_rank > 0:
            runner = await self.serve_dummy()
            self.spawn_task(self.watch_peers(peers))
            self.spawn_task(self.join_schedulers())
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()
        self.spawn_task(self.watch_peers(peers))
        if self.cfg.version != "0.5.6":
            log(self.startup_timings_line(started))
            self.spawn_task(self.monitor_children())  # started once the schedulers are ready
            runner = await self.serve_v23()
        else:
            runner = await self.bind()
            self.launcher.phase = "serving"
            self.state = "warmup"
            await self.warmup()
            log("The server is fired up and ready to roll!")
            if self.state == "warmup":
                self.state = "serving"
        for child in self.launcher.schedulers:
            self.send(child, {"op": "serving"})
        if self.cfg.flood:
            self.flood(self.cfg.flood)
        self.spawn_task(self.inject_fault())
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def _server_args_line(cfg: SimConfig) -> str:
    """0.5.6: ``server_args=ServerArgs(k=v, ...)``; 0.5.23 logs ``server_args={resolved dict}``
    (engine.py: ``logger.info(f"server_args={_server_args_for_logging(server_args)}")``)."""
    if cfg.version != "0.5.6":
        return f"server_args={cfg.sglang_args!r}"
    body = ", ".join(f"{k}={v!r}" for k, v in cfg.sglang_args.items())
    return f"server_args=ServerArgs({body})"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point: parse, fork the children, then run the HTTP side until something ends us."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = SimConfig.from_args(args)
    if cfg.gpu_dir:
        simgpu.ensure_gpus(cfg.gpu_dir, cfg.gpus, cfg.total_gb)
    log(_server_args_line(cfg))
    launcher = Launcher(cfg)
    signal.signal(signal.SIGQUIT, launcher.on_sigquit)  # before any child can send one
    launcher.spawn()
    try:
        asyncio.run(Frontend(cfg, launcher).run())
    except BaseException:  # a bug in the simulator: show it, and leave nothing behind
        traceback.print_exc()
        launcher.die(1, stamp=False)
        raise  # not reached: die() ends the process
    launcher.die(0, stamp=False)


if __name__ == "__main__":
    main()
