"""Diagnosis speed (issue 8, row 7): ``explain`` on logs of 1 MB, 50 MB and 500 MB.

The logs are the diagnosis benchmark's (``bench/bench_diagnosis.py``): generated SGLang
serving noise ending in a real runtime CUDA-OOM traceback. Two figures per size:

- the whole ``sglang-supervisor explain LOG --json`` process (it streams the file once for
  the startup facts and line numbers, and diagnoses the last 4 MiB), checked to name
  ``cuda_oom_runtime``;
- ``bench_diagnosis.run``: the in-process read of the tail + ``diagnose`` (what the daemon
  does at a crash), reported in the note.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from . import bench_diagnosis
from .common import PY, Row, Section, Settings, Stat


def _explain(path: Path) -> tuple[float, str]:
    cli = str(Path(PY).parent / "sglang-supervisor")
    start = time.monotonic()
    done = subprocess.run([cli, "explain", str(path), "--json"], capture_output=True, text=True, check=True)
    elapsed = time.monotonic() - start
    return elapsed, json.loads(done.stdout)["cause"]


def run(settings: Settings) -> Section:
    sizes = (1,) if settings.quick else (1, 50, 500)
    inproc = bench_diagnosis.run(sizes_mb=sizes, repeats=settings.repeats)
    section = Section("explain", raw={"diagnose": inproc, "explain_s": {}})
    for size in sizes:
        path = settings.dir("explain") / f"{size}mb.log"
        bench_diagnosis._write_log(path, size)  # the diagnosis benchmark's generator
        try:
            runs = [_explain(path) for _ in range(settings.repeats)]
        finally:
            path.unlink()
        causes = {cause for _, cause in runs}
        section.raw["explain_s"][f"{size}MB"] = {"seconds": [t for t, _ in runs], "causes": sorted(causes)}
        tail = inproc["results"][f"{size}MB"]["tail_read_and_diagnose_s"]
        section.rows.append(Row(
            f"explain_{size}mb", f"`explain` on a {size} MB log (whole process)", "s",
            Stat.of([t for t, _ in runs]), met=causes == {"cuda_oom_runtime"},
            goal="names the cause",
            note=f"tail read + `diagnose`: {tail['median'] * 1e3:.1f} ms; cause: {', '.join(sorted(causes))}",
        ))
    return section
