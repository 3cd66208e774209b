"""The simulator's /health while requests decode for longer than its health timeout.

Real 0.5.23 (http_server.py ``health_generate``) answers 200 as soon as *any* output reaches
the tokenizer after the check began (``last_receive_tstamp > tic``), and a non-streaming
request's output is sent every ``SGLANG_FORCE_STREAM_INTERVAL`` (50) tokens while it decodes
(output_streamer.py). The simulator counted only a request's end: a server busy with long
decodes, none of them ending within the health timeout, answered 503, and the daemon
restarted a healthy server as hung (found by tests/test_capacity_night.py: server ``b``,
alone with the load while ``a`` climbed, was restarted "3 health probes failed in a row").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from test_simulator import Sim, call, sim  # noqa: F401 - sim is a fixture
from test_simulator_capacity import Harness, config, harness, memory  # noqa: F401 - harness is a fixture

from supervisor.sim import simulator


def test_a_decoding_request_reports_progress_every_50_tokens(harness: Callable[..., Harness]) -> None:  # noqa: F811
    h = harness(config("--sim-version", "0.5.23"), memory(0.93))
    h.submit(1, 8, 2 * simulator.FORCE_STREAM_INTERVAL + 10)
    s = h.sched
    s.prefill()
    steps = 0
    while s.running:
        s.decode()
        steps += 1
    ops = [m["op"] for m in h.read()]
    # progress at 50 and 100 tokens, then the end; nothing else on the way
    assert ops == ["progress", "progress", "done"], ops
    assert steps == 2 * simulator.FORCE_STREAM_INTERVAL + 9  # the prefill gave the first token


def test_health_answers_while_long_decodes_run(sim: Callable[..., Sim]) -> None:  # noqa: F811
    # A pool of 1500 tokens holds one request of 10 + 1000 tokens: the second waits, and the
    # health check's own request waits behind it. No request ends for ~4 s (1000 decode steps
    # of 4 ms); the health timeout is 0.5 s.
    s = sim("--sim-version", "0.5.23", "--sim-health-timeout-s", "0.5", "--max-total-tokens", "1500")
    s.wait_ready()
    codes: list[int | str] = []
    body = {"text": " ".join(["word"] * 10), "sampling_params": {"max_new_tokens": 1000}}
    threads = [threading.Thread(target=lambda: codes.append(call(s.port, "/generate", body, timeout=60)))
               for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the first request decodes, the second waits for the pool
    health = [call(s.port, "/health") for _ in range(3)]
    still_running = all(t.is_alive() for t in threads)
    for t in threads:
        t.join(60)
    assert still_running, "a request ended before /health was asked: no evidence"
    assert health == [200, 200, 200], health
    assert codes == [200] * 2, codes
