"""What the daemon says when a climb relaunches (``core.machine.crash.after_end``).

The climb and its fall-back replace the policy's fraction with their own, and the state's
reason (``state_changed``, systemd's status line, ``sglang-supervisor status``) has to say
the fraction the server is relaunched at, not the one the policy's ladder would have picked:
found by tests/test_capacity_night.py, where a fall-back from 0.93 to 0.81 was told as
"a CUDA OOM while serving: mem_fraction_static 0.93 -> 0.9" and a climb from 0.8 to 0.81 as
"a climb to a higher fraction: restart unchanged".
"""

from __future__ import annotations

from test_capacity import climbing, emitted

from supervisor.core.events import RestartScheduled, StateChanged
from supervisor.core.messages import ClimbAllowed, Diagnosed, Died, KvPressure, TimerFired
from supervisor.core.model import Cause, ExitStatus, State
from supervisor.core.state import Timer


def _relaunch_reason(actions: list, to: State) -> str:
    """The reason of the step into ``to`` (PREPARING at once for a climb, BACKOFF for a crash)."""
    (changed,) = [e for e in emitted(actions, StateChanged) if e.to is to]
    (restart,) = emitted(actions, RestartScheduled)
    assert f"-> {restart.mem_fraction_static:g}" in changed.reason, (changed.reason, restart)
    return changed.reason


def test_the_climb_and_its_fall_back_say_the_fraction_they_relaunch_at() -> None:
    server = climbing()
    server.send(TimerFired(Timer.STABLE), after=600.0)
    server.send(KvPressure("retraction", "x"), after=1.0)
    server.send(ClimbAllowed(0.87))
    server.send(Died(ExitStatus(code=0)))
    climbed = server.send(Diagnosed(ExitStatus(code=0), None))
    assert _relaunch_reason(climbed, State.PREPARING) == "a climb to a higher fraction: mem_fraction_static 0.85 -> 0.87"
    server.launch_to_ready()
    failed = server.died(Cause.CUDA_OOM_RUNTIME)
    reason = _relaunch_reason(failed, State.BACKOFF)
    assert "0.87 -> 0.85" in reason and "probation" in reason, reason
    assert server.core.reason == reason
