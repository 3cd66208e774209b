"""The KV / request-slot pool: raise the fraction at startup, never lower it."""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _Rule
from supervisor.core.model import Cause, Phase

RULES: tuple[_Rule, ...] = (
    # -- the KV / request-slot pool: raise the fraction at startup, never lower it
    _Rule(
        "kv_pool_startup",
        Cause.KV_POOL_TOO_SMALL,
        (
            "increase --mem-fraction-static", "leave no gpu memory for the kv cache", "larger than the profiled value",
            "no available memory for the cache blocks",
            "maximum number of tokens that can be stored in kv cache",
            "larger than the available kv cache memory",
        ),
        usual_phase=Phase.STARTING,
        phase_in_text=True,
        origins=(
            ("no available memory for the cache blocks", "vllm"),
            ("maximum number of tokens that can be stored in kv cache", "vllm"),
            ("larger than the available kv cache memory", "vllm"),
        ),
        cites=(
            ("leave no gpu memory for the kv cache", "sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py:3051"),
            ("increase --mem-fraction-static", "sglang 0.5.23 srt/model_executor/pool_configurator.py:96"),
            ("larger than the profiled value", "sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py:3102"),
            ("no available memory for the cache blocks", "vllm 0.8.5.post1 v1/core/kv_cache_utils.py:527: 'No available memory for the cache blocks. Try increasing `gpu_memory_utilization`'"),
            ("maximum number of tokens that can be stored in kv cache", "vllm/v1/core/kv_cache_utils.py: "
             "'...is larger than the maximum number of tokens that can be stored in KV cache'"),
            ("larger than the available kv cache memory", "vllm 0.33.0 v1/core/kv_cache_planning.py:77: 'To serve at least one request with the model’s max seq len (<*>), (<*> KV cache is needed,'"),
        ),
    ),
    _Rule(
        "kv_pool_exhausted",  # raised only by the scheduler's batch loop
        Cause.KV_POOL_TOO_SMALL,
        (
            "alloc_req_slots runs out of memory", "runs out of memory. please set a smaller number",
            "prefill out of memory", "decode out of memory", "out of memory. try to lower your batch size",
        ),
        usual_phase=Phase.SERVING,
        phase_in_text=True,
        origins=(("runs out of memory. please set a smaller number", "sglang-legacy"),),
        cites=(("out of memory. try to lower your batch size", "sglang 0.5.23 srt/mem_cache/allocation.py:167: 'Out of memory. Try to lower your batch size.'"),
               ("decode out of memory", "sglang 0.5.23 srt/mem_cache/allocation.py:617: 'Decode out of memory. Try to lower your batch size.'"),
               ("prefill out of memory", "sglang 0.5.23 srt/mem_cache/allocation.py:243: 'Prefill out of memory. Try to lower your batch size.'"),
               ("alloc_req_slots runs out of memory", "sglang 0.5.23 srt/mem_cache/allocation.py:344: 'alloc_req_slots runs out of memory. Please set a smaller number for `--max-running-request'"),
               ("runs out of memory. please set a smaller number", "sglang 0.5.23 srt/mem_cache/allocation.py:344: 'alloc_req_slots runs out of memory. Please set a smaller number for `--max-running-request'"),),
    ),
)
