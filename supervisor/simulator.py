"""A stand-in SGLang server and GPU: real processes, real HTTP, SGLang's log lines and deaths.

Run as ``python -m supervisor.simulator [SGLang flags] [--sim-* flags]``. It accepts
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
holds in the simulated-GPU directory (``supervisor.simgpu``) and checks the card's free
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
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import psutil
from aiohttp import ClientSession, ClientTimeout, web
from setproctitle import setproctitle

from supervisor import simgpu

GIB = simgpu.GIB
MIB = 1024**2
VERSIONS = ("0.5.6", "0.5.23")
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
CHILD_MONITOR_S = 0.25  # 0.5.23's 1 s child monitor, compressed
DRAIN_POLL_S = 0.25  # SGLang's 5 s "Gracefully exiting" poll, compressed
REAP_WAIT_S = 2.0  # how long the main process waits for killed children before dying

SGLANG = "/sgl-workspace/sglang/python/sglang/srt"
TORCH = "/usr/local/lib/python3.12/dist-packages/torch"
FRAME_REPR = "<frame at 0x7f3a5c1e4a40, file '/usr/lib/python3.12/selectors.py', line 468, code select>"


# --------------------------------------------------------------------------- flags


def _build_parser(version: str) -> argparse.ArgumentParser:
    """SGLang's launch flags this simulator understands, plus its own ``--sim-*`` flags."""
    p = argparse.ArgumentParser(prog="launch_server.py", allow_abbrev=False)
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
    add("--hicache-ratio", type=float, default=2.0)
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
    if version == "0.5.6":
        add("--cuda-graph-max-bs", type=int, default=None)
    else:  # removed in 0.5.23
        add("--cuda-graph-max-bs-decode", type=int, default=None)

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
    s("--sim-kernel-log", default=None)
    s("--sim-health-delay-s", type=float, default=0.02)
    s("--sim-health-timeout-s", type=float, default=2.0)  # SGLang's 20 s, compressed
    s("--sim-host-mem-gb", type=float, default=None)  # host RAM for the hicache check
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like SGLang: an unknown flag is an argparse error (exit 2, usage line)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--sim-version", choices=VERSIONS, default="0.5.6")
    known, _ = pre.parse_known_args(argv)
    return _build_parser(known.sim_version).parse_args(argv)


def default_fraction(total_gb: float, chunked_prefill: int, tp_size: int) -> float:
    """SGLang's computed ``--mem-fraction-static`` when the flag is absent."""
    reserved_mb = 512 + 1.5 * max(chunked_prefill, 2048) + tp_size / 8 * 1024
    if total_gb > 60:
        reserved_mb = max(reserved_mb, 10 * 1024)
    return round((total_gb * 1024 - reserved_mb) / (total_gb * 1024), 3)


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
    health_delay_s: float
    health_timeout_s: float
    host_mem_gb: float | None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> SimConfig:
        chunked = a.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL
        fraction = a.mem_fraction_static
        if fraction is None:
            fraction = default_fraction(a.sim_gpu_total_gb, chunked, a.tp_size)
        graph_gb = a.sim_graph_gb
        if graph_gb is None:
            graph_gb = a.sim_gpu_total_gb * (1 - SEED_FRACTION) - SEED_HEADROOM_GB
        sglang_args = {k: v for k, v in vars(a).items() if not k.startswith("sim_")}
        sglang_args["mem_fraction_static"] = fraction
        sglang_args["chunked_prefill_size"] = chunked
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
            hicache_ratio=a.hicache_ratio,
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
            health_delay_s=a.sim_health_delay_s,
            health_timeout_s=a.sim_health_timeout_s,
            host_mem_gb=a.sim_host_mem_gb,
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

    @property
    def avail_after_weights_gb(self) -> float:
        return self.free_at_start_gb - self.weights_gb

    @property
    def profiled_kv_gb(self) -> float:
        """What the static pool leaves for the KV cache: SGLang's ``rest_memory``."""
        return self.avail_after_weights_gb - self.total_gb * (1 - self.fraction)

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
        return self.weights_gb + self.kv_gb + self.graph_gb


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
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    emit(f"[{now} {tag}] {msg}" if tag else f"[{now}] {msg}")


def append_line(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


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

    @property
    def name(self) -> str:
        return f"scheduler_DP{self.dp}_TP{self.tp}" if self.dp_size > 1 else f"scheduler_TP{self.tp}"

    @property
    def title(self) -> str:
        return f"sglang::{self.name}"

    @property
    def tag(self) -> str:
        return f"DP{self.dp} TP{self.tp}" if self.dp_size > 1 else f"TP{self.tp}"

    @property
    def leader(self) -> bool:
        return self.tp == 0


def plan_ranks(cfg: SimConfig) -> list[Rank]:
    return [
        Rank(dp, tp, cfg.dp_size, cfg.base_gpu_id + dp * cfg.tp_size + tp)
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


def _set_pdeathsig() -> None:
    """Die with SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)


def _child_setup(title: str, parent_pid: int, pdeathsig: bool) -> None:
    setproctitle(title)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the main process drains and then ends us
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

    # -- plumbing

    def log(self, msg: str) -> None:
        log(msg, self.rank.tag)

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
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.parent_pid, signal.SIGQUIT)
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
        code = self.serve() if self.rank.leader else _idle_child(self.sock)
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
            "held_bytes": int(m.held_gb * GIB),
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
        self.log("Init torch distributed begin.")
        free = self.free_gb_on_card()
        total = self.total_gb_on_card()
        time.sleep(0.02)
        self.log(f"Init torch distributed ends. mem usage={total - free if v56 else 0.0:.2f} GB")
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
                         cfg.max_total_tokens)
        self.write_gpu(mem.weights_gb)
        elapsed = f"elapsed={cfg.load_s:.2f} s, " if not v56 else ""
        dtype = "dtype=torch.bfloat16, " if v56 else ""
        self.log(f"Load weight end. {elapsed}type={MODEL_TYPE}, {dtype}avail mem={mem.avail_after_weights_gb:.2f} GB, "
                 f"mem usage={mem.weights_gb:.2f} GB.")
        if cfg.fail == "kv_pool" or mem.profiled_kv_gb < cfg.min_kv_gb:
            exc = ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                   f"Current value: self.server_args.mem_fraction_static={cfg.fraction}")
            raise InitFailure(render_traceback(POOL_FRAMES, exc))
        half = mem.kv_gb / 2
        kv_dtype = "" if v56 else "dtype: torch.bfloat16, "
        self.log(f"KV Cache is allocated. {kv_dtype}#tokens: {mem.kv_tokens}, K size: {half:.2f} GB, V size: {half:.2f} GB")
        self.log(f"Memory pool end. avail mem={mem.avail_after_pool_gb:.2f} GB")
        self.write_gpu(mem.weights_gb + mem.kv_gb)
        self.alloc_host_pool(mem)
        self.capture_graphs(mem)
        self.write_gpu(mem.held_gb)
        self.log(f"max_total_num_tokens={mem.kv_tokens}, chunked_prefill_size={cfg.chunked_prefill}, "
                 f"max_prefill_tokens=16384, max_running_requests={cfg.max_running}, "
                 f"context_len={cfg.context_len}, available_gpu_mem={mem.headroom_gb:.2f} GB")
        return mem

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
        return sum(r.tokens + r.generated for r in self.running)

    def prefill(self) -> None:
        """Take up to a chunk of waiting tokens into one batch; OOM if its activations don't fit."""
        assert self.mem is not None
        capacity = self.mem.kv_tokens
        budget, seqs, finished = self.cfg.chunked_prefill, 0, []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self.running and self.used_tokens() + req.tokens + req.max_new > capacity:
                break  # the KV pool is full: wait for running requests to finish
            take = min(req.prefill_left, budget)
            req.prefill_left -= take
            budget -= take
            seqs += 1
            if req.prefill_left == 0:
                finished.append(self.waiting.popleft())
        tokens = self.cfg.chunked_prefill - budget
        if not tokens:
            return
        usage = (self.used_tokens() + tokens) / max(capacity, 1)
        self.log(f"Prefill batch. #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, "
                 f"token usage: {usage:.2f}, #running-req: {len(self.running)}, #queue-req: {len(self.waiting)}, ")
        activation = tokens * self.cfg.act_bytes_per_token
        if activation > self.mem.headroom_gb * GIB:
            self.runtime_oom(activation)
        time.sleep(tokens * PREFILL_S_PER_TOKEN)
        for req in finished:
            req.generated = 1  # prefill yields the first token
            self.running.append(req)
        self.next_decode = time.monotonic()
        self.finish([r for r in finished if r.generated >= r.max_new])

    def decode(self) -> None:
        for req in self.running:
            req.generated += 1
        self.generated_since_log += len(self.running)
        self.finish([r for r in self.running if r.generated >= r.max_new])
        self.decode_steps += 1
        if self.decode_steps % DECODE_LOG_INTERVAL == 0:
            self.log_decode()
        self.next_decode = time.monotonic() + DECODE_STEP_S

    def finish(self, done: list[Req]) -> None:
        for req in done:
            self.running.remove(req)
            self.send({"op": "done", "rid": req.rid, "prompt_tokens": req.tokens, "completion_tokens": req.generated})

    def log_decode(self) -> None:
        now = time.monotonic()
        throughput = self.generated_since_log / max(now - self.last_log_time, 1e-6)
        self.generated_since_log, self.last_log_time = 0, now
        capacity = self.mem.kv_tokens if self.mem else 1
        used = self.used_tokens()
        self.log(f"Decode batch. #running-req: {len(self.running)}, #token: {used}, token usage: {used / max(capacity, 1):.2f}, "
                 f"cuda graph: True, gen throughput (token/s): {throughput:.2f}, #queue-req: {len(self.waiting)}, ")

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
        self.log(f"Prefill batch. #new-seq: {max(1, tokens // 512)}, #new-token: {tokens}, #cached-token: 0, "
                 f"token usage: 0.00, #running-req: {len(self.running)}, #queue-req: 0, ")
        self.runtime_oom(max(tokens * self.cfg.act_bytes_per_token, (self.mem.headroom_gb + 0.25) * GIB))

    def host_oom(self) -> NoReturn:
        """The kernel OOM killer takes this scheduler: no traceback, just SIGKILL."""
        vm_kb = int(self.cfg.total_gb * 1.9 * 1024 * 1024)
        rss_kb = int(self.cfg.hicache_size_gb * 1024 * 1024 + 20 * 1024 * 1024)
        append_line(
            self.cfg.kernel_log,
            f"[{time.monotonic():12.6f}] Out of memory: Killed process {os.getpid()} (sglang::schedul) "
            f"total-vm:{vm_kb}kB, anon-rss:{rss_kb}kB, file-rss:81920kB, shmem-rss:0kB, UID:0 "
            f"pgtables:{rss_kb // 512}kB oom_score_adj:0",
        )
        if self.cfg.version == "0.5.6":  # nobody notices until /health times out: stamp now
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
                _child_setup(title, parent, pdeathsig)
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
        for rank in plan_ranks(cfg):
            orphan = cfg.fail == "orphan" and rank.leader and rank.dp == 0

            def target(sock: socket.socket, rank: Rank = rank) -> int:
                return Scheduler(cfg, rank, sock, parent).run()

            child = self.fork(rank.name, rank.title, target, pdeathsig=not orphan, rank=rank)
            if orphan:
                self.skip_pids.add(child.pid)
        self.fork("detokenizer", "sglang::detokenizer", _idle_child)

    @property
    def schedulers(self) -> list[Child]:
        return [c for c in self.children if c.rank is not None]

    def on_sigquit(self, signum: int, frame: object) -> None:
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # other ranks may SIGQUIT us too: die once
        if self.phase == "launch":
            log("Received sigquit from a child process. It usually means the child failed.")
        else:
            log(f"SIGQUIT received. signum={signum}, frame={FRAME_REPR}. It usually means one child failed.")
        self.die(None)

    def kill_children(self) -> None:
        """SGLang's kill_process_tree: SIGKILL every descendant (but an orphan), then reap them."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process().children(recursive=True):
                if p.pid not in self.skip_pids:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
        self.reap(REAP_WAIT_S)

    def reap(self, timeout: float) -> None:
        pending = {c.pid for c in self.children} - self.skip_pids
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
                time.sleep(0.01)

    def die(self, code: int | None, *, stamp: bool = True) -> NoReturn:
        """Kill the tree and end: ``code=None`` SIGKILLs ourselves, like SGLang (exit status -9)."""
        self.kill_children()
        if stamp:
            crash_stamp(self.cfg.crash_stamp)
        if code is None:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code or 0)

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
        self.hung = False
        self.inflight = 0
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.rids = itertools.count(1)
        self.writers: dict[int, asyncio.StreamWriter] = {}  # scheduler pid -> writer
        self.events: asyncio.Queue[tuple[str, Child, dict[str, Any]]] = asyncio.Queue()
        self.progress = asyncio.Event()  # pulsed whenever a scheduler finishes a request
        self.leaders = [c for c in launcher.schedulers if c.rank and c.rank.leader]
        self.next_leader = itertools.cycle(range(len(self.leaders)))
        self.tasks: set[asyncio.Task[Any]] = set()

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
                elif (fut := self.pending.get(msg.get("rid", -1))) and not fut.done():
                    fut.set_result(msg)
                if msg["op"] == "done":
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

    def scheduler_died_at_launch(self, child: Child) -> NoReturn:
        index = self.launcher.schedulers.index(child)
        _, status = os.waitpid(child.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if self.cfg.version == "0.5.6":
            log(f"Rank {index} scheduler is dead. Please check if there are relevant logs.")
            log(f"Exit code: {code}")
        else:
            log(f"Rank {index} scheduler died during initialization (exit code: {code})")
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
        if self.state != "serving":
            return web.Response(status=503)
        started = time.monotonic()
        rid, fut = self.submit("req", self.leaders[0], tokens=1, max_new=1)
        progress = asyncio.ensure_future(self.progress.wait())
        try:  # like SGLang: any output from the scheduler while we wait proves it is alive
            done, _ = await asyncio.wait({fut, progress}, timeout=self.cfg.health_timeout_s,
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

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.cfg.model_path, "tokenizer_path": self.cfg.model_path,
                                  "is_generation": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.served_model_name, "object": "model", "created": int(time.time()),  # wall-clock timestamp (OpenAI field)
            "owned_by": "sglang", "root": self.cfg.model_path, "max_model_len": self.cfg.context_len}]})

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
        return {"text": " " + _words(done["completion_tokens"]), "prompt_tokens": done["prompt_tokens"],
                "completion_tokens": done["completion_tokens"]}

    async def run_prompts(self, request: web.Request, key: str, max_new_of: Callable[[dict[str, Any]], int]
                          ) -> tuple[list[dict[str, Any]], bool] | web.Response:
        """Shared by /generate and /v1/completions: parse, refuse while draining, run every prompt.

        A request counts as in flight from arrival, so one stuck in a hung server keeps a
        SIGTERM drain waiting forever, as in SGLang.
        """
        self.inflight += 1
        try:
            await self.gate()
            if self.state == "draining":
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

    def on_sigterm(self) -> None:
        log(f"SIGTERM received. signum={int(signal.SIGTERM)}, frame=None. Draining requests and shutting down...")
        if self.state == "draining":
            return
        self.state = "draining"
        if self.cfg.fail != "ignore_sigterm":
            self.spawn_task(self.drain())

    async def drain(self) -> NoReturn:
        while self.inflight:
            log(f"Gracefully exiting... Remaining number of requests {self.inflight}.")
            await asyncio.sleep(DRAIN_POLL_S)
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
        """0.5.23's child monitor: a dead child triggers SIGQUIT, which kills the tree."""
        while True:
            await asyncio.sleep(CHILD_MONITOR_S)
            for c in self.launcher.children:
                if c.pid in self.launcher.skip_pids:
                    continue
                try:
                    pid, status = os.waitpid(c.pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if pid:
                    code = os.waitstatus_to_exitcode(status)
                    log(f"Subprocess {c.name} (pid={c.pid}) crashed with exit code {code}. "
                        "Triggering SIGQUIT for cleanup...")
                    os.kill(os.getpid(), signal.SIGQUIT)
                    return

    def flood(self, count: int) -> NoReturn:
        lines = (f"[{time.strftime('%Y-%m-%d %H:%M:%S')} TP0] Decode batch. #running-req: {i % 64}, #token: {i % 9000}, "
                 f"token usage: 0.01, cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0, \n"
                 for i in range(count))
        while chunk := "".join(itertools.islice(lines, 1000)):
            emit(chunk)
        self.launcher.die(0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_sigterm)
        await self.connect()
        await self.wait_ready()
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
        if self.cfg.version != "0.5.6":
            self.spawn_task(self.monitor_children())
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def _server_args_line(cfg: SimConfig) -> str:
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
    launcher.die(0, stamp=False)


if __name__ == "__main__":
    main()
