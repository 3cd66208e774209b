"""The demo's load generator against the real simulator: OOM at 0.93, runs at 0.88, rides out restarts."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import pytest
from conftest import free_port
from test_simulator import Sim, avail_after_capture, sim  # noqa: F401 - sim is a fixture

from supervisor.sim.loadgen import LoadResult, run_load

pytestmark = pytest.mark.integration

N_REQUESTS = 150 + 32  # run_load's defaults


def base_url(s: Sim) -> str:
    return f"http://127.0.0.1:{s.port}"


async def test_default_load_completes_at_0_88(sim: Callable[..., Sim]) -> None:  # noqa: F811 - the imported fixture
    """At 0.88 the seed profile keeps over 5 GB of headroom and the default load completes without a retry."""
    s = sim("--mem-fraction-static", "0.88")
    s.wait_ready()
    assert avail_after_capture(s, "TP0") > 5.0
    result = await run_load(base_url(s), deadline_s=90)
    assert result.completed == N_REQUESTS and result.failed == 0 and result.retries == 0
    assert result.attempts == N_REQUESTS and result.elapsed_s > 0
    assert s.proc.poll() is None
    assert "Prefill batch. #new-seq:" in s.text and "#new-token: 8192," in s.text  # full chunks ran


async def test_default_load_ooms_at_0_93(sim: Callable[..., Sim]) -> None:  # noqa: F811 - the imported fixture
    """At 0.93 the default load kills the server by a CUDA OOM, and unserved requests fail at the deadline."""
    s = sim("--mem-fraction-static", "0.93")
    s.wait_ready()
    result = await run_load(base_url(s), deadline_s=3, retry_interval_s=0.2)
    assert await asyncio.to_thread(s.wait_exit) == -signal.SIGKILL
    assert "torch.OutOfMemoryError: CUDA out of memory." in s.text and "SIGQUIT received." in s.text
    assert result.completed + result.failed == N_REQUESTS
    assert result.failed > 0 and result.retries > 0
    assert result.attempts == N_REQUESTS + result.retries


async def test_requests_ride_out_a_restart(sim: Callable[..., Sim]) -> None:  # noqa: F811 - the imported fixture
    """When the 0.93 server dies under load and a 0.88 one takes its port, every request completes after retries."""
    first = sim("--mem-fraction-static", "0.93")
    first.wait_ready()
    load = asyncio.ensure_future(run_load(base_url(first), deadline_s=90, retry_interval_s=0.2))
    assert await asyncio.to_thread(first.wait_exit) == -signal.SIGKILL
    second = sim("--mem-fraction-static", "0.88", port=first.port)  # what the supervisor does
    result: LoadResult = await load
    assert result.completed == N_REQUESTS and result.failed == 0
    assert result.retries > 0
    assert "The server is fired up and ready to roll!" in second.text and second.proc.poll() is None


async def test_client_errors_are_not_retried(sim: Callable[..., Sim]) -> None:  # noqa: F811 - the imported fixture
    """A request the server rejects with a 4xx (a prompt longer than the context) fails at once."""
    s = sim("--mem-fraction-static", "0.88", "--context-length", "1000")
    s.wait_ready()
    result = await run_load(base_url(s), short=2, long=1, deadline_s=30)
    assert (result.completed, result.failed, result.attempts) == (2, 1, 3)


async def test_deadline_bounds_retries_when_nothing_listens() -> None:
    """Against a port nobody listens on, every request retries until the deadline, then fails."""
    result = await run_load(f"http://127.0.0.1:{free_port()}", short=3, long=1, deadline_s=1.0, retry_interval_s=0.1)
    assert result.completed == 0 and result.failed == 4
    assert result.retries > 0 and result.retries == result.attempts - 4
    assert result.elapsed_s >= 1.0  # nothing ends before the deadline
