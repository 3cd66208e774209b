"""The SGLang + GPU simulator, run as a real subprocess: startup lines, HTTP, deaths, GPU memory."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import free_port, wait_until

from supervisor.sim import simgpu, simulator
from supervisor.sim.simulator import VERSIONS

pytestmark = pytest.mark.integration

GIB = simgpu.GIB
START_S = 60.0  # generous: 2 shared cores
READY = "The server is fired up and ready to roll!"


class Sim:
    """One simulator process (its own session) with its output collected line by line."""

    def __init__(self, tmp_path: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None,
                 kernel_log: bool = True) -> None:
        self.port = port or free_port()
        self.gpu_dir = tmp_path / "gpus"
        self.stamp = tmp_path / f"stamp-{self.port}"
        self.kernel_log = tmp_path / "kern.log"
        cmd = [
            sys.executable, "-m", "supervisor.sim.simulator", "--model-path", "/models/DeepSeek-V3",
            "--port", str(self.port), "--sim-load-s", "0.2", "--sim-gpu-dir", str(self.gpu_dir),
            "--sim-crash-stamp", str(self.stamp), *(["--sim-kernel-log", str(self.kernel_log)] if kernel_log else []),
            *args,
        ]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True,
            env={**os.environ, **(env or {})},
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, needle: str, timeout: float = START_S) -> str:
        """The first output line containing ``needle`` (waits for it)."""
        def find() -> str | None:
            return next((line for line in list(self.lines) if needle in line), None)
        return wait_until(find, timeout=timeout, what=f"a line with {needle!r}; got:\n{self.text[-3000:]}")

    def wait_ready(self) -> None:
        self.wait_line(READY)

    def wait_exit(self, timeout: float = START_S) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def children(self) -> dict[str, psutil.Process]:
        """The simulator's children by process title."""
        return {title(p): p for p in psutil.Process(self.proc.pid).children()}

    def gpu_used(self, index: int) -> int:
        return next(g.used_bytes for g in simgpu.read_gpus(self.gpu_dir) if g.index == index)

    def stop(self) -> None:
        try:  # the group outlives its leader while an orphan is in it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)


@pytest.fixture
def sim(tmp_path: Path, no_leftovers: None) -> Iterator[Callable[..., Sim]]:
    """Starts simulators; kills each one's whole process group (orphans too) afterwards."""
    started: list[Sim] = []

    def start(*args: str, port: int | None = None, env: dict[str, str] | None = None, kernel_log: bool = True) -> Sim:
        # The default is 0.5.23 (the real tier's release); tests written for 0.5.6's ways say so
        # by leaving the version out, tests of 0.5.23 name it.
        if "--sim-version" not in args:
            args = ("--sim-version", "0.5.6", *args)
        s = Sim(tmp_path, *args, port=port, env=env, kernel_log=kernel_log)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def title(p: psutil.Process) -> str:
    """A process title as ps shows it (setproctitle pads the argv area with spaces)."""
    return " ".join(p.cmdline()).strip()


def call(port: int, path: str, body: Any = None, timeout: float = 10.0) -> int | str:
    """HTTP status of one request, or "refused" / "timeout" / "error"."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return "refused"
        return "timeout" if isinstance(exc.reason, TimeoutError) else "error"
    except TimeoutError:
        return "timeout"
    except (ConnectionError, http.client.HTTPException):
        return "error"


def get_json(port: int, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def avail_after_capture(s: Sim, rank: str) -> float:
    line = s.wait_line(f"{rank}] Capture cuda graph end.")
    return float(re.search(r"avail mem=([\d.]+) GB", line).group(1))  # type: ignore[union-attr]


def assert_stamped(s: Sim) -> None:
    stamps = [int(x) for x in s.stamp.read_text().split()]
    assert len(stamps) == 1 and 0 < stamps[0] <= time.monotonic_ns()


def test_seed_profile_startup_lines_titles_memory_and_graceful_drain(sim: Callable[..., Sim]) -> None:
    """At 0.93 on two ranks the seed's numbers, SGLang titles and held GPU memory show, and SIGTERM
    drains, exits 0 and frees the GPUs."""
    s = sim("--tp-size", "2", "--mem-fraction-static", "0.93", "--enable-hierarchical-cache",
            "--hicache-size", "4", "--sim-log-rate", "50")
    s.wait_ready()
    for rank in ("TP0", "TP1"):
        assert avail_after_capture(s, rank) == 0.82
        assert "avail mem=23.67 GB, mem usage=72.33 GB." in s.wait_line(f"{rank}] Load weight end.")
        assert "avail mem=6.72 GB" in s.wait_line(f"{rank}] Memory pool end.")
        assert re.search(r"#tokens: \d+, K size: [\d.]+ GB, V size", s.wait_line(f"{rank}] KV Cache is allocated."))
        assert "available_gpu_mem=0.82 GB" in s.wait_line(f"{rank}] max_total_num_tokens=")
        assert "Allocating 4.00 GB host memory for hierarchical KV cache." in s.wait_line(f"{rank}] Allocating")
    assert set(s.children()) == {"sglang::scheduler_TP0", "sglang::scheduler_TP1", "sglang::detokenizer"}
    # both ranks hold the same: the static footprint and the warm-up's activation peak, which
    # rank 1 learns from its leader (through the main process) a moment after rank 0
    held = wait_until(lambda: (h := {g.index: g.used_bytes for g in simgpu.read_gpus(s.gpu_dir)})[0] == h[1] and h,
                      what="both ranks to hold the warm-up's peak")
    assert abs(held[0] / GIB - (96 - 0.82)) < 0.05 and held[2] == 0

    assert call(s.port, "/health") == 200
    info = get_json(s.port, "/server_info")
    assert info["mem_fraction_static"] == 0.93 and info["tp_size"] == 2
    assert info["memory_usage"]["weight"] == 72.33 and info["memory_usage"]["graph"] == 5.9
    assert info["memory_usage"]["token_capacity"] > 0
    completion = get_json(s.port, "/v1/completions", {"model": "m", "prompt": "a b c", "max_tokens": 3})
    assert completion["choices"][0]["finish_reason"] == "length" and completion["usage"]["prompt_tokens"] == 3
    batch = get_json(s.port, "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2}})
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [3, 2]
    assert all(r["meta_info"]["completion_tokens"] == 2 for r in batch)
    s.wait_line("] Decode batch. #running-req:")

    result: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: result.update(status=call(
        s.port, "/generate", {"text": "one two three four five six seven", "sampling_params": {"max_new_tokens": 400}}, timeout=60)))
    slow.start()
    s.wait_line("#new-seq: 1, #new-token: 7,")  # the 7-word request reached the scheduler
    s.proc.send_signal(signal.SIGTERM)
    s.wait_line("Draining requests and shutting down")
    s.wait_line("Gracefully exiting... Remaining number of requests 1")
    assert s.wait_exit() == 0
    slow.join(timeout=60)
    assert result["status"] == 200
    assert all(g.used_bytes == 0 for g in simgpu.read_gpus(s.gpu_dir))


def test_port_stays_closed_while_weights_load(sim: Callable[..., Sim]) -> None:
    """A slow start keeps the HTTP port closed (connection refused) until the server is ready."""
    s = sim("--sim-load-s", "120")
    s.wait_line("Load weight begin.")
    assert call(s.port, "/health") == "refused"
    assert READY not in s.text


def test_a_long_prefill_ooms_at_0_93_the_sglang_way(sim: Callable[..., Sim]) -> None:
    """A real 4000-token prompt at 0.93 dies by a deepseek_v2.py forward CUDA OOM, SIGQUIT and SIGKILL, freeing the GPU."""
    s = sim("--mem-fraction-static", "0.93")
    s.wait_ready()
    assert s.gpu_used(0) > 90 * GIB
    assert call(s.port, "/generate", {"text": " ".join(["w"] * 4000), "sampling_params": {"max_new_tokens": 4}},
                timeout=30) not in (200, "timeout")
    assert s.wait_exit() == -signal.SIGKILL
    text = s.text
    start = text.index("TP0] Scheduler hit an exception: Traceback (most recent call last):")
    tail = text[start:].splitlines()
    err = next(i for i, line in enumerate(tail) if line.startswith("torch.OutOfMemoryError: CUDA out of memory."))
    assert 'deepseek_v2.py", line 2919, in forward' in tail[err - 2]
    assert "forward_extend" in text[start:] and "forward_batch_generation" in text[start:]
    assert "Tried to allocate 1000.00 MiB. GPU 0 has a total capacity of 96.00 GiB" in tail[err]
    assert any(re.search(r"SIGQUIT received\. signum=3, .*It usually means one child failed\.", line)
               for line in tail[err:])
    assert "Prefill batch. #new-seq: 1, #new-token: 4000" in text
    assert_stamped(s)
    wait_until(lambda: s.gpu_used(0) == 0, what="GPU 0 memory to free")


# mode/flags, expected exit status, lines expected in this order
DEATHS = {
    "runtime_oom": (["--sim-fail", "runtime_oom", "--mem-fraction-static", "0.88"], -9,
                    [READY, "TP0] Scheduler hit an exception: Traceback", "deepseek_v2.py\", line 2919, in forward",
                     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "SIGQUIT received."]),
    "startup_oom": (["--sim-fail", "startup_oom"], -9,
                    ["Capture cuda graph begin.", "Scheduler hit an exception: Traceback", "in init_cuda_graphs",
                     "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate",
                     "Received sigquit from a child process. It usually means the child failed."]),
    "kv_pool_natural_at_0.76": (["--mem-fraction-static", "0.76"], -9,
                                ["Load weight end.", "Scheduler hit an exception: Traceback", "in init_memory_pool",
                                 "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
                                 "Current value: self.server_args.mem_fraction_static=0.76",
                                 "Received sigquit from a child process."]),
    "kv_pool": (["--sim-fail", "kv_pool", "--mem-fraction-static", "0.88"], -9,
                ["RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
                 "Received sigquit from a child process."]),
    "model_load": (["--sim-fail", "model_load"], 1,
                   ["Load weight begin.", "Scheduler hit an exception: Traceback", "in load_model",
                    "FileNotFoundError: [Errno 2] No such file or directory:", "Rank 0 scheduler is dead.",
                    "Exit code: 1", "EOFError"]),
    "host_memory": (["--enable-hierarchical-cache", "--hicache-size", "16", "--sim-host-mem-gb", "20"], -9,
                    ["ValueError: Not enough host memory available. Requesting",
                     "Please reduce the size of the hierarchical cache.", "Received sigquit from a child process."]),
    "exit0": (["--sim-fail", "exit0", "--sim-fail-after-s", "0.1"], 0, [READY]),
    "segfault": (["--sim-fail", "segfault", "--sim-fail-after-s", "0.1"], -signal.SIGSEGV, [READY]),
}


@pytest.mark.parametrize("case", list(DEATHS))
def test_failure_mode_dies_as_sglang_would(sim: Callable[..., Sim], case: str) -> None:
    """Each death prints its SGLang lines in order, exits with SGLang's status, stamps its time and frees the GPU."""
    flags, status, expected = DEATHS[case]
    s = sim(*flags)
    assert s.wait_exit() == status
    pos = 0
    for needle in expected:
        found = s.text.find(needle, pos)
        assert found >= 0, f"{needle!r} missing after position {pos} in:\n{s.text[-4000:]}"
        pos = found + len(needle)
    if status != 0 or case == "exit0":
        assert_stamped(s)
    if status == 1 or case.startswith("kv_pool") or case == "startup_oom":
        assert READY not in s.text
    wait_until(lambda: s.gpu_used(0) == 0, what="GPU 0 memory to free")


@pytest.mark.parametrize("flags", [["--no-such-flag"], ["--tpp", "2"]])
def test_unknown_flag_is_an_argparse_error(sim: Callable[..., Sim], flags: list[str]) -> None:
    """An unknown flag exits 2 with a usage line, like SGLang (0.5.6's parser had no prog)."""
    s = sim(*flags)
    assert s.wait_exit() == 2
    assert s.lines[0].startswith("usage: launch_server.py")
    assert "launch_server.py: error: unrecognized arguments" in s.text


@pytest.mark.parametrize("version", VERSIONS)
def test_flag_prefixes_work_like_sglang(version: str) -> None:
    """argparse prefix matching is on in SGLang (measured on 0.5.23): ``--tp 2`` is ``--tp-size 2``."""
    args = simulator.parse_args(["--sim-version", version, "--model-path", "m", "--tp", "2", "--dp", "2"])
    assert (args.tp_size, args.dp_size) == (2, 2)


def test_hang_accepts_connections_and_never_answers(sim: Callable[..., Sim]) -> None:
    """In hang mode /health and /generate stop answering but the process and port stay up."""
    s = sim("--sim-fail", "hang", "--sim-fail-after-s", "0.2")
    s.wait_ready()
    wait_until(lambda: call(s.port, "/health", timeout=1.0) == "timeout", timeout=30, what="/health to hang")
    with socket.create_connection(("127.0.0.1", s.port), timeout=5):
        pass  # still accepting
    assert call(s.port, "/generate", {"text": "hi"}, timeout=1.0) == "timeout"
    assert s.proc.poll() is None
    assert_stamped(s)


def test_host_oom_0_5_6_leaves_a_zombie_server(sim: Callable[..., Sim]) -> None:
    """With 0.5.6 a kernel-OOM-killed scheduler (named in the kernel log) leaves a parent whose /health says 503."""
    s = sim("--sim-fail", "host_oom", "--sim-fail-after-s", "0.2", "--sim-health-timeout-s", "0.5")
    s.wait_ready()
    tp0 = s.children()["sglang::scheduler_TP0"]
    wait_until(lambda: s.kernel_log.exists() and s.kernel_log.read_text(), what="the kernel log line")
    assert re.fullmatch(rf"\[ *[\d.]+\] Out of memory: Killed process {tp0.pid} \(sglang::schedul\) "
                        r"total-vm:\d+kB, anon-rss:\d+kB, .*", s.kernel_log.read_text().strip())
    wait_until(lambda: tp0.status() == psutil.STATUS_ZOMBIE, what="TP0 to die")
    wait_until(lambda: call(s.port, "/health", timeout=10) == 503, what="/health 503")
    assert s.proc.poll() is None and "Scheduler hit an exception" not in s.text
    s.wait_line("Health check failed.")
    assert s.gpu_used(0) == 0
    assert_stamped(s)


def test_0_5_23_dp_titles_prefixes_and_an_unwatched_scheduler(sim: Callable[..., Sim]) -> None:
    """0.5.23 with DP 2 x TP 2: ``sglang::scheduler_DP0_TP1`` titles and ``DP0 TP1`` prefixes. The
    watchdog watches only the DP controller (``scheduler_0``), so a SIGKILLed scheduler goes
    unseen: no tree kill, and /health fails (the rank is gone)."""
    s = sim("--sim-version", "0.5.23", "--sim-fail", "host_oom", "--sim-fail-after-s", "1.5", "--dp-size", "2",
            "--tp-size", "2", "--enable-hicache", "--hicache-size", "2", "--sim-health-timeout-s", "0.5")
    s.wait_ready()
    assert set(s.children()) == {"sglang::data_parallel_controller", "sglang::scheduler_DP0_TP0",
                                 "sglang::scheduler_DP0_TP1", "sglang::scheduler_DP1_TP0",
                                 "sglang::scheduler_DP1_TP1", "sglang::detokenizer"}
    assert re.search(r"DP1 TP1\] Load weight end\. elapsed=[\d.]+ s, type=\w+, avail mem=23\.67 GB", s.text)
    assert "DP0 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens:" in s.text
    assert "DP0 TP0] Capture target decode CUDA graph end." in s.text
    assert "DP0 TP0] Allocating MLA hierarchical KV host pool:" in s.text
    assert "DP0 TP0] max_total_num_tokens=" in s.text and "TP1] max_total_num_tokens=" not in s.text
    assert s.gpu_used(3) > 0
    wait_until(lambda: s.kernel_log.exists() and s.kernel_log.read_text(), what="the kernel log line")
    wait_until(lambda: call(s.port, "/health", timeout=10) == 503, what="/health 503")
    time.sleep(1.5)  # more than the 1 s watchdog interval
    assert s.proc.poll() is None and "crashed with exit code" not in s.text


def test_orphan_scheduler_outlives_its_parent_holding_gpu_memory(sim: Callable[..., Sim]) -> None:
    """In orphan mode scheduler TP0 survives the OOM-killed server with its GPU memory until it is killed."""
    s = sim("--sim-fail", "orphan", "--sim-fail-after-s", "0.2")
    s.wait_ready()
    tp0 = s.children()["sglang::scheduler_TP0"]
    assert s.proc.wait(timeout=START_S) == -signal.SIGKILL  # the orphan keeps stdout open: no EOF
    s.wait_line("torch.OutOfMemoryError: CUDA out of memory.")
    assert tp0.is_running() and tp0.status() != psutil.STATUS_ZOMBIE
    assert title(tp0) == "sglang::scheduler_TP0"
    assert Path(f"/proc/{tp0.pid}/comm").read_text().strip() == "sglang::schedul"  # what the OOM killer prints
    assert s.gpu_used(0) > 80 * GIB
    tp0.kill()
    wait_until(lambda: s.gpu_used(0) == 0, what="the orphan's memory to free")


def test_stuck_memory_stays_after_death_until_reset(sim: Callable[..., Sim]) -> None:
    """In stuck mode the schedulers' GPU memory stays counted after they all died, until a GPU reset."""
    s = sim("--sim-fail", "stuck", "--sim-fail-after-s", "0.2", "--tp-size", "2")
    s.wait_ready()
    pids = [p.pid for p in s.children().values()]
    assert s.wait_exit() == -signal.SIGKILL
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in pids), what="the children to die")
    assert s.gpu_used(0) > 80 * GIB and s.gpu_used(1) > 80 * GIB
    simgpu.reset(s.gpu_dir)
    assert s.gpu_used(0) == 0 and s.gpu_used(1) == 0


def test_ignore_sigterm_drains_forever(sim: Callable[..., Sim]) -> None:
    """In ignore_sigterm mode SIGTERM turns /health and new work to 503 but the server stays up."""
    s = sim("--sim-fail", "ignore_sigterm")
    s.wait_ready()
    s.proc.send_signal(signal.SIGTERM)
    s.wait_line("SIGTERM received.")
    assert call(s.port, "/health") == 503
    assert call(s.port, "/generate", {"text": "hi"}) == 503
    assert s.proc.poll() is None


def test_launch_onto_a_held_gpu_fails_with_a_weight_load_oom(sim: Callable[..., Sim], tmp_path: Path) -> None:
    """A GPU held by another process makes the launch die of a CUDA OOM in load_model frames (exit -9)."""
    simgpu.ensure_gpus(tmp_path / "gpus", 8, 96)
    simgpu.write_process(tmp_path / "gpus", os.getpid(), {0: 90 * GIB}, title="someone-else")
    try:
        s = sim()
        assert s.wait_exit() == -signal.SIGKILL
    finally:
        simgpu.remove_process(tmp_path / "gpus", os.getpid())
    text = s.text
    assert "Load weight begin. avail mem=6.00 GB" in text and "Load weight end" not in text
    tb = text[text.index("Scheduler hit an exception: Traceback"):]
    assert "in load_model" in tb and "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in tb
    assert "Received sigquit from a child process." in tb


def test_port_in_use_is_the_uvicorn_bind_error(sim: Callable[..., Sim]) -> None:
    """A taken port gives uvicorn's Errno 98 line and exit 1 once the schedulers are up."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = sim(port=taken.getsockname()[1])
        assert s.wait_exit() == 1
    line = s.wait_line("ERROR:")
    assert re.search(r"ERROR: +\[Errno 98\] error while attempting to bind on address \('127\.0\.0\.1', \d+\): "
                     r"address already in use", line)
    assert READY not in s.text


def test_flood_prints_n_lines_then_exits_0(sim: Callable[..., Sim]) -> None:
    """--sim-flood N prints N decode lines after ready and exits 0."""
    s = sim("--sim-flood", "5000")
    assert s.wait_exit() == 0
    after = s.text[s.text.index(READY):]
    assert after.count("] Decode batch. #running-req:") == 5000


# --------------------------------------------------------------------------- 0.5.23, held to the real server

V23 = ("--sim-version", "0.5.23")
FAST_DIAG = {"SGLANG_SIM_CRASH_DIAG_SLEEP_S": "0.2"}  # SGLang's 5 s diagnostics sleep, shortened
NO_DIAG = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def assert_in_order(s: Sim, expected: list[str]) -> None:
    """Each needle appears in the output, each after the one before."""
    pos = 0
    for needle in expected:
        found = s.text.find(needle, pos)
        assert found >= 0, f"{needle!r} missing after position {pos} in:\n{s.text[-4000:]}"
        pos = found + len(needle)


def pid_of(line: str) -> int:
    return int(re.search(r"pid=(\d+)", line).group(1))  # type: ignore[union-attr]


def test_0_5_23_default_fraction_is_handle_gpu_memory_settings() -> None:
    """Without --mem-fraction-static, 0.5.23 picks about 0.90 on an H200 at TP 8 and 0.82 on an
    80 GB card (nvidia-smi totals 143771 and 81559 MiB), with its chunked-prefill default by card size."""
    assert simulator.default_fraction_v23(143771 / 1024, 8192, 8) == 0.897
    assert simulator.default_fraction_v23(81559 / 1024, 8192, 8) == 0.818
    assert simulator.default_chunked_prefill_v23(143771 / 1024) == 8192
    assert simulator.default_chunked_prefill_v23(24) == 4096
    assert simulator.default_chunked_prefill_v23(180) == 16384
    args = simulator.parse_args([*V23, "--model-path", "m", "--sim-gpu-total-gb", str(143771 / 1024), "--tp-size", "8"])
    cfg = simulator.SimConfig.from_args(args)
    assert cfg.fraction == 0.897 and cfg.sglang_args["mem_fraction_static"] == 0.897


def test_0_5_23_startup_lines_titles_and_server_args(sim: Callable[..., Sim]) -> None:
    """0.5.23 at TP 1: ``sglang::scheduler`` and ``sglang::detokenizer``, no rank prefix, the
    ``server_args={...}`` dict with the fraction SGLang chose, the startup-timings line, ready."""
    s = sim(*V23)
    s.wait_ready()
    assert set(s.children()) == {"sglang::scheduler", "sglang::detokenizer"}
    assert Path(f"/proc/{s.children()['sglang::scheduler'].pid}/comm").read_text().strip() == "sglang::schedul"
    first = s.lines[0]
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] server_args=\{'model_path': '/models/DeepSeek-V3', .*\}", first)
    assert f"'mem_fraction_static': {simulator.default_fraction_v23(96.0, 8192, 1)}," in first
    assert_in_order(s, [
        "] Load weight begin. avail mem=96.00 GB",
        "] Load weight end. elapsed=0.20 s, type=DeepseekV3ForCausalLM, avail mem=23.67 GB, mem usage=72.33 GB.",
        "] KV Cache is allocated. dtype: torch.bfloat16, #tokens: ",
        "] Memory pool end. avail mem=",
        "] Capture target decode CUDA graph end. bs=",
        "] max_total_num_tokens=", "available_gpu_mem=",
        "] Engine startup timings (s): load_weight=0.20, kv_cache_allocation=",
        "] INFO:     Started server process [", "] INFO:     Waiting for application startup.",
        "] INFO:     Application startup complete.", "] INFO:     Uvicorn running on http://127.0.0.1:",
        '"GET /model_info HTTP/1.1" 200', '"POST /generate HTTP/1.1" 200', '"POST /freeze_gc HTTP/1.1" 200',
        "] " + READY,
    ])
    assert "] Init parallel begin." in s.text and "] Memory baseline taken. mem usage=0.00 GB" in s.text
    assert "cuda_graph={prefill=0.00, decode=0.06, target_verify=0.00, draft_prefill=0.00, draft_decode=0.00, " \
           "draft_extend=0.00}" in s.text
    assert call(s.port, "/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": 2}}) == 200
    assert re.search(r"\] Prefill batch, #new-seq: 1, #new-token: 3, #cached-token: 0, token usage: [\d.]+, "
                     r"#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput", s.text)
    assert not re.search(r" TP\d\]", s.text)  # no rank prefix at TP 1


def test_0_5_23_cpu_recipe_flags_are_accepted(sim: Callable[..., Sim]) -> None:
    """The real CPU recipe's flags work here too (one config for both): no graph capture, CPU summary."""
    s = sim(*V23, "--device", "cpu", "--max-total-tokens", "4096", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--sleep-on-idle")
    s.wait_ready()
    assert "Capture" not in s.text
    assert re.search(r"\] max_total_num_tokens=4096, .*available_cpu_mem=[\d.]+ GB", s.text)
    assert "cuda_graph={prefill=0.00, decode=0.00," in s.text


def test_0_5_23_sigkilled_scheduler_the_real_chain(sim: Callable[..., Sim]) -> None:
    """A SIGKILLed scheduler, as on the real server: the watchdog line naming ``scheduler_0``,
    SIGQUIT, the 5 s diagnostics sleep (default), kill_process_tree, main exits -9. Children
    go with main on the real CPU server; SGLANG_SIM_CHILD_TEARDOWN_S=1.5 mimics a GPU server's
    children that outlive it while they free their memory."""
    s = sim(*V23, env={"SGLANG_SIM_CHILD_TEARDOWN_S": "1.5"})
    s.wait_ready()
    kids = s.children()
    sched, detok = kids["sglang::scheduler"], kids["sglang::detokenizer"]
    sched.kill()
    line = s.wait_line("crashed with exit code -9")
    assert re.fullmatch(rf"\[[\d :-]+\] Subprocess scheduler_0 \(pid={sched.pid}\) crashed with exit code -9\. "
                        r"Triggering SIGQUIT for cleanup\.\.\.", line)
    noticed = time.monotonic()
    assert s.proc.wait(timeout=30) == -signal.SIGKILL
    main_gone = time.monotonic()
    assert detok.is_running() and detok.status() != psutil.STATUS_ZOMBIE  # outlives main
    wait_until(lambda: not detok.is_running() or detok.status() == psutil.STATUS_ZOMBIE, timeout=10,
               what="the detokenizer to go")
    children_gone = time.monotonic()
    s.reader.join(timeout=10)
    assert 4.5 <= main_gone - noticed < 8.0  # the 5 s sleep (the line is seen a little after it is printed)
    assert 1.0 <= children_gone - main_gone < 3.0
    tail = s.text[s.text.index(line):].splitlines()
    main = s.proc.pid
    assert [re.sub(r"^\[[\d :-]+\] ", "", x) for x in tail] == [
        f"Subprocess scheduler_0 (pid={sched.pid}) crashed with exit code -9. Triggering SIGQUIT for cleanup...",
        "SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
        "Sleeping 5 seconds before crash diagnostics to let GPU activity settle.",
        "No live scheduler processes found; skipping py-spy and CUDA coredump.",
        f"kill_process_tree called: parent_pid={main}, include_parent=True, pid={main}",
    ]


def test_0_5_23_sigkilled_detokenizer(sim: Callable[..., Sim]) -> None:
    """A dead detokenizer is watched too, under the name ``detokenizer``. The scheduler is still alive,
    so the diagnostics run on it, CUDA-coredump wait included (60 s by default; shortened here)."""
    s = sim(*V23, env={**FAST_DIAG, "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0.2"})
    s.wait_ready()
    detok = s.children()["sglang::detokenizer"]
    detok.kill()
    assert s.wait_exit() == -signal.SIGKILL
    assert_in_order(s, [f"Subprocess detokenizer (pid={detok.pid}) crashed with exit code -9. Triggering SIGQUIT",
                        "SIGQUIT received. signum=None, frame=None.", "CUDA user-triggered coredump is not enabled.",
                        "Waiting 0.2 seconds for CUDA coredumps before exiting.", "kill_process_tree called:"])


def test_0_5_23_test_hook_raises_in_the_scheduler(sim: Callable[..., Sim]) -> None:
    """SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS=N: the scheduler raises after N stream outputs; the
    client's connection drops; the usual chain follows (the scheduler exits 0 after its SIGQUIT)."""
    s = sim(*V23, env={**FAST_DIAG, "SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS": "20"})
    s.wait_ready()  # the warm-up's 8 outputs stay below 20
    assert call(s.port, "/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": 64}}, timeout=30) == "error"
    assert s.wait_exit() == -signal.SIGKILL
    assert_in_order(s, [
        "] Scheduler hit an exception: Traceback (most recent call last):",
        'output_streamer.py", line 157, in _trigger_crash_for_tests',
        "RuntimeError: Test crash after stream_output called 20 times",
        "] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
        "] Sleeping 5 seconds before crash diagnostics to let GPU activity settle.",
        "] No live scheduler processes found; skipping py-spy and CUDA coredump.",
        "] kill_process_tree called: parent_pid=",
    ])
    assert "crashed with exit code" not in s.text  # SGLang stops its watchdog first; exit 0 is no crash anyway
    assert_stamped(s)


def test_0_5_23_sigterm_to_main_drains(sim: Callable[..., Sim]) -> None:
    """SIGTERM to the main process only: the real drain line, /health 503 (logged), new requests
    still served, the in-flight one finishes with 200, then exit 0."""
    s = sim(*V23, "--sim-drain-poll-s", "0.5")
    s.wait_ready()
    result: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: result.update(status=call(
        s.port, "/generate", {"text": "one two three", "sampling_params": {"max_new_tokens": 400}}, timeout=60)))
    slow.start()
    s.wait_line("#new-seq: 1, #new-token: 3,")
    s.proc.send_signal(signal.SIGTERM)
    s.wait_line("] SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
    assert call(s.port, "/health") == 503
    s.wait_line("Health check request received during shutdown. Returning 503.")
    assert call(s.port, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}) == 200
    assert s.wait_exit() == 0
    slow.join(timeout=60)
    assert result["status"] == 200
    assert re.search(r"Gracefully exiting\.\.\. Remaining number of requests 1\. Remaining requests "
                     r"remaining_rids=\['[0-9a-f]{32}'\]\.", s.text)
    main = s.proc.pid
    tail = s.text[s.text.index("Remaining number of requests 0."):].splitlines()
    assert [re.sub(r"^\[[\d :-]+\] ", "", x) for x in tail[1:]] == [
        f"kill_process_tree called: parent_pid={main}, include_parent=False, pid={main}",
        "INFO:     Shutting down", "INFO:     Waiting for application shutdown.",
        "INFO:     Application shutdown complete.", f"INFO:     Finished server process [{main}]",
        f"kill_process_tree called: parent_pid={main}, include_parent=False, pid={main}",
    ]
    assert "crashed with exit code" not in s.text
    assert all(g.used_bytes == 0 for g in simgpu.read_gpus(s.gpu_dir))


def test_0_5_23_group_sigterm_kills_the_workers_at_once(sim: Callable[..., Sim]) -> None:
    """SIGTERM to the whole group: the scheduler and detokenizer have no handler and die at once,
    the in-flight request is lost, and the watchdog's crash chain ends the main process (-9)."""
    s = sim(*V23, env=FAST_DIAG)
    s.wait_ready()
    result: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: result.update(status=call(
        s.port, "/generate", {"text": "one two three", "sampling_params": {"max_new_tokens": 2000}}, timeout=60)))
    slow.start()
    s.wait_line("#new-seq: 1, #new-token: 3,")
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.wait_exit() == -signal.SIGKILL
    slow.join(timeout=60)
    assert result["status"] == "error"
    assert_in_order(s, ["SIGTERM received. signum=None frame=None. Draining requests and shutting down...",
                        "Subprocess scheduler_0 (pid=", "crashed with exit code -15. Triggering SIGQUIT for cleanup...",
                        "SIGQUIT received. signum=None, frame=None.", "kill_process_tree called:"])


def test_0_5_23_sigquit_without_diagnostics_goes_straight_to_the_tree_kill(sim: Callable[..., Sim]) -> None:
    """SIGQUIT with SGLANG_PYSPY_DUMP_BEFORE_CRASH=0 SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0: no sleep, no wait."""
    s = sim(*V23, env=NO_DIAG)
    s.wait_ready()
    s.proc.send_signal(signal.SIGQUIT)
    assert s.wait_exit(timeout=10) == -signal.SIGKILL
    after = s.text[s.text.index("SIGQUIT received."):].splitlines()
    assert len(after) == 2 and "kill_process_tree called:" in after[1] and "include_parent=True" in after[1]


def test_0_5_23_sigquit_with_live_schedulers_dumps_and_waits_for_coredumps(sim: Callable[..., Sim]) -> None:
    """SIGQUIT by default: 5 s sleep, py-spy of each live scheduler (absent here), then the CUDA
    coredump wait, SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS (60 s by default)."""
    s = sim(*V23, env={**FAST_DIAG, "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "1.5"})
    s.wait_ready()
    sched = s.children()["sglang::scheduler"].pid
    s.proc.send_signal(signal.SIGQUIT)
    s.wait_line("Waiting 1.5 seconds for CUDA coredumps before exiting.")
    waiting = time.monotonic()
    assert s.wait_exit() == -signal.SIGKILL
    assert time.monotonic() - waiting >= 1.3
    expected = ["SIGQUIT received. signum=None, frame=None.", "Sleeping 5 seconds before crash diagnostics"]
    if shutil.which("py-spy") is None:
        expected += [f"Pyspy failed (py-spy dump --native --pid {sched}). Error: /bin/sh: 1: py-spy: not found",
                     f"All pyspy dump attempts failed for PID {sched}."]
    else:
        expected += [f"Pyspy dump for PID {sched} (py-spy dump --native --pid {sched}):"]
    assert_in_order(s, [*expected, "CUDA user-triggered coredump is not enabled.",
                        f"CUDA coredump pipe not found for PID {sched}:",
                        "Waiting 1.5 seconds for CUDA coredumps before exiting.", "kill_process_tree called:"])


def test_0_5_23_port_clash_loads_warms_up_on_the_other_server_and_exits_3(sim: Callable[..., Sim]) -> None:
    """A second server on a taken port loads fully, fails the bind (Errno 98), yet its warm-up reached
    the first server, so it prints the ready line; then exit 3 (uvicorn's STARTUP_FAILURE)."""
    first = sim(*V23)
    first.wait_ready()
    second = sim(*V23, "--base-gpu-id", "1", port=first.port)  # on another card of the same simulated node
    assert second.wait_exit() == 3
    main = second.proc.pid
    assert_in_order(second, [
        "] Memory pool end.", "INFO:     Started server process", "INFO:     Application startup complete.",
        f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {first.port}): address already in use",
        "INFO:     Waiting for application shutdown.", READY, "INFO:     Application shutdown complete.",
        f"kill_process_tree called: parent_pid={main}, include_parent=False, pid={main}",
    ])
    assert '"POST /generate HTTP/1.1" 200' in first.text  # the warm-up landed on the first server
    assert first.proc.poll() is None and call(first.port, "/health") == 200


@pytest.mark.parametrize("value", ["abc"])
def test_0_5_23_bad_flag_value_is_sglang_serve_usage_error(sim: Callable[..., Sim], value: str) -> None:
    """A bad value: ``sglang serve: error: argument ...``, exit 2; the removed --cuda-graph-max-bs is ambiguous."""
    s = sim(*V23, "--mem-fraction-static", value)
    assert s.wait_exit() == 2
    assert s.lines[0].startswith("usage: sglang serve [-h]")
    assert s.lines[-1] == f"sglang serve: error: argument --mem-fraction-static: invalid float value: '{value}'"
    s2 = sim(*V23, "--cuda-graph-max-bs", "8")
    assert s2.wait_exit() == 2
    assert s2.lines[-1] == ("sglang serve: error: ambiguous option: --cuda-graph-max-bs could match "
                            "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill")


@pytest.mark.parametrize(("flags", "message"), [
    (["--mem-fraction-static", "0.0001"],
     "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.0001. "
     "Raise --mem-fraction-static above 0.754 (minimum viable = 1 - available/pre = 0.7534). "
     "If using speculative decoding, draft weights are now counted."),
    (["--sim-fail", "kv_pool", "--mem-fraction-static", "0.88"],
     "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.88. "
     "Raise --mem-fraction-static above 0.900 (minimum viable = 1 - available/pre = 0.9000)."),
])
def test_0_5_23_kv_pool_failure_names_the_minimum_fraction(sim: Callable[..., Sim], flags: list[str], message: str) -> None:
    """Below the weights' share of the card (72.33/96 = 0.7534) the 0.5.23 guard fires, from the memory
    model; --sim-fail kv_pool forces it. The launch-phase SIGQUIT chain ends it: exit -9, no ready."""
    s = sim(*V23, *flags)
    assert s.wait_exit() == -signal.SIGKILL
    assert_in_order(s, ["] Load weight end.", "] Scheduler hit an exception: Traceback (most recent call last):",
                        'kv_cache_configurator.py", line 3050, in _profile_available_bytes', message,
                        "] Received sigquit from a child process. It usually means the child failed.",
                        "] kill_process_tree called: parent_pid="])
    assert READY not in s.text and "KV Cache is allocated" not in s.text
    wait_until(lambda: s.gpu_used(0) == 0, what="GPU 0 memory to free")


def test_0_5_23_host_oom_leaves_oom_kill_evidence_only_where_asked(sim: Callable[..., Sim], tmp_path: Path) -> None:
    """host_oom writes the kernel's OOM-killer line (SGLANG_SIM_KERNEL_LOG) and bumps oom/oom_kill in a
    cgroup v2 memory.events (SGLANG_SIM_MEMORY_EVENTS, created in that format); the server then dies
    the SIGKILLed-scheduler way."""
    events = tmp_path / "memory.events"
    kern = tmp_path / "kern-env.log"
    s = sim(*V23, "--sim-fail", "host_oom", "--sim-fail-after-s", "0.2", kernel_log=False,
            env={**FAST_DIAG, "SGLANG_SIM_KERNEL_LOG": str(kern), "SGLANG_SIM_MEMORY_EVENTS": str(events)})
    s.wait_ready()
    sched = s.children()["sglang::scheduler"].pid
    assert s.wait_exit() == -signal.SIGKILL
    assert re.fullmatch(rf"\[ *[\d.]+\] Out of memory: Killed process {sched} \(sglang::schedul\) "
                        r"total-vm:\d+kB, anon-rss:\d+kB, file-rss:\d+kB, shmem-rss:0kB, UID:\d+ pgtables:\d+kB "
                        r"oom_score_adj:0", kern.read_text().strip())
    assert events.read_text() == "low 0\nhigh 0\nmax 0\noom 1\noom_kill 1\noom_group_kill 0\n"
    assert_in_order(s, [f"Subprocess scheduler_0 (pid={sched}) crashed with exit code -9.", "kill_process_tree called:"])
    assert_stamped(s)


def test_0_5_23_host_oom_without_evidence_is_a_bare_sigkill(sim: Callable[..., Sim], tmp_path: Path) -> None:
    """Without the env vars (or flags) nothing records an OOM kill: a SIGKILL like any other."""
    s = sim(*V23, "--sim-fail", "host_oom", "--sim-fail-after-s", "0.2", kernel_log=False,
            env={**FAST_DIAG, "SGLANG_SIM_KERNEL_LOG": "", "SGLANG_SIM_MEMORY_EVENTS": ""})
    assert s.wait_exit() == -signal.SIGKILL
    assert "crashed with exit code -9" in s.text
    assert not s.kernel_log.exists() and not list(tmp_path.glob("*memory.events*"))


def test_memory_events_bump_keeps_other_counters(tmp_path: Path) -> None:
    """An existing memory.events keeps its other counters; oom and oom_kill go up by one each."""
    path = tmp_path / "memory.events"
    path.write_text("low 0\nhigh 3\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n")
    simulator.bump_memory_events(str(path))
    assert path.read_text() == "low 0\nhigh 3\nmax 7\noom 3\noom_kill 3\noom_group_kill 0\n"
