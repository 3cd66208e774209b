"""Benchmark: how long ``diagnose`` takes on big logs (serving noise + a real crash at the end).

For each size it writes a temporary log of SGLang serving lines (batch lines, HTTP access
lines, a few warnings) ending in a scheduler's runtime CUDA-OOM traceback, then times, side
by side in one run:

- ``diagnose_s``: ``diagnose(data)`` on the whole log already in memory;
- ``tail_read_and_diagnose_s``: reading the last ``MAX_TAIL_BYTES`` of the file and
  diagnosing them (what a caller holding a file does).

Each is reported as median/min/max seconds over ``repeats``, with the diagnosed cause as a
sanity check. Run: ``.venv/bin/python bench/bench_diagnosis.py [SIZE_MB ...]``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from supervisor.core.diagnosis import MAX_TAIL_BYTES, diagnose

MB = 1024 * 1024

CRASH = """\
[2026-03-01 13:00:00 TP3] Scheduler hit an exception: Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2890, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "/usr/local/lib/python3.12/dist-packages/torch/utils/_contextlib.py", line 116, in decorate_context
    return func(*args, **kwargs)
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 1010, in event_loop_overlap
    batch_result = self.run_batch(batch)
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 1780, in run_batch
    logits_output, next_token_ids, can_run_cuda_graph = self.tp_worker.forward_batch_generation(
  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", line 1199, in forward_extend
    return self.model.forward(
  File "/sgl-workspace/sglang/python/sglang/srt/models/deepseek_v2.py", line 2919, in forward
    hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 139.72 GiB \
of which 1.12 GiB is free. Including non-PyTorch memory, this process has 138.59 GiB memory in use.
[2026-03-01 13:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
Killed
"""


def _noise_block(lines: int = 6000) -> bytes:
    out = []
    for i in range(lines):
        t = f"[2026-03-01 12:{(i // 60) % 60:02d}:{i % 60:02d}"
        if i % 3 == 0:
            out.append(f"{t} TP0] Decode batch. #running-req: {i % 211}, #token: {i * 37 % 90000}, "
                       f"token usage: 0.{i % 90 + 10}, cuda graph: True, gen throughput (token/s): 1874.21, #queue-req: 0, ")
        elif i % 3 == 1:
            out.append(f'{t}] INFO:     10.0.{i % 250}.7:{40000 + i % 20000} - "POST /v1/chat/completions HTTP/1.1" 200 OK')
        elif i % 97 == 2:
            out.append(f"{t} TP0] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_token_ratio: 0.7")
        else:
            out.append(f"{t} TP0] Prefill batch. #new-seq: 1, #new-token: {i % 8192}, #cached-token: 512, token usage: 0.41")
    return ("\n".join(out) + "\n").encode()


def _write_log(path: Path, size_mb: int) -> None:
    block = _noise_block()
    target = size_mb * MB - len(CRASH)
    with path.open("wb") as f:
        written = 0
        while written + len(block) <= target:
            f.write(block)
            written += len(block)
        f.write(block[: max(0, target - written)].rsplit(b"\n", 1)[0] + b"\n")
        f.write(CRASH.encode())


def _read_tail(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(max(0, os.path.getsize(path) - MAX_TAIL_BYTES))
        return f.read()


def _diagnose_file_tail(path: Path) -> object:
    return diagnose(_read_tail(path), phase=None)


def _timed(fn: Callable[[], object], repeats: int) -> tuple[dict[str, float], object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}, result


def run(sizes_mb: Iterable[int] = (1, 50, 500), repeats: int = 3) -> dict:
    """Time diagnose on logs of the given sizes; a JSON-able report."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_diagnosis_") as tmp:
        for size in sizes_mb:
            path = Path(tmp) / f"{size}mb.log"
            _write_log(path, size)
            whole, d = _timed(partial(diagnose, path.read_bytes(), phase=None), repeats)
            tail, _ = _timed(partial(_diagnose_file_tail, path), repeats)
            path.unlink()
            results[f"{size}MB"] = {
                "bytes": size * MB,
                "diagnose_s": whole,
                "tail_read_and_diagnose_s": tail,
                "cause": str(d.cause),  # type: ignore[attr-defined]
                "location": d.location,  # type: ignore[attr-defined]
            }
    return {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": "python bench/bench_diagnosis.py " + " ".join(str(s) for s in sizes_mb),
        "max_tail_bytes": MAX_TAIL_BYTES,
        "repeats": repeats,
        "results": results,
    }


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [1, 50, 500]
    print(json.dumps(run(sizes), indent=2))
