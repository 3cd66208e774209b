"""The hand rules, one module per family, for the words the catalogue cannot hold.

Within one line, rules are tried in a fixed precedence (``RULES``): hardware, host memory,
hints, KV pool, CUDA OOM, specific CUDA faults, port, NCCL, echoes, other CUDA errors,
watchdog, model, config. So a wrapper's message is read for the real error it holds.
"""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _Rule
from supervisor.core.diagnosis.rules import (
    config_args,
    cuda_errors,
    cuda_memory,
    hardware,
    host_memory,
    kv_pool,
    model_load,
    nccl,
    port,
    watchdog,
)

RULES: tuple[_Rule, ...] = (
    *hardware.RULES,
    *host_memory.RULES,
    *host_memory.HINTS,
    *kv_pool.RULES,
    *cuda_memory.RULES,
    *cuda_errors.FAULTS,
    *port.RULES,
    *nccl.ERRORS,
    *nccl.ECHOES,
    *cuda_errors.OTHER,
    *watchdog.RULES,
    *model_load.RULES,
    *config_args.RULES,
)
_NEEDLES: tuple[str, ...] = tuple(dict.fromkeys(n for rule in RULES for n in rule.needles))
