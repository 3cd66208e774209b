"""The core's hold and start (issue 33): an operator's ``stop --server`` keeps the server
stopped while the daemon stays up, across daemon restarts, until ``start``; a give-up keeps
why after any later stop; planned relaunches are marked apart from crashes.

Pure, on the same ``Night`` as tests/test_machine.py."""

from __future__ import annotations

from signal import SIGKILL

from test_machine import PID, Night, crash, emitted, names, of

from supervisor.core.messages import (
    Boot,
    Diagnosed,
    Died,
    Exit,
    HoldRequested,
    Launch,
    Prepare,
    Prepared,
    ProbeResult,
    RestartRequested,
    StartRequested,
    StopRequested,
    StopServer,
)
from supervisor.core.model import Cause, ExitStatus, Phase, Remedy, State
from supervisor.core.state import Core, CrashRecord


def held_night() -> Night:
    night = Night()
    night.ready()
    night.send(HoldRequested("GPU 3 reseated"))
    night.send(Diagnosed(ExitStatus(code=0), None))
    return night


def test_ready_to_stopping_to_stopped_held_on_an_operators_stop() -> None:
    """READY -> STOPPING (held): drained like a planned restart; STOPPED and kept so, with no
    Exit: the daemon stays up; no crash and no new fraction."""
    night = Night()
    night.ready()
    fraction = night.core.learned.fraction
    actions = night.send(HoldRequested("GPU 3 reseated"))
    assert night.state is State.STOPPING
    assert emitted(actions, "job_started")["job_type"] == "hold"
    assert [a.mode.value for a in of(actions, StopServer)] == ["drain"]
    done = night.send(Diagnosed(ExitStatus(code=0), None))
    assert night.state is State.STOPPED and not of(done, Exit)
    assert emitted(done, "job_done")["job_type"] == "hold"
    assert emitted(done, "server_held")["reason"] == "GPU 3 reseated"
    assert night.core.held is not None and night.core.held.since == "2026-10-01T03:00:00+00:00"
    assert "crash" not in names(actions + done) and "restart_scheduled" not in names(actions + done)
    assert night.core.learned.fraction == fraction and night.core.learned.history == ()


def test_stopped_held_to_preparing_on_start_with_the_crash_budget_afresh() -> None:
    night = held_night()
    actions = night.send(StartRequested("back"))
    assert night.state is State.PREPARING and of(actions, Prepare)
    assert [emitted(actions, k)["job_type"] for k in ("job_started", "job_done")] == ["start", "start"]
    assert emitted(actions, "server_released")["held_since"] == "2026-10-01T03:00:00+00:00"
    assert night.core.held is None and night.core.failures == 0
    night.send(Prepared())
    assert night.state is State.STARTING and night.core.attempt == 2


def test_a_held_server_stays_stopped_when_the_daemon_boots() -> None:
    """STOPPED -> STOPPED: a daemon that starts with a hold in its state launches nothing."""
    held = held_night().core
    night = Night()
    night.core = Core.initial(held.learned, held=held.held)
    actions = night.send(Boot())
    assert night.state is State.STOPPED and not of(actions, Prepare) and not of(actions, Launch)
    assert emitted(actions, "server_held")["at_boot"] is True
    night.send(StartRequested("back"))
    assert night.state is State.PREPARING


def test_a_daemon_stop_while_a_hold_drains_ends_the_daemon_and_keeps_the_hold() -> None:
    night = Night()
    night.ready()
    night.send(HoldRequested("maintenance"))
    actions = night.send(StopRequested("SIGTERM"))
    assert emitted(actions, "job_cancelled")["job_type"] == "hold"
    assert emitted(actions, "job_started")["job_type"] == "stop"
    assert not of(actions, StopServer)  # the drain under way is the stop
    done = night.send(Diagnosed(ExitStatus(code=0), None))
    assert night.state is State.STOPPED and of(done, Exit) and night.core.held is not None


def test_a_held_server_is_stopped_for_good_when_the_daemon_stops() -> None:
    night = held_night()
    actions = night.send(StopRequested("SIGTERM"))
    assert night.state is State.STOPPED and of(actions, Exit) and night.core.held is not None


def test_backoff_to_stopped_held_at_once() -> None:
    """BACKOFF -> STOPPED (held): no server runs; the backoff timer is cancelled."""
    night = Night()
    night.backoff()
    actions = night.send(HoldRequested("maintenance"))
    assert night.state is State.STOPPED and not of(actions, StopServer) and not of(actions, Exit)
    assert emitted(actions, "server_held")["reason"] == "maintenance"


def test_exited_to_stopping_held_waits_for_the_tidy() -> None:
    """EXITED -> STOPPING (held): the dead server's tree is tidied first; then STOPPED, and
    the death is not counted."""
    night = Night()
    night.ready()
    night.send(Died(ExitStatus(signal=SIGKILL)))
    assert night.state is State.EXITED
    actions = night.send(HoldRequested("maintenance"))
    assert night.state is State.STOPPING and not of(actions, StopServer)
    done = night.send(crash(Cause.OTHER, phase=Phase.SERVING))
    assert night.state is State.STOPPED and "crash" not in names(done) and not of(done, Exit)


def test_a_restart_of_a_held_server_is_not_run() -> None:
    night = held_night()
    actions = night.send(RestartRequested("rolling"))
    assert night.state is State.STOPPED and "job_cancelled" in names(actions)


def test_a_start_after_a_give_up_prepares_and_the_give_up_is_kept_until_ready() -> None:
    """GAVE_UP -> PREPARING on start; why it gave up (cause, evidence, the command) stays in
    the core through any later stop, and is forgotten once the server serves again."""
    night = Night()
    night.ready()
    argv = night.core.run.argv
    assert argv and "--mem-fraction-static" in argv
    night.send(Died(ExitStatus(code=1)))
    night.send(crash(Cause.GPU_HW_ERROR, phase=Phase.SERVING))
    assert night.state is State.GAVE_UP
    note = night.core.gave_up
    assert note is not None and note.cause == "gpu_hw_error" and note.command == argv and note.evidence
    night.send(StopRequested("SIGTERM"))
    assert night.state is State.STOPPED and night.core.gave_up == note  # status shows it after the stop
    night = Night()
    night.ready()
    night.send(Died(ExitStatus(code=1)))
    night.send(crash(Cause.GPU_HW_ERROR, phase=Phase.SERVING))
    night.send(StartRequested("fixed"))
    assert night.state is State.PREPARING
    night.send(Prepared())
    night.send(ProbeResult(ok=True), after=30.0)
    assert night.state is State.READY and night.core.gave_up is None


def test_a_planned_restart_is_marked_planned_in_the_history() -> None:
    night = Night()
    night.ready()
    night.send(RestartRequested("new weights"))
    night.send(Diagnosed(ExitStatus(code=0), None))
    assert night.state is State.PREPARING
    (record,) = night.core.learned.history
    assert record.planned and record.cause is Cause.OPERATOR_RESTART
    assert "planned" in record.to_dict()
    # a crash's record stays as it always was; a newer daemon's key is read past
    crashed = CrashRecord("t", Cause.OTHER, Remedy.RESTART, Phase.SERVING, "exit code 1", 0.9, 0.9, "", None, PID)
    assert "planned" not in crashed.to_dict() and CrashRecord.from_dict({**crashed.to_dict(), "new": 1}) == crashed
