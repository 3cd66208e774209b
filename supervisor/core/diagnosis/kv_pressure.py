"""The words SGLang prints when its KV pool runs short while serving (read by the daemon
while the server serves; ``unit/life.py`` spots them in its output)."""

from __future__ import annotations

# What SGLang prints when its KV pool runs short while serving, as (origin, words, source).
# A retraction is told by its details, "#retracted_reqs: N, #new_tokens_gained: M", the same
# in every release: 0.5.23 prefixes them with "KV cache pool is full. Retract requests. "
# (srt/managers/scheduler.py, logger.warning), the releases before it with "Decode out of
# memory happened. " (and SGLang's own test switch SGLANG_TEST_RETRACT with "Testing
# retraction. "). A line with N = 0 retracted nothing and does not count. 0.5.23 also refuses
# a request that cannot fit even alone: "retract_decode: aborted last request RID due to OOM"
# (srt/managers/schedule_batch.py; the client gets "Out of memory even after retracting all
# other requests"). The source contract checks the "sglang" ones.
KV_PRESSURE_WORDS = (
    ("sglang", "#retracted_reqs: ", "retraction"),
    ("sglang", "retract_decode: aborted last request", "refused"),
)
NOTHING_RETRACTED = "#retracted_reqs: 0,"
