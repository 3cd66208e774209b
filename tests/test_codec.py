"""The core's records through JSON and back (``core.codec``): what a re-exec hands over."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from supervisor.core.codec import CodecError, decode, encode
from supervisor.core.model import Cause, JobKind, Phase, RankFacts, Remedy, StartupFacts, State
from supervisor.core.state import Core, CrashRecord, GiveUpNote, Hold, Job, Learned, Run


def _busy_core() -> Core:
    """A core with every kind of field filled: enums, optionals, tuples, frozensets, nested
    records and a dict of them."""
    facts = StartupFacts(ranks={"TP0": RankFacts("TP0", kv_cache_tokens=68300, weights_gb=72.3)},
                         progress="ready", ready=True)
    history = (CrashRecord("2026-12-03T01:00:00Z", Cause.CUDA_OOM_RUNTIME, Remedy.FRACTION_DOWN, Phase.SERVING,
                           "exit code 1", 0.93, 0.88, "torch.OutOfMemoryError", "deepseek_v2.py:2919 forward", 1),)
    learned = replace(Learned(0.88, 48, 0.93, 48), oom_fractions=frozenset({0.93, 0.9}), history=history, restarts=2)
    return Core(
        State.READY, learned,
        run=Run(attempt=3, pid=4242, launched_at=100.5, ready_at=130.25, facts=facts, argv=("python", "-m", "x")),
        job=Job(7, JobKind.CLIMB, Cause.CLIMB, "climb", target=0.9), jobs=7, failures=1,
        crash_times=(10.0, 20.5), last_cause=Cause.CUDA_OOM_RUNTIME, reason="health probe answered 200",
        held=Hold("maintenance", "2026-12-03T02:00:00Z"),
        gave_up=GiveUpNote("2026-12-03T00:00:00Z", "too many", "hang", "", ("python",)),
    )


def test_a_busy_core_comes_back_equal_through_json():
    core = _busy_core()
    text = json.dumps(encode(core))
    assert decode(Core, json.loads(text)) == core


def test_a_record_that_does_not_fit_is_refused_whole_with_its_path():
    data = encode(_busy_core())
    data["run"]["pid"] = "4242"
    with pytest.raises(CodecError, match=r"\$\.run\.pid: .*int"):
        decode(Core, data)
    data = encode(_busy_core())
    data["state"] = "DANCING"
    with pytest.raises(CodecError, match=r"\$\.state: 'DANCING' is not a State"):
        decode(Core, data)
    data = encode(_busy_core())
    data["run"]["from_the_future"] = 1  # a newer daemon's field: not guessed at
    with pytest.raises(CodecError, match="no field 'from_the_future'"):
        decode(Core, data)
    data = encode(_busy_core())
    del data["learned"]
    with pytest.raises(CodecError, match="needs 'learned'"):
        decode(Core, data)
