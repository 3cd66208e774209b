"""The message catalogue and the module table (issue 23, docs/catalogue.md).

The committed ``supervisor/core/diagnosis/data/catalogue.tsv`` and ``modules.tsv`` are what
``scripts/catalogue/harvest.py`` makes from the pinned sources (the one slow test: it downloads
what the cache lacks); the rest reads the committed files and the harvester's parts and needs
no download.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from collections import Counter
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import pytest

from supervisor.core.diagnosis import catalogue as cat

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts" / "catalogue"
HARVEST = SCRIPTS / "harvest.py"
CATALOGUE_TSV = REPO / "supervisor" / "core" / "diagnosis" / "data" / "catalogue.tsv"
MODULES_TSV = REPO / "supervisor" / "core" / "diagnosis" / "data" / "modules.tsv"

FAMILIES = {
    "cuda.memory", "cuda.hardware", "cuda.launch", "cuda.toolchain", "cuda.environment", "cuda.other",
    "host.memory", "hint.memory", "kv_pool.startup", "kv_pool.exhausted", "nccl.error", "nccl.echo",
    "port.bind", "config.args", "model.load", "watchdog", "process.exit", "generic", "other",
}
LEVELS = {"exception", "critical", "error", "warning", "info", "debug", "warn", "lib", "table"}
SUBSYSTEMS = {"config", "model_load", "cuda", "distributed", "memory", "http", "dispatch", "scheduler", "model",
              "other"}
PREFIX = "[2025-11-30 02:11:04 TP0] "

sys.path.insert(0, str(SCRIPTS))
import extract  # noqa: E402  (scripts/catalogue/extract.py)
import families  # noqa: E402  (scripts/catalogue/families.py)
import harvest  # noqa: E402  (scripts/catalogue/harvest.py; importing it runs nothing)

from supervisor.core.diagnosis.specificity import specificity  # noqa: E402


def _rows() -> list[list[str]]:
    return [line.split("\t") for line in CATALOGUE_TSV.read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")][1:]


def reading(line: str) -> cat.Entry | None:
    """The entry the diagnosis reads a line as (``diagnosis.read_line``): the family's entry
    when the line names one (a wrapper: the error it holds), else the best match."""
    from supervisor.core.diagnosis import read_line

    return read_line(line)[1]


# --------------------------------------------------------------------------- the generator


@pytest.mark.timeout(1800)
def test_the_committed_catalogue_is_what_the_generator_makes(capsys: pytest.CaptureFixture[str]) -> None:
    """``harvest.py --check``: the pinned sources give exactly the committed files (it downloads
    what the cache lacks; a source it cannot get fails the test)."""
    r = subprocess.run([sys.executable, str(HARVEST), "--check"], capture_output=True, text=True, cwd=REPO,
                       timeout=1750, check=False)
    assert r.returncode == 0, f"harvest.py --check failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    for generator in ("meanings.py", "functions.py"):  # the tables beside it (issue 35)
        g = subprocess.run([sys.executable, str(HARVEST.parent / generator), "--check"], capture_output=True,
                           text=True, cwd=REPO, timeout=600, check=False)
        assert g.returncode == 0, f"{generator} --check failed:\n{g.stdout}\n{g.stderr[-3000:]}"
    rows = _rows()
    by_source: Counter[str] = Counter(s for row in rows for s in row[4].split(","))
    by_family: Counter[str] = Counter(row[0] for row in rows)
    with capsys.disabled():
        print(f"\ncatalogue: {len(rows)} rows, {CATALOGUE_TSV.stat().st_size // 1024} KiB; {r.stdout.strip()}")
        for source, n in by_source.most_common():
            print(f"  {source:32} {n:6}")
        for family, n in by_family.most_common():
            print(f"  {family:32} {n:6}")


# --------------------------------------------------------------------------- the committed catalogue


def test_the_committed_catalogue_parses_with_its_header() -> None:
    text = CATALOGUE_TSV.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0] == harvest.HEADER
    assert lines[1].startswith("# versions: sglang==0.5.23, ")
    assert lines[2] == "family\tlevel\tpattern\torigin\tseen_in\tshared" == cat.HEADER
    c = cat.parse_catalogue(text)
    assert len(c) == len(lines) - 3 > 10_000
    assert c.versions[0] == "sglang==0.5.23"
    assert {"torch==2.14.1", "nvidia-nccl-cu13==2.30.7", "nvidia-cuda-runtime==13.0.96", "cpython==3.11"} <= set(
        c.versions)


def test_every_row_is_well_formed_and_sorted() -> None:
    """Six columns, a known family and level, a pattern without tabs or newlines, each row once,
    sorted; every dist==version of seen_in is a pinned one, the origin names the first, and
    ``shared`` is one of "", "head", "all"."""
    c = cat.catalogue()
    versions = set(c.versions)
    rows = _rows()
    assert rows == sorted(rows, key=lambda r: (r[0], r[1], r[2]))
    assert len({(r[0], r[1], r[2]) for r in rows}) == len(rows)
    for family, level, pattern, origin, seen, shared in rows:
        assert shared in ("", "head", "all"), shared
        assert family in FAMILIES, family
        assert level in LEVELS, level
        assert pattern == pattern.strip() and "\n" not in pattern and pattern
        tags = seen.split(",")
        assert tags and set(tags) <= versions, seen
        dist, version = origin.split(" ", 2)[:2]
        assert f"{dist}=={version}" in tags or dist == "glibc", origin
        assert "site-packages" not in origin and not origin.startswith("/")


def test_patterns_have_enough_literal_text() -> None:
    """Every pattern has MIN_LITERAL_CHARS letters outside its placeholders, except an error
    table's rows and the wrappers whose <*> the diagnosis reads again ("CUDA error: <*>")."""
    short = [(level, pattern) for _family, level, pattern, _o, _s, _shared in _rows()
             if level != "table" and cat.literal_chars(pattern) < cat.MIN_LITERAL_CHARS]
    assert all(extract.WRAPPER.match(p) for _level, p in short), short[:10]
    assert ("exception", "CUDA error: <*>") in short or ("lib", "CUDA error: <*>") in short


@pytest.mark.parametrize(("family", "level", "pattern", "source"), [
    ("cuda.memory", "table", "out of memory", "nvidia-cuda-runtime==13.0.96"),
    ("cuda.memory", "lib", "CUDA out of memory. Tried to allocate", "torch==2.14.1"),
    ("cuda.launch", "table", "an illegal memory access was encountered", "nvidia-cuda-runtime==13.0.96"),
    ("cuda.hardware", "table", "uncorrectable ECC error encountered", "nvidia-cuda-runtime==13.0.96"),
    ("cuda.environment", "table", "invalid device ordinal", "nvidia-cuda-runtime==13.0.96"),
    ("cuda.toolchain", "table", "no kernel image is available for execution on the device",
     "nvidia-cuda-runtime==13.0.96"),
    ("kv_pool.startup", "exception", "Not enough memory. Please try to increase --mem-fraction-static.",
     "sglang==0.5.23"),
    ("kv_pool.exhausted", "exception", "Prefill out of memory. Try to lower your batch size.", "sglang==0.5.23"),
    ("port.bind", "exception", "error while attempting to bind on address <*>: <*>", "cpython==3.11"),
    ("nccl.error", "table", "unhandled cuda error (run with NCCL_DEBUG=INFO for details)", "nvidia-nccl-cu13==2.30.7"),
    ("nccl.echo", "table", "remote process exited or there was a network error", "nvidia-nccl-cu13==2.30.7"),
    ("host.memory", "lib", "DefaultCPUAllocator: can't allocate memory: you tried to allocate", "torch==2.14.1"),
    ("hint.memory", "lib", "Cannot allocate memory", "cpython==3.11"),
    ("generic", "error", "Scheduler hit an exception: <*>", "sglang==0.5.23"),
    ("cuda.other", "table", "cudaErrorInvalidValue", "nvidia-cuda-runtime==13.0.96"),
])
def test_well_known_messages_are_there_in_their_family(family: str, level: str, pattern: str, source: str) -> None:
    found = [e for e in cat.catalogue().entries if e.pattern == pattern and e.level == level]
    assert found, f"{level} {pattern!r} is not in the catalogue"
    assert {e.family for e in found} == {family}
    assert any(source in e.seen_in for e in found)


def test_the_reference_release_wins_the_origin() -> None:
    """A message of all three SGLang releases names SGLang 0.5.23's file and line."""
    e = next(e for e in cat.catalogue().entries
             if e.pattern == "Not enough memory. Please try to increase --mem-fraction-static.")
    assert e.seen_in[0] == "sglang==0.5.23" and len(e.seen_in) >= 2
    assert e.origin.startswith("sglang 0.5.23 srt/") and " raise RuntimeError" in e.origin


@pytest.mark.parametrize(("line", "family"), [
    (PREFIX + "RuntimeError: CUDA error: out of memory", "cuda.memory"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.38 GiB. GPU 3 has a total capacity of "
     "79.25 GiB of which 412.81 MiB is free.", "cuda.memory"),
    (PREFIX + "RuntimeError: CUDA error: an illegal memory access was encountered", "cuda.launch"),
    ("[2025-11-30 02:11:04 TP7] RuntimeError: CUDA error: uncorrectable ECC error encountered", "cuda.hardware"),
    ("RuntimeError: CUDA error: invalid device ordinal", "cuda.environment"),
    (PREFIX + "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
     "Current value: mem_fraction_static=0.61", "kv_pool.startup"),
    ("ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 31000): address already in use",
     "port.bind"),
    ("misc/socket.cc:50 NCCL WARN Cuda failure 'out of memory'", "cuda.memory"),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, "
     "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3", "nccl.error"),
    (PREFIX + "Prefill out of memory. Try to lower your batch size.", "kv_pool.exhausted"),
    (PREFIX + "Try to allocate 8192 tokens.", "kv_pool.exhausted"),
    ("[2025-11-30 02:11:04] Rank 2 scheduler died during initialization (exit code: -9). If exit code is -9 "
     "(SIGKILL), a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.", "process.exit"),
    (PREFIX + "Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)", "watchdog"),
    ("[rank3]:[E1130 02:11:04.118 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation "
     "timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=4096) ran for 600031 milliseconds", "nccl.echo"),
    ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 3221225472 bytes. "
     "Error code 12 (Cannot allocate memory)", "host.memory"),
    ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
     "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
     "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory.html for more details.",
     "kv_pool.startup"),
    ("safetensors_rust.SafetensorError: Error while deserializing header: header too large", "model.load"),
])
def test_realistic_lines_are_read_in_their_family(line: str, family: str) -> None:
    """Lines as servers print them (a log prefix, other numbers than the source's) are found,
    and a wrapper is read for the error it holds."""
    e = reading(line)
    assert e is not None, line
    assert e.family == family, (e.family, e.pattern, e.origin)


def test_a_wrapper_hands_its_inner_error_to_the_tables() -> None:
    c = cat.catalogue()
    m = c.match(PREFIX + "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert m is not None and m.entry.family == "cuda.other" and m.inner is not None
    assert m.inner.startswith("an illegal memory access")
    nccl = c.match("unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3", tables=True)
    assert nccl is not None and nccl.entry.family == "nccl.error"


# --------------------------------------------------------------------------- the module table


def test_the_module_table_has_every_top_level_package() -> None:
    rows = cat.parse_modules(MODULES_TSV.read_text(encoding="utf-8"))
    assert MODULES_TSV.read_text(encoding="utf-8").startswith("module\tsubsystem\n")
    assert {s for _p, s in rows} <= SUBSYSTEMS
    tops = {p.split("/", 1)[0] for p, _s in rows}
    assert {"sglang", "torch", "vllm", "triton", "flashinfer", "sgl_kernel", "transformers", "safetensors",
            "huggingface_hub", "uvicorn", "asyncio", "argparse.py", "multiprocessing"} <= tops
    assert len({p for p, _s in rows}) == len(rows)


@pytest.mark.parametrize(("frame", "subsystem"), [
    ("/usr/local/lib/python3.10/dist-packages/sglang/srt/server_args.py", "config"),
    ("/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", "scheduler"),
    ("/sgl-workspace/sglang/python/sglang/srt/managers/tp_worker.py", "scheduler"),
    ("/sgl-workspace/sglang/python/sglang/srt/mem_cache/memory_pool.py", "memory"),
    ("/sgl-workspace/sglang/python/sglang/srt/model_loader/loader.py", "model_load"),
    ("/sgl-workspace/sglang/python/sglang/srt/models/deepseek_v2.py", "model"),
    ("/sgl-workspace/sglang/python/sglang/srt/distributed/device_communicators/pynccl.py", "distributed"),
    ("/sgl-workspace/sglang/python/sglang/srt/model_executor/cuda_graph_runner.py", "scheduler"),
    ("/sgl-workspace/sglang/python/sglang/srt/entrypoints/http_server.py", "http"),
    ("/usr/local/lib/python3.12/dist-packages/torch/nn/modules/module.py", "dispatch"),
    ("/usr/local/lib/python3.12/dist-packages/torch/utils/_contextlib.py", "dispatch"),
    ("/usr/local/lib/python3.10/dist-packages/torch/distributed/distributed_c10d.py", "distributed"),
    ("/usr/local/lib/python3.10/dist-packages/torch/cuda/__init__.py", "cuda"),
    ("/opt/venv/lib/python3.12/site-packages/vllm/model_executor/models/deepseek_v2.py", "model"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", "scheduler"),
    ("/usr/local/lib/python3.12/dist-packages/triton/compiler/compiler.py", "cuda"),
    ("/usr/lib/python3.10/multiprocessing/process.py", "dispatch"),
    ("/usr/lib/python3.12/asyncio/base_events.py", "dispatch"),
])
def test_frame_paths_resolve_to_their_subsystem(frame: str, subsystem: str) -> None:
    assert cat.subsystem(frame) == subsystem


def test_the_data_ship_with_the_package() -> None:
    """The three files are package data: importlib.resources finds them in the installed package."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/*.tsv" in data["supervisor.core.diagnosis"] and "data/*.idx" in data["supervisor.core.diagnosis"]
    root = resources.files("supervisor.core.diagnosis").joinpath("data")
    assert all(root.joinpath(name).is_file() for name in ("catalogue.tsv", "catalogue.idx", "modules.tsv"))
    assert len(cat.catalogue()) > 10_000 and len(cat.modules()) > 100


def test_the_committed_index_is_the_catalogues_and_reads_the_same_entries() -> None:
    """catalogue.idx is what index_text makes of the committed catalogue.tsv (make catalogue
    writes both); through it the daemon reads rows only when a line's words bring them up,
    and every row (its head too), every candidate list and every match is the same as the whole file's."""
    text = CATALOGUE_TSV.read_text(encoding="utf-8")
    assert (CATALOGUE_TSV.parent / "catalogue.idx").read_text(encoding="utf-8") == cat.index_text(text)
    whole, indexed = cat.parse_catalogue(text), cat.catalogue()
    assert isinstance(indexed.entries, cat.FileRows) and indexed.versions == whole.versions
    assert list(indexed.entries) == list(whole.entries)
    # each row's head as the index gives it (not worked out again at each read) is the one worked out
    assert len(indexed.entries._heads) == 2 * len(whole.entries)
    def heads(rows: Sequence[cat.Entry]) -> list[tuple[str, int, str]]:
        return [(e.head, e.literal, e.piece) for e in rows]

    assert heads(indexed.entries) == heads(whole.entries)
    for line in ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity",
                 "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled cuda error",
                 "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
                 "CUDA error: an illegal memory access was encountered"):
        assert indexed.matches(line) == whole.matches(line), line
        assert indexed.candidates(cat.normalise(line)) == whole.candidates(cat.normalise(line))


def test_a_loaded_catalogue_reads_its_own_file_after_an_upgrade_replaced_it(tmp_path: Path) -> None:
    """An upgrade (pip) replaces catalogue.tsv on disk under a running daemon: the daemon's
    rows are still read from the file its index was checked against, not the new one at
    offsets that no longer fit it."""
    text = CATALOGUE_TSV.read_text(encoding="utf-8")
    tsv, idx = tmp_path / "catalogue.tsv", tmp_path / "catalogue.idx"
    tsv.write_text(text, encoding="utf-8")
    idx.write_text(cat.index_text(text), encoding="utf-8")
    loaded = cat._load_indexed(tsv, idx)
    assert loaded is not None and isinstance(loaded.entries, cat.FileRows)
    whole = cat.parse_catalogue(text).entries
    lines = text.splitlines(keepends=True)
    newer = tmp_path / "catalogue.tsv.new"
    newer.write_text("".join(lines[:3] + lines[3:][::-1]), encoding="utf-8")  # every row moved
    os.replace(newer, tsv)
    rows = range(0, len(whole), 997)
    assert [loaded.entries[i] for i in rows] == [whole[i] for i in rows]
    assert loaded.entries[len(whole) - 1] == whole[-1]


# --------------------------------------------------------------------------- the harvester's parts


SOURCE = '''
import logging, sys, warnings
logger = logging.getLogger(__name__)
PREFIX = "Scheduler"

def check(x, n):
    if x <= 0:
        msg = "Not enough memory. Please try to increase --mem-fraction-static."
        if n:
            msg += f" Current value: {n}"
        raise RuntimeError(msg)
    logger.error("Prefill out of memory. Try to allocate %d tokens (%.2f GiB).", x, n)
    logger.exception(f"{PREFIX} hit an exception: {x}")
    warnings.warn("this option is deprecated and will be removed " + str(n))
    assert x < 10, "x must be smaller than ten, got {}".format(x)
    print("fatal: cannot open the weights at", x, file=sys.stderr)
    raise ValueError(x)

def build(rank):
    return RuntimeError(f"Rank {rank} scheduler died during initialization (exit code: {rank}).")
'''


def test_the_harvester_reads_each_kind_of_message() -> None:
    got = {(e["level"], e["pattern"], e["kind"]) for e in extract.harvest_python(SOURCE.encode(), "pkg/mod.py")}
    assert got == {
        ("exception", "Not enough memory. Please try to increase --mem-fraction-static.", "raise RuntimeError"),
        ("error", "Prefill out of memory. Try to allocate <*> tokens (<*>).", "logger.error"),
        ("error", "<*> hit an exception: <*>", "logger.exception"),
        ("warning", "this option is deprecated and will be removed <*>", "warnings.warn"),
        ("error", "x must be smaller than ten, got <*>", "assert"),
        ("error", "fatal: cannot open the weights at <*>", "print stderr"),
        ("exception", "Rank <*> scheduler died during initialization (exit code: <*>).", "raise RuntimeError"),
    }


def test_a_pattern_matches_the_line_its_source_prints() -> None:
    """What the normaliser folds with a value in a line (a unit, a path) goes into the <*>."""
    cases = [
        ("Tried to allocate \ue000 GiB on \ue000/config.json", "Tried to allocate 2.00 GiB on /models/x/config.json"),
        ("address 0x\ue000 is not mapped (rank \ue000)", "address 0x7f3a12 is not mapped (rank 3)"),
        ("loaded \ue000 shards from /data/\ue000", "loaded 8 shards from /data/llama/weights"),
    ]
    for message, line in cases:
        pattern = extract.to_pattern(message)
        assert cat.compile_pattern(pattern).search(cat.normalise(line)), (pattern, cat.normalise(line))


def test_library_strings_keep_messages_and_drop_code() -> None:
    blob = b"\x00".join([
        b"CUDA out of memory. Tried to allocate ", b"_ZN3c104cuda20CUDACachingAllocator4initEi",
        b"aten::add.Tensor(Tensor self, Tensor other) -> Tensor", b"/pytorch/c10/cuda/CUDACachingAllocator.cpp",
        b"Failed to CUDA calloc %ld bytes", b"PYTORCH_CUDA_ALLOC_CONF", b"NCCL INFO Channel %02d/%02d",
    ])
    kept = {e["pattern"] for e in extract.harvest_lib(blob, {"path": "lib/x.so", "strings": "lib"})}
    assert kept == {"CUDA out of memory. Tried to allocate", "Failed to CUDA calloc <*>"}


def test_an_error_table_is_read_between_its_bounds() -> None:
    blob = b"\x00junk string here\x00cudaSuccess\x00no error\x00cudaErrorMemoryAllocation\x00out of memory\x00" \
           b"cudaErrorNoDevice\x00no CUDA-capable device is detected\x00cudaGetDeviceCount\x00"
    got = extract.harvest_lib(blob, {"path": "lib/cudart.so", "table": ["cudaSuccess", "no CUDA-capable device is "
                                                                         "detected"], "strings": "none"})
    assert [(e["pattern"], e.get("pair")) for e in got] == [
        ("cudaErrorMemoryAllocation", "out of memory"), ("out of memory", None),
        ("cudaErrorNoDevice", "no CUDA-capable device is detected"), ("no CUDA-capable device is detected", None),
    ]


@pytest.mark.parametrize(("pattern", "level", "exc", "module", "dist", "family"), [
    ("value of --tp-size must divide the number of heads", "exception", "ValueError", "sglang/srt/server_args.py",
     "sglang", "config.args"),
    ("checkpoint shard <*> has no tensor <*>", "exception", "KeyError", "sglang/srt/model_loader/loader.py",
     "sglang", "model.load"),
    ("head_dim <*> is not supported by this kernel", "exception", "ValueError", "flashinfer/decode.py",
     "flashinfer-python", "other"),
    ("kernel compilation failed: <*>", "exception", "RuntimeError", "flashinfer/jit/core.py", "flashinfer-python",
     "cuda.other"),
    ("Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=<*>.", "exception",
     "ValueError", "sglang/srt/mem_cache/kv_cache_configurator.py", "sglang", "kv_pool.startup"),
    ("Initializing the NCCL communicator with <*> ranks", "info", "", "torch/distributed/x.py", "torch", "other"),
])
def test_the_family_rules_use_words_module_type_and_source(pattern: str, level: str, exc: str, module: str,
                                                             dist: str, family: str) -> None:
    sub = families.subsystem_of(module)
    assert families.classify(pattern, level, exc, module, sub, dist) == family


def test_the_module_table_is_compressed_without_changing_an_assignment() -> None:
    paths = ["pkg/a/x.py", "pkg/a/y.py", "pkg/a/mem_cache/p.py", "pkg/server_args.py", "pkg/models/m.py",
             "pkg/models/n.py", "pkg/layers/attention/k.py"]
    rows = sorted(families.module_table(paths), key=lambda r: -len(r[0]))
    for p in paths:
        assert families.lookup(p, rows) == families.subsystem_of(p), p
    assert len(rows) < len(paths)


# --------------------------------------------------------------------------- specificity


def test_specificity_says_which_words_are_shared_from_the_catalogue_alone() -> None:
    """A message whose words recur in a message of another family names no cause ("all");
    one whose opening words alone recur needs the whole message in the line ("head"); the
    more specific message that holds the shared words keeps its own ("")."""
    entries = [
        cat.Entry("model.load", "exception", "Failed to load <*>", "a 1 a.py:1 raise"),
        cat.Entry("cuda.other", "exception", "Failed to load the kernel library <*> for this GPU", "b 1 b.py:1 raise"),
        cat.Entry("cuda.other", "exception", "Timed out after <*>s waiting for the kernel cache lock <*>", "c 1 c.py:1"),
        cat.Entry("other", "exception", "Timed out after <*>s waiting for <*>", "d 1 d.py:1 raise"),
        cat.Entry("config.args", "exception", "Unknown attention backend <*>, choose one of <*>", "e 1 e.py:1 raise"),
    ]
    assert specificity(entries) == ["all", "", "head", "", ""]


def test_the_committed_catalogue_marks_shared_words_and_the_reading_obeys() -> None:
    """The generator wrote the column; a line holding only shared opening words names nothing."""
    rows = _rows()
    shared = Counter(r[5] for r in rows)
    assert shared["all"] > 100 and shared["head"] > 100 and shared[""] > 40_000
    timed_out = [r for r in rows if r[2] == "Timed out after <*>s waiting for <*> lock: <*>"]
    assert timed_out and timed_out[0][5] == "head"
    assert reading_family("RuntimeError: Timed out after 30s waiting for the scheduler to answer") is None


def reading_family(line: str) -> str | None:
    from supervisor.core.diagnosis import read_line

    return read_line(line)[0]


@pytest.mark.parametrize("count", [0, 1, 7, 5000])
def test_the_index_numbers_parse_the_same_in_pieces(count: int) -> None:
    """The index's number lists are parsed a few KB at a time (no 42,000 strings at once):
    every piece boundary, even one inside a tiny piece, gives back the same numbers."""
    from supervisor.core.diagnosis.catalogue import _numbers

    numbers = [(i * 7919) % 10_000_019 for i in range(count)]
    text = ",".join(map(str, numbers))
    for piece in (1, 3, 50, 4096):
        assert list(_numbers(text, piece)) == numbers
