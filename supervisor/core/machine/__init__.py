"""The supervisor's state machine: ``step(core, event, ctx) -> (core, actions)``.

Pure: no clock (``ctx.now`` is monotonic seconds handed in), no I/O, no asyncio. The
daemon feeds events and carries out the actions. Every edge is named in a comment
``# FROM -> TO`` and has a test named after it in tests/test_machine.py.

Read it by state: ``HANDLERS`` below says, for each state, which handlers look at an event,
in order; the first that answers decides, and ``states.anywhere`` (what every state does
alike: a stop, a restart request, a lost GPU, a new config) comes last. An event no handler
answers means nothing in that state (a late probe, say). A single server, a group node and
a server behind the router are one decision with a ``Variant`` argument, not three copies.

- ``serving``: STARTING and READY (a launch running);
- ``states``: the other states, and ``anywhere``;
- ``jobs``: requested transitions (restart, climb, step-down, recovery, regroup, stop), in
  systemd's sense: queued, run, done or cancelled, each with its event;
- ``crash``: a server's end recorded and answered (BACKOFF, GAVE_UP, or PREPARING at once
  for a planned relaunch), a group node's report;
- ``learning``: the memory model, KV pressure and the climb, the fleet's advice, headroom;
- ``edges``: the one function that changes ``state``, and the edges every handler shares.
"""

from __future__ import annotations

from collections.abc import Callable

from supervisor.core.machine import jobs, serving, states
from supervisor.core.machine.edges import Step, Variant
from supervisor.core.machine.learning import facts_event
from supervisor.core.messages import Ctx, Event
from supervisor.core.model import State
from supervisor.core.state import Core

Handler = Callable[[Core, Event, Ctx, Variant], Step | None]

HANDLERS: dict[State, tuple[Handler, ...]] = {
    State.STOPPED: (states.stopped,),
    State.WAITING: (states.waiting,),
    State.PREPARING: (states.preparing,),
    State.STARTING: (serving.starting, serving.running),
    State.READY: (serving.ready, serving.running),
    State.EXITED: (states.exited,),
    State.RESTARTING: (states.restarting,),
    State.BACKOFF: (states.backoff,),
    State.STOPPING: (states.stopping,),
    State.GAVE_UP: (states.gave_up,),
}


def step(core: Core, event: Event, ctx: Ctx) -> Step:
    """The next state and the actions to carry out, for one event."""
    v = Variant.of(ctx.cfg)
    for handle in (*HANDLERS[core.state], states.anywhere):
        answer = handle(core, event, ctx, v)
        if answer is not None:
            return jobs.advance(*answer)
    return core, []  # an event that means nothing in this state (e.g. a late probe)


__all__ = ["HANDLERS", "facts_event", "step"]
