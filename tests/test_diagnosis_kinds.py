"""Crash diagnosis: one test per kind of miss on logs the diagnosis had never seen (issue 35),
each on a log written here in new words.

None of these logs is copied from tests/data/crashlogs/ and none reuses a corpus exception
message word for word: each is a fresh, realistic SGLang or vLLM log (timestamps, frames of the
real packages' functions, the exception line last) that reproduces the shape of one kind of
misreading, so that a fix for the kind, not for one sentence, is what makes the test pass.
"""

from __future__ import annotations

import pytest

from supervisor.core.config import PolicyConfig
from supervisor.core.diagnosis import describe_action, diagnose
from supervisor.core.model import Cause, Phase, Remedy
from supervisor.core.policy import decide

SITE = "/usr/local/lib/python3.11/site-packages"
SGL = f"{SITE}/sglang/srt"
VLLM = f"{SITE}/vllm"
PY = "/usr/lib/python3.11"
READY = "The server is fired up and ready to roll!"


def parse_frames(block: str) -> list[tuple[str, int, str, str]]:
    """Frames written one a line, outermost first: ``{SGL}/path.py:LINE function | source``
    (``{SGL}``, ``{VLLM}``, ``{SITE}``, ``{PY}``: the install roots above; no source: generated code)."""
    roots = {"SGL": SGL, "VLLM": VLLM, "SITE": SITE, "PY": PY}
    out = []
    for line in block.strip().splitlines():
        where, _, source = line.strip().partition(" |")
        place, func = where.rsplit(" ", 1)
        path, lineno = place.rsplit(":", 1)
        for name, root in roots.items():
            path = path.replace("{" + name + "}", root)
        out.append((path, int(lineno), func, source.strip()))
    return out

# Each log is read twice: with the phase the daemon would have seen, and with phase=None, as
# `explain` reads a file (the daemon does not know, the log alone decides).
SERVED = pytest.mark.parametrize("phase", [Phase.SERVING, None], ids=["daemon", "unknown"])
STARTED = pytest.mark.parametrize("phase", [Phase.STARTING, None], ids=["daemon", "unknown"])


def ts(second: int, rank: str = " TP0") -> str:
    """SGLang's line prefix at 2026-02-14 09:41:<second>."""
    return f"[2026-02-14 09:41:{second:02d}{rank}] "


def traceback(frames: list[tuple[str, int, str, str]], error: str, prefix: str = "") -> list[str]:
    """A Python traceback with the given (file, line, function, source) frames, as lines."""
    lines = [f"{prefix}Traceback (most recent call last):"]
    for path, lineno, func, source in frames:
        lines.append(f'{prefix}  File "{path}", line {lineno}, in {func}')
        if source:  # a frame of generated code ("<string>") prints no source line
            lines.append(f"{prefix}    {source}")
    return [*lines, prefix + error]


def serving_prelude() -> list[str]:
    """A server that came up and served a little: the READY line, then decode batches."""
    return [
        ts(10, "") + 'INFO:     127.0.0.1:40312 - "GET /get_model_info HTTP/1.1" 200 OK',
        ts(10, "") + READY,
        ts(12) + "Prefill batch. #new-seq: 2, #new-token: 611, #cached-token: 0, token usage: 0.00, "
        "#running-req: 0, #queue-req: 0",
        ts(13) + "Decode batch. #running-req: 2, #token: 702, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 141.07, #queue-req: 0",
        ts(14) + "Decode batch. #running-req: 2, #token: 782, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 139.55, #queue-req: 0",
    ]


def text(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


@SERVED
def test_a_generic_message_raised_in_a_loader_while_serving_gives_no_certain_start_up_cause(
    phase: Phase | None,
) -> None:
    """A plain AttributeError raised in a model_loader helper after READY is not a model-load error.

    Guards against reading the loader's file name (a weights-stage marker) as "the model failed to
    load, give up": the server was serving, the message names nothing about a checkpoint, so the
    diagnosis cannot be sure and must not refuse to restart.
    """
    frames = parse_frames("""
        {SGL}/managers/scheduler.py:1061 event_loop_normal | batch = self.get_next_batch_to_run()
        {SGL}/managers/scheduler.py:1795 get_next_batch_to_run | new_batch = self.get_new_batch_prefill()
        {SGL}/managers/scheduler.py:1902 get_new_batch_prefill | self.tp_worker.load_lora_adapter(req.lora_path)
        {SGL}/lora/lora_manager.py:188 load_lora_adapter | lora_adapter.initialize_weights()
        {SGL}/lora/lora.py:97 initialize_weights | default_weight_loader(self.weights[name], tensor)
        {SGL}/model_loader/weight_utils.py:732 default_weight_loader | if param.dtype != loaded_weight.dtype:
    """)
    report = traceback(frames, "AttributeError: 'NoneType' object has no attribute 'dtype'")
    log = serving_prelude() + [
        ts(15) + "Scheduler hit an exception: " + report[0],
        *(ts(15) + line for line in report[1:]),
        ts(15, "") + "Received sigquit from a child process. It usually means the child failed.",
    ]
    d = diagnose(text(log), phase=phase)
    assert d.certain is False
    assert d.remedy is not Remedy.GIVE_UP
    assert d.cause is not Cause.MODEL_LOAD_ERROR or not d.certain
    assert d.phase is Phase.SERVING


@SERVED
def test_an_exception_in_a_serving_loop_that_a_start_up_rule_would_match_is_not_certain(phase: Phase | None) -> None:
    """An UnpicklingError in the tokenizer manager's receive loop after READY is not certain.

    Guards against a start-up rule (a corrupt checkpoint unpickled while loading) firing on a
    message that here comes from a garbled IPC frame while serving: the diagnosis should restart
    and say it is unsure, not give up on a model that loaded fine.
    """
    frames = parse_frames("""
        {SGL}/managers/tokenizer_manager.py:1347 handle_loop | recv_obj = await self.recv_from_detokenizer.recv_pyobj()
        {SITE}/zmq/_future.py:369 _chain | loaded = load(buf)
        {SITE}/zmq/sugar/socket.py:1004 <lambda> | return self._deserialize(msg, lambda buf: pickle.loads(buf))
    """)
    log = serving_prelude() + [
        ts(16, "") + "Task exception was never retrieved",
        *(ts(16, "") + line for line in traceback(frames, "_pickle.UnpicklingError: invalid load key, '\\xe3'.")),
    ]
    d = diagnose(text(log), phase=phase)
    assert d.certain is False
    assert d.remedy is Remedy.RESTART
    assert d.phase is Phase.SERVING


@STARTED
def test_a_distributed_network_error_with_errno_minus_98_is_a_port_in_use(phase: Phase | None) -> None:
    """A torch.distributed rendezvous failure carrying ``code: -98`` is a taken port.

    Guards against missing a port conflict when the message words it neither as "address already
    in use" nor as EADDRINUSE: c10d's negative errno -98 alone names the bind failure.
    """
    frames = parse_frames("""
        {SGL}/managers/scheduler.py:2588 run_scheduler_process | scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
        {SGL}/managers/tp_worker.py:81 __init__ | self.model_runner = ModelRunner(
        {SGL}/model_executor/model_runner.py:263 __init__ | min_per_gpu_memory = self.init_torch_distributed()
        {SGL}/model_executor/model_runner.py:611 init_torch_distributed | init_distributed_environment(
        {SGL}/distributed/parallel_state.py:1208 init_distributed_environment | torch.distributed.init_process_group(
        {SITE}/torch/distributed/c10d_logger.py:81 wrapper | return func(*args, **kwargs)
        {SITE}/torch/distributed/distributed_c10d.py:1710 init_process_group | store, rank, world_size = next(rendezvous_iterator)
        {SITE}/torch/distributed/rendezvous.py:278 _tcp_rendezvous_handler | store = _create_c10d_store(
        {SITE}/torch/distributed/rendezvous.py:198 _create_c10d_store | return TCPStore(
    """)
    log = [
        ts(1, "") + "server_args=ServerArgs(model_path='meta-llama/Llama-3.1-8B-Instruct', tp_size=2, port=30000)",
        ts(4, " TP1") + "Init torch distributed begin.",
        ts(4) + "Init torch distributed begin.",
        *(ts(5) + line for line in traceback(frames, "torch.distributed.DistNetworkError: "
                                             "The c10d store on 127.0.0.1:29517 could not open its listener "
                                             "(tried both IPv4 and IPv6). port: 29517, useIpv6: 0, code: -98, "
                                             "message: the listener socket was refused by the kernel")),
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is Cause.PORT_IN_USE
    assert d.remedy is Remedy.CLEAR_GPU


@STARTED
def test_a_bind_refused_with_errno_13_is_not_a_port_in_use(phase: Phase | None) -> None:
    """uvicorn's bind error with [Errno 13] (a privileged port) is no port conflict.

    Guards against reading every "error while attempting to bind" as a taken port and killing
    whatever holds the GPU or the port: permission denied is the launch's own configuration,
    likely but not surely, so the daemon restarts with backoff rather than clearing anything.
    """
    log = [
        ts(2, "") + "server_args=ServerArgs(model_path='Qwen/Qwen2.5-7B-Instruct', host='0.0.0.0', port=443)",
        ts(6) + "Load weight begin. avail mem=78.52 GB",
        ts(19) + "Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=63.98 GB, "
        "mem usage=14.54 GB.",
        ts(20) + "KV Cache is allocated. #tokens: 905311, K size: 24.17 GB, V size: 24.17 GB",
        ts(27, "") + "INFO:     Started server process [5180]",
        ts(27, "") + "INFO:     Waiting for application startup.",
        ts(27, "") + "INFO:     Application startup complete.",
        ts(27, "") + "ERROR:    [Errno 13] error while attempting to bind on address ('0.0.0.0', 443): "
        "permission denied",
        ts(27, "") + "INFO:     Waiting for application shutdown.",
        ts(27, "") + "INFO:     Application shutdown complete.",
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is not Cause.PORT_IN_USE
    assert d.remedy is not Remedy.CLEAR_GPU
    assert d.cause is Cause.CONFIG_ERROR
    assert d.certain is False
    assert d.remedy is Remedy.RESTART


@SERVED
def test_a_bare_bus_error_is_not_host_memory_for_certain(phase: Phase | None) -> None:
    """A faulthandler "Bus error" with no word of shared memory is not surely host memory.

    Guards against treating SIGBUS as a full /dev/shm by reflex: without shm in the log it may
    as well be a truncated mmapped file or bad hardware, so the reading stays `other`, unsure,
    with host memory only as the runner-up, and the daemon restarts unchanged.
    """
    log = serving_prelude() + [
        "Fatal Python error: Bus error",
        "",
        "Thread 0x00007f81c4ffd640 (most recent call first):",
        f'  File "{PY}/threading.py", line 331 in wait',
        f'  File "{PY}/threading.py", line 629 in wait',
        f'  File "{SITE}/tqdm/_monitor.py", line 60 in run',
        f'  File "{PY}/threading.py", line 1045 in _bootstrap_inner',
        "",
        "Current thread 0x00007f83e1a3b740 (most recent call first):",
        f'  File "{SGL}/managers/schedule_batch.py", line 1618 in prepare_for_decode',
        f'  File "{SGL}/managers/scheduler.py", line 1841 in update_running_batch',
        f'  File "{SGL}/managers/scheduler.py", line 1790 in get_next_batch_to_run',
        f'  File "{SGL}/managers/scheduler.py", line 1058 in event_loop_normal',
        f'  File "{SGL}/managers/scheduler.py", line 2610 in run_scheduler_process',
        f'  File "{PY}/multiprocessing/process.py", line 108 in run',
        "",
        "Extension modules: numpy.core._multiarray_umath, torch._C, zmq.backend.cython._zmq (total: 91)",
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is Cause.OTHER
    assert d.certain is False
    assert d.runner_up is Cause.HOST_OOM
    assert d.remedy is Remedy.RESTART


@STARTED
def test_dev_shm_short_of_space_is_host_memory(phase: Phase | None) -> None:
    """ENOSPC on a /dev/shm segment created by SGLang's shm broadcaster is host memory.

    Guards against reading "No space left on device" as a disk or configuration problem: the
    path is /dev/shm, a RAM-backed filesystem too small for the message queue, so the cause is
    host memory and a restart (with a smaller host footprint) is not hopeless.
    """
    frames = parse_frames("""
        {SGL}/model_executor/model_runner.py:633 init_torch_distributed | initialize_model_parallel(
        {SGL}/distributed/parallel_state.py:1402 initialize_model_parallel | _TP = init_model_parallel_group(
        {SGL}/distributed/parallel_state.py:1171 init_model_parallel_group | return GroupCoordinator(
        {SGL}/distributed/parallel_state.py:318 __init__ | self.mq_broadcaster = MessageQueue.create_from_process_group(
        {SGL}/distributed/device_communicators/shm_broadcast.py:497 create_from_process_group | buffer_io = MessageQueue(
        {SGL}/distributed/device_communicators/shm_broadcast.py:238 __init__ | self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
        {SGL}/distributed/device_communicators/shm_broadcast.py:110 __init__ | self.shared_memory = shared_memory.SharedMemory(
        {PY}/multiprocessing/shared_memory.py:115 __init__ | os.ftruncate(self._fd, size)
    """)
    log = [
        ts(1, "") + "server_args=ServerArgs(model_path='mistralai/Mistral-Small-24B-Instruct-2501', tp_size=4)",
        ts(3) + "Init torch distributed begin.",
        *(ts(4) + line for line in traceback(
            frames, "OSError: [Errno 28] No space left on device: '/dev/shm/psm_7d2e19a4'")),
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is Cause.HOST_OOM
    assert d.remedy is not Remedy.GIVE_UP


@STARTED
def test_an_import_error_of_a_shared_library_inside_a_kernel_package_is_the_environment(phase: Phase | None) -> None:
    """A kernel package that cannot dlopen its runtime library is the environment, not a CUDA fault.

    Guards against the library's name (an NVIDIA runtime) making the crash read as a CUDA error:
    an ImportError while building the model is an install/ABI problem, `other`, restarted.
    """
    frames = parse_frames("""
        {SGL}/model_loader/loader.py:562 load_model | model = _initialize_model(
        {SGL}/model_loader/loader.py:241 _initialize_model | return model_class(
        {SGL}/models/llama.py:437 __init__ | self.model = self._init_model(config, quant_config, add_prefix("model", prefix))
        {SGL}/models/llama.py:318 __init__ | self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        {SGL}/layers/layernorm.py:61 __init__ | from flashinfer.norm import fused_add_rmsnorm, rmsnorm
        {SITE}/flashinfer/__init__.py:23 <module> | from .activation import gelu_and_mul as gelu_and_mul
        {SITE}/flashinfer/activation.py:22 <module> | from .jit import gen_act_and_mul_module
        {SITE}/flashinfer/jit/__init__.py:20 <module> | from .core import build_jit_specs as build_jit_specs
        {SITE}/flashinfer/jit/core.py:17 <module> | from . import _nvrtc_bindings
    """)
    log = [
        ts(1, "") + "server_args=ServerArgs(model_path='meta-llama/Llama-3.2-3B-Instruct', "
        "attention_backend='flashinfer')",
        ts(5) + "Load weight begin. avail mem=79.10 GB",
        *(ts(6) + line for line in traceback(
            frames, "ImportError: libnvrtc.so.13: cannot open shared object file: No such file or directory")),
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is Cause.OTHER
    assert d.remedy is Remedy.RESTART
    assert d.cause is not Cause.CUDA_ERROR


@STARTED
def test_a_cuda_oom_under_an_engine_initialisation_without_a_ready_line_is_start_up(phase: Phase | None) -> None:
    """A CUDA OOM inside vLLM's engine construction, with no progress line at all, is start-up.

    Guards against falling back to "runtime" (or an unknown phase) when no stage marker is in the
    log: the frames are the engine's and executor's constructors and nothing ever served.
    """
    frames = parse_frames("""
        {VLLM}/v1/engine/core_client.py:231 __init__ | self.engine_core = EngineCore(*args, **kwargs)
        {VLLM}/v1/engine/core.py:80 __init__ | self.model_executor = executor_class(vllm_config)
        {VLLM}/executor/executor_base.py:53 __init__ | self._init_executor()
        {VLLM}/executor/uniproc_executor.py:47 _init_executor | self.collective_rpc("init_worker", args=([kwargs], ))
        {VLLM}/executor/uniproc_executor.py:57 collective_rpc | answer = run_method(self.driver_worker, method, args, kwargs)
        {VLLM}/utils/__init__.py:2736 run_method | return func(*args, **kwargs)
        {VLLM}/worker/worker_base.py:603 init_worker | self.worker = worker_class(**kwargs)
        {VLLM}/v1/worker/gpu_worker.py:88 __init__ | self.model_runner = GPUModelRunner(self.vllm_config, self.device)
        {VLLM}/v1/worker/gpu_model_runner.py:214 __init__ | self.input_batch = InputBatch(
        {VLLM}/v1/worker/block_table.py:41 __init__ | self.block_table = torch.zeros(
    """)
    log = [
        "INFO 02-14 09:41:02 [__init__.py:244] Automatically detected platform cuda.",
        "INFO 02-14 09:41:07 [core.py:69] Initializing a V1 LLM engine (v0.9.2) with config: "
        "model='Qwen/Qwen2.5-32B-Instruct', dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size=1",
        *traceback(frames, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a "
                   "total capacity of 79.19 GiB of which 1.02 GiB is free."),
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is Cause.CUDA_OOM_STARTUP
    assert d.phase is Phase.STARTING


@STARTED
def test_an_uncertain_config_error_restarts_with_backoff(phase: Phase | None) -> None:
    """A ValueError in new words from server_args is a config error, unsure, so restarted with backoff.

    Guards against an uncertain configuration reading giving up on the first crash: the words
    match none of the known config messages, so the daemon says it is unsure, restarts with
    backoff, and gives up only if the same crash repeats.
    """
    frames = parse_frames("""
        {SITE}/sglang/launch_server.py:11 <module> | server_args = prepare_server_args(sys.argv[1:])
        {SGL}/server_args.py:3187 prepare_server_args | return ServerArgs.from_cli_args(raw_args)
        {SGL}/server_args.py:3102 from_cli_args | return cls(**{attr: getattr(args, attr) for attr in attrs})
        <string>:231 __init__ |
        {SGL}/server_args.py:596 __post_init__ | self._handle_speculative_decoding()
        {SGL}/server_args.py:1420 _handle_speculative_decoding | raise ValueError(
    """)
    log = [
        "/usr/local/lib/python3.11/site-packages/sglang/launch_server.py:20: UserWarning: "
        "'python -m sglang.launch_server' is still supported, but 'sglang serve' is the recommended entrypoint.",
        *traceback(frames, "ValueError: a speculative tree 12 levels deep outgrows the draft model's "
                   "context window of 8 steps"),
    ]
    d = diagnose(text(log), phase=phase)
    assert d.cause is Cause.CONFIG_ERROR
    assert d.certain is False
    assert d.remedy is Remedy.RESTART
    action = describe_action(d)
    assert "unsure" in action.lower()
    assert "gives up if it repeats" in action
    decision = decide(
        cause=d.cause, remedy=d.remedy, fraction=None, hicache_size_gb=0, oom_fractions=frozenset(),
        crashes_in_window=1, failures=1, cfg=PolicyConfig(), jitter_sample=0.5,
    )
    assert decision.give_up is False
    assert decision.delay_s > 0


# --------------------------------------------------------------------------- meanings and shared words


def test_a_cuda_error_code_is_read_by_its_name_in_cudas_table() -> None:
    """A CUDA error given only by its number is read by the name CUDA's header gives that
    number (700: cudaErrorIllegalAddress) and that name's family: a kernel fault, restarted."""
    d = diagnose("RuntimeError: the fused rotary kernel returned CUDA error 700 on stream 3\n", phase=Phase.SERVING)
    assert (d.cause, d.remedy, d.certain) == (Cause.CUDA_ERROR, Remedy.RESTART, False)
    assert "cudaErrorIllegalAddress" in d.basis


@pytest.mark.parametrize(("phase", "certain", "remedy"), [(Phase.STARTING, True, Remedy.GIVE_UP),
                                                           (Phase.SERVING, False, Remedy.RESTART)])
def test_a_missing_checkpoint_file_is_a_model_load_error(phase: Phase, certain: bool, remedy: Remedy) -> None:
    """ENOENT for a weights file at start-up: the model cannot be loaded (certain: the C
    library's errno names it). The same line in a death while serving cannot be a start-up
    cause for certain: it restarts with backoff."""
    d = diagnose("FileNotFoundError: [Errno 2] No such file or directory: "
                 "'/srv/ckpt/qwen3/model-00007-of-00012.safetensors'\n", phase=phase)
    assert (d.cause, d.certain, d.remedy) == (Cause.MODEL_LOAD_ERROR, certain, remedy)


@pytest.mark.parametrize("line", [
    "AttributeError: 'NoneType' object has no attribute 'block_table'",
    "TimeoutError: Timed out after 45 seconds while the detokenizer flushed its queue",
    "RuntimeError: Failed to load the draft head from the shared cache",
])
def test_words_that_many_messages_share_name_no_family(line: str) -> None:
    """Python's generic texts, and opening words that messages of several families share, are
    no evidence of any family (the catalogue's ``shared`` column)."""
    from supervisor.core.diagnosis import read_line

    assert read_line(line)[0] is None
