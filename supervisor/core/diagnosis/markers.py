"""Phase markers: the words of frames and progress lines that say where a server was
(start-up stage or serving) when it failed."""

from __future__ import annotations

# In the failure report (frames, source lines, the error itself): startup stages.
_WEIGHTS_FRAMES = (
    "load_model", "load_weights", "weight_loader", "process_weights_after_loading", "create_weights",
    "repack", "model_loader", "init_memory_pool", "loading shards", "checkpoint shards",
)
_CAPTURE_FRAMES = (
    "init_cuda_graphs", "= cudagraphrunner(", "capture", "warmup", "warm_up", "warming up",
    "profile_run", "_dummy_run", "_dummy_sampler_run", "dummy_metadata", "dummy_batch", "dummy_input",
    "determine_num_available_blocks", "determine_available_memory", "initialize_kv_cache",
    "profile_max_num_token", "kv_cache_configurator", "init_device_graphs", "cuda_graph_capture",
)
_STARTUP_FRAMES = (
    "= scheduler(", "= modelrunner(", "= tpmodelworker(", "= tpworkerclass(", "init_model_worker",
    "in initialize\n", ".initialize(", "init_device", "from_engine_args", "_init_engine",
    "failed to initialize", "during initialization", "initialization failed", "init_torch_distributed",
    "initialize_model_parallel", "ncclcomminitrank", "enginecoreproc(", "failed to start",
)
_SERVING_FRAMES = (
    "forward_batch_generation", "run_batch", "event_loop_overlap", "event_loop_normal", "event_loop_pp",
    "forward_thread_func", "forward_extend", "forward_decode", "execute_model", "step_with_batch_queue",
    "run_busy_loop", "_process_engine_step", "run_engine_loop", "engine_step", "_log_task_completion",
    "output_handler", "error in model execution", "serving_chat", "serving_completion", "engine loop",
    "process_batch_result", "get_next_batch_to_run", "get_model_worker_batch", "worker_busy_loop",
    "forward_prefill", "_continuation_prefill", "generate_request", "handle_generate_request",
)
# Lines that belong to a failure report although they are not traceback lines.
_REPORT_LINES = (
    "exception in worker", "exception in callback", "output_handler failed", "error in model execution",
    "hit an exception", "enginedeaderror", "engine loop",
)
# Progress lines in the log (nearest one before the evidence wins) -> startup stage.
_STARTUP_PROGRESS: dict[str, str] = {
    "load weight begin": "weights",
    "loading safetensors": "weights",
    "loading shards": "weights",
    "checkpoint shards": "weights",
    "loading model from": "weights",
    "load weight end": "pool",
    "kv cache is allocated": "pool",
    "memory pool end": "capture",
    "capture cuda graph": "capture",
    "capturing batches": "capture",
    "loading model weights took": "capture",
    "loading weights took": "capture",
    "model loading took": "capture",
    "memory profiling": "capture",
}
_SERVING_PROGRESS = (
    "ready to roll", "prefill batch", "decode batch", 'http/1.1"', "added request", "avg prompt throughput",
)
_BATCH_LINES = ("prefill batch", "decode batch")
_CLEAR_GPU_STAGES = frozenset({"weights", "pool"})
