"""The SGLang + GPU simulator, run as a real subprocess: startup lines, HTTP, deaths, GPU memory."""

from __future__ import annotations

import http.client
import json
import os
import re
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
from supervisor import simgpu

pytestmark = pytest.mark.integration

GIB = simgpu.GIB
START_S = 60.0  # generous: 2 shared cores
READY = "The server is fired up and ready to roll!"


class Sim:
    """One simulator process (its own session) with its output collected line by line."""

    def __init__(self, tmp_path: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.gpu_dir = tmp_path / "gpus"
        self.stamp = tmp_path / "stamp"
        self.kernel_log = tmp_path / "kern.log"
        cmd = [
            sys.executable, "-m", "supervisor.simulator", "--model-path", "/models/DeepSeek-V3",
            "--port", str(self.port), "--sim-load-s", "0.2", "--sim-gpu-dir", str(self.gpu_dir),
            "--sim-crash-stamp", str(self.stamp), "--sim-kernel-log", str(self.kernel_log), *args,
        ]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
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

    def start(*args: str, port: int | None = None) -> Sim:
        s = Sim(tmp_path, *args, port=port)
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
    held = {g.index: g.used_bytes for g in simgpu.read_gpus(s.gpu_dir)}
    assert held[0] == held[1] and abs(held[0] / GIB - (96 - 0.82)) < 0.05 and held[2] == 0

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


@pytest.mark.parametrize("flags", [["--no-such-flag"], ["--tp", "2"], ["--sim-version", "0.5.23", "--cuda-graph-max-bs", "8"]])
def test_unknown_or_abbreviated_flag_is_an_argparse_error(sim: Callable[..., Sim], flags: list[str]) -> None:
    """An unknown, abbreviated or removed flag exits 2 with a usage line, like SGLang."""
    s = sim(*flags)
    assert s.wait_exit() == 2
    assert s.lines[0].startswith("usage: launch_server.py")
    assert "error: unrecognized arguments" in s.text


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


def test_host_oom_0_5_23_child_monitor_kills_the_tree(sim: Callable[..., Sim]) -> None:
    """With 0.5.23 (its log formats, DP titles) the child monitor turns a killed scheduler into a tree kill."""
    s = sim("--sim-version", "0.5.23", "--sim-fail", "host_oom", "--sim-fail-after-s", "0.5", "--dp-size", "2",
            "--enable-hicache", "--hicache-size", "2")
    s.wait_ready()
    assert set(s.children()) == {"sglang::data_parallel_controller", "sglang::scheduler_DP0_TP0",
                                 "sglang::scheduler_DP1_TP0", "sglang::detokenizer"}
    assert re.search(r"DP1 TP0\] Load weight end\. elapsed=[\d.]+ s, type=\w+, avail mem=23\.67 GB", s.text)
    assert "DP0 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens:" in s.text
    assert "DP0 TP0] Capture target decode CUDA graph end." in s.text
    assert "DP0 TP0] Allocating MLA hierarchical KV host pool:" in s.text
    assert s.gpu_used(1) > 0
    assert s.wait_exit() == -signal.SIGKILL
    line = s.wait_line("crashed with exit code -9. Triggering SIGQUIT for cleanup...")
    assert re.search(r"Subprocess scheduler_DP0_TP0 \(pid=\d+\) crashed", line)
    assert "SIGQUIT received." in s.text[s.text.index(line):]
    assert "Scheduler hit an exception" not in s.text
    assert_stamped(s)


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
