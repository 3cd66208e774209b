"""Unit tests of the state directory (issue 2, item 12): atomic save/load, a corrupt file moved
aside with a warning, the daemon lock naming its holder, unwritable directories, and the
learned state's dict round trip and rebasing.

Root-aware: root ignores permission bits, so unwritable paths are made by putting the state
directory under a regular file, which fails for every user.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from supervisor.adapters.store import LOCK_FILE, STATE_FILE, StateStore, StoreError
from supervisor.core.config import Config, build_config
from supervisor.core.model import Cause, Phase, Remedy
from supervisor.core.state import CrashRecord, Learned


def make_cfg(fraction: float = 0.93, hicache: int = 48) -> Config:
    return build_config(
        {"server": {"model_path": "m", "mem_fraction_static": fraction, "hicache_size_gb": hicache}}
    )


def learned_after_a_night() -> Learned:
    """Learned state after the seed's runtime OOM at 0.93."""
    record = CrashRecord(
        wall_time="2026-10-01T03:12:44+00:00", cause=Cause.CUDA_OOM_RUNTIME, remedy=Remedy.FRACTION_DOWN,
        phase=Phase.SERVING, exit="killed by SIGKILL", fraction=0.93, next_fraction=0.88,
        evidence="torch.OutOfMemoryError: CUDA out of memory.", location="deepseek_v2.py:2919 forward",
        attempt=1,
    )
    return Learned(
        fraction=0.88, hicache_size_gb=24, base_fraction=0.93, base_hicache_size_gb=48,
        oom_fractions=frozenset({0.93}), history=(record,), restarts=1,
    )


def unwritable(tmp_path: Path) -> Path:
    """A directory path that cannot be created by anyone, root included."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    return blocker / "sub"


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "state")


# --- save / load ------------------------------------------------------------------------------


def test_missing_state_is_none_without_warning(store: StateStore) -> None:
    """A first start has no state and nothing to warn about."""
    assert store.load() == (None, None)


def test_save_load_round_trip(store: StateStore) -> None:
    """What is saved is loaded back, tagged with version 1, with no temp file left behind."""
    learned = learned_after_a_night()
    store.save({"learned": learned.to_dict(), "server_pgid": 4242})
    data, warning = store.load()
    assert warning is None and data is not None
    assert (data["version"], data["server_pgid"]) == (1, 4242)
    assert Learned.from_dict(data["learned"]) == learned
    assert sorted(p.name for p in store.dir.iterdir()) == [STATE_FILE]


def test_save_replaces_the_previous_state(store: StateStore) -> None:
    """A second save wins entirely (no merge, no leftover keys)."""
    store.save({"a": 1})
    store.save({"b": 2})
    assert store.load() == ({"version": 1, "b": 2}, None)


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"", b"[1, 2]", b'{"version": 2}', b'{"learned": {}}', b"\xff\xfe"],
    ids=["truncated", "empty", "not-an-object", "future-version", "no-version", "binary"],
)
def test_corrupt_state_is_moved_aside_with_a_warning(store: StateStore, content: bytes) -> None:
    """A corrupt state file never stops the daemon: it is moved aside and the config wins."""
    store.dir.mkdir()
    store.path.write_bytes(content)
    data, warning = store.load()
    assert data is None
    assert warning is not None and "corrupt" in warning and "moved to" in warning
    assert not store.path.exists()
    (aside,) = store.dir.glob(f"{STATE_FILE}.corrupt-*")
    assert aside.read_bytes() == content
    assert str(aside) in warning


def test_corrupt_state_is_left_in_place_for_readers(store: StateStore) -> None:
    """``status`` (move_aside=False) reports a corrupt file but does not touch it."""
    store.dir.mkdir()
    store.path.write_bytes(b"{not json")
    data, warning = store.load(move_aside=False)
    assert data is None and warning is not None and "corrupt" in warning
    assert store.path.read_bytes() == b"{not json"
    assert not list(store.dir.glob(f"{STATE_FILE}.corrupt-*"))


def test_unreadable_state_is_a_warning(store: StateStore) -> None:
    """A state path that cannot be read (a directory) warns and starts from the config."""
    store.path.mkdir(parents=True)
    data, warning = store.load()
    assert data is None and warning is not None and "cannot read" in warning


def test_save_into_an_unwritable_directory_raises_store_error(tmp_path: Path) -> None:
    """A directory that cannot be created raises StoreError naming the path."""
    store = StateStore(unwritable(tmp_path))
    with pytest.raises(StoreError, match="cannot write"):
        store.save({"learned": {}})


def test_failed_rename_leaves_no_temp_file(store: StateStore) -> None:
    """When the final rename fails (state.json is a directory) the temp file is removed."""
    store.path.mkdir(parents=True)
    with pytest.raises(StoreError, match="cannot write"):
        store.save({"a": 1})
    assert [p.name for p in store.dir.iterdir()] == [STATE_FILE]


def test_a_save_is_read_back_before_its_fsync_and_flushed_waits_for_it(store: StateStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The new state is what a reader sees when ``save`` returns (a daemon killed then loses
    nothing); its fsync, file then directory, runs on the flusher's thread, and ``flushed``
    waits for it (issue 36: the fsync was most of crash -> noticed)."""
    gate, synced, threads = threading.Event(), [], set()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        gate.wait(10)
        threads.add(threading.current_thread().name)
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    store.save({"learned": {"fraction": 0.88}})
    assert synced == []  # save did not wait for the disk
    data, warning = store.load()
    assert warning is None and data is not None and data["learned"] == {"fraction": 0.88}
    gate.set()
    store.flushed()
    assert synced == [str(store.path.resolve()), str(store.dir.resolve())]
    assert threads and all(name.startswith("state-fsync") for name in threads)
    assert [p.name for p in store.dir.iterdir()] == [STATE_FILE]


def test_a_failed_fsync_is_raised_by_the_next_save(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync error (EIO: the disk lost the write) is not lost with its thread: the next
    ``save`` raises it once its own state is written, and the one after writes again."""
    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    store.save({"a": 1})
    store.flushed()
    monkeypatch.undo()
    with pytest.raises(StoreError, match="cannot write: Input/output error"):
        store.save({"a": 2})
    data, _ = store.load()
    assert data is not None and data["a"] == 2  # the save that says so still wrote its own state
    store.save({"a": 3})
    store.flushed()
    data, _ = store.load()
    assert data is not None and data["a"] == 3


def test_release_flushes_first(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is let go only once the last state is on the disk: the next daemon starts from it."""
    order: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    store.acquire()
    store.save({"a": 1})
    real_close = os.close

    def close(fd: int) -> None:
        if fd == store.lock_fd:
            order.append("unlock")
        real_close(fd)

    monkeypatch.setattr(os, "close", close)
    store.release()
    assert order == ["fsync", "fsync", "unlock"]


# --- the lock -------------------------------------------------------------------------------


def test_second_acquire_fails_naming_the_holder(tmp_path: Path) -> None:
    """A second daemon on the same state directory is refused with the first one's pid."""
    first, second = StateStore(tmp_path / "s"), StateStore(tmp_path / "s")
    first.acquire()
    try:
        assert (tmp_path / "s" / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        assert second.locked_by_other()
        with pytest.raises(StoreError, match=f"another sglang-supervisor \\(pid {os.getpid()}\\)"):
            second.acquire()
    finally:
        first.release()


def test_lock_is_free_again_after_release(tmp_path: Path) -> None:
    """Releasing the lock lets the next daemon take it."""
    first, second = StateStore(tmp_path / "s"), StateStore(tmp_path / "s")
    first.acquire()
    first.release()
    assert not second.locked_by_other()
    second.acquire()
    second.release()
    first.release()  # releasing twice is harmless


def test_no_lock_file_means_not_locked(store: StateStore) -> None:
    """``status`` on a fresh directory sees no running daemon."""
    assert not store.locked_by_other()


def test_acquire_in_an_unwritable_directory_raises_store_error(tmp_path: Path) -> None:
    """A lock that cannot even be created is a StoreError, not an OSError."""
    with pytest.raises(StoreError, match="cannot open the lock file"):
        StateStore(unwritable(tmp_path)).acquire()


# --- Learned ----------------------------------------------------------------------------------


def test_learned_dict_round_trip_through_json() -> None:
    """to_dict is JSON-able and from_dict rebuilds an equal value."""
    learned = learned_after_a_night()
    d = json.loads(json.dumps(learned.to_dict()))
    assert d["oom_fractions"] == [0.93]
    assert Learned.from_dict(d) == learned


# The learned section of a state.json written before causes were typed (issue 14), byte for byte.
STATE_JSON_BEFORE_TYPED_CAUSES = (
    '{"fraction": 0.88, "hicache_size_gb": 24, "base_fraction": 0.93, "base_hicache_size_gb": 48, '
    '"oom_fractions": [0.93], "history": [{"wall_time": "2026-10-01T03:12:44+00:00", '
    '"cause": "cuda_oom_runtime", "remedy": "fraction_down", "phase": "serving", '
    '"exit": "killed by SIGKILL", "fraction": 0.93, "next_fraction": 0.88, '
    '"evidence": "torch.OutOfMemoryError: CUDA out of memory.", '
    '"location": "deepseek_v2.py:2919 forward", "attempt": 1}], "restarts": 1}'
)


def test_learned_json_is_byte_compatible_with_untyped_causes() -> None:
    """Typed causes are strings again at the edge: the same JSON as before, and it reads back
    as Cause/Remedy/Phase members."""
    learned = learned_after_a_night()
    assert json.dumps(learned.to_dict()) == STATE_JSON_BEFORE_TYPED_CAUSES
    record = Learned.from_dict(json.loads(STATE_JSON_BEFORE_TYPED_CAUSES)).history[0]
    assert (record.cause, record.remedy, record.phase) == (Cause.CUDA_OOM_RUNTIME, Remedy.FRACTION_DOWN, Phase.SERVING)
    assert (type(record.cause), type(record.remedy), type(record.phase)) == (Cause, Remedy, Phase)


def test_learned_with_an_unknown_cause_keeps_the_rung() -> None:
    """A history value this version does not know (a newer version wrote it) reads as
    other/restart/starting: that line loses its detail, what was learned is kept."""
    d = json.loads(STATE_JSON_BEFORE_TYPED_CAUSES)
    d["history"][0].update(cause="cuda_oom_sometime", remedy="pray", phase="dreaming")
    learned = Learned.from_dict(d)
    assert learned.fraction == d["fraction"] and learned.oom_fractions
    record = learned.history[0]
    assert (record.cause, record.remedy, record.phase) == (Cause.OTHER, Remedy.RESTART, Phase.STARTING)


def test_learned_from_a_minimal_dict() -> None:
    """Optional fields (older state files) default to empty."""
    d = {"fraction": 0.88, "hicache_size_gb": 0, "base_fraction": 0.93, "base_hicache_size_gb": 0}
    learned = Learned.from_dict(d)
    assert (learned.oom_fractions, learned.history, learned.restarts) == (frozenset(), (), 0)


def test_learned_initial_starts_at_the_configured_fraction_or_sglangs_own() -> None:
    """No configured fraction means SGLang's own choice (None until its log says it)."""
    assert Learned.initial(make_cfg(0.85)).fraction == 0.85
    assert Learned.initial(build_config({"server": {"model_path": "m"}})).fraction is None


def test_rebased_keeps_what_was_learned_for_the_same_config() -> None:
    """A daemon restart with the same config resumes at the learned rung."""
    learned = learned_after_a_night()
    assert learned.rebased(make_cfg(0.93, 48)) is learned


@pytest.mark.parametrize(("fraction", "hicache"), [(0.85, 48), (0.93, 16)])
def test_rebased_restarts_from_a_changed_config_but_keeps_the_history(
    fraction: float, hicache: int
) -> None:
    """An operator's new starting point wins; what OOMed and the history are kept."""
    rebased = learned_after_a_night().rebased(make_cfg(fraction, hicache))
    assert (rebased.fraction, rebased.hicache_size_gb) == (fraction, hicache)
    assert (rebased.base_fraction, rebased.base_hicache_size_gb) == (fraction, hicache)
    assert rebased.oom_fractions == frozenset({0.93})
    assert len(rebased.history) == 1 and rebased.restarts == 1
