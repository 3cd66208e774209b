"""The edges every handler shares: the one function that changes ``state``, a launch, a
preparation, a give-up, and a stop of the server, with the router's rule in them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from supervisor.core import events as ev
from supervisor.core import policy
from supervisor.core.argv import build_argv
from supervisor.core.config import Config
from supervisor.core.messages import (
    Action,
    CancelTimer,
    Ctx,
    Emit,
    Launch,
    Persist,
    Prepare,
    RouterRemove,
    SetTimer,
    StopMode,
    StopServer,
)
from supervisor.core.model import Cause, State
from supervisor.core.state import Core, GiveUpNote, Run, Timer

Step = tuple[Core, list[Action]]


@dataclass(frozen=True, slots=True)
class Variant:
    """What differs between a single server, a group node and a server behind the router:
    handed to every handler, so each decision is written once and says where it differs.

    ``group``: the node never decides its own relaunch; every end of its server is reported
    to the group and it waits (WAITING) for the leader's next generation. ``router``: the
    router's view follows the server, one rule for every edge: out first thing when it dies
    (-> EXITED) and before any stop, in once it is READY."""

    group: bool = False
    router: bool = False

    @classmethod
    def of(cls, cfg: Config) -> Variant:
        return cls(group=cfg.group.enabled, router=cfg.router.enabled)


def transition(core: Core, to: State, reason: str, **changes: Any) -> Step:
    """The one place that changes ``state``. It persists, then emits ``state_changed``: a state
    is on disk before anyone is told of it, so a daemon killed right after the announcement
    still leaves that state for the next one."""
    new = replace(core, state=to, reason=reason, **changes)
    if to is core.state:
        return new, [Persist()]
    changed = ev.StateChanged(
        from_=core.state,
        to=to,
        reason=reason,
        mem_fraction_static=new.learned.fraction,
        hicache_size_gb=new.learned.hicache_size_gb,
        restarts=new.learned.restarts,
        last_cause=new.last_cause,
    )
    return new, [Persist(), Emit(changed)]


def launch(core: Core, ctx: Ctx, reason: str) -> Step:
    # PREPARING -> STARTING: a new launch is a new ``Run``
    fraction, hicache = core.learned.fraction, core.learned.hicache_size_gb
    argv = build_argv(ctx.cfg, fraction, hicache)
    run = Run(attempt=core.run.attempt + 1, launched_at=ctx.now, argv=tuple(argv))
    new, actions = transition(core, State.STARTING, reason, run=run)
    health = ctx.cfg.health
    return new, [
        Launch(argv, fraction, hicache, run.attempt,
               policy.rung_of(fraction, ctx.cfg.policy.fraction_ladder)),
        *actions,
        SetTimer(Timer.STARTUP, health.startup_timeout_s),
        SetTimer(Timer.SILENCE, min(health.startup_silence_s, health.startup_timeout_s)),
        SetTimer(Timer.PROBE, health.startup_poll_s),
    ]


def cancel_run_timers() -> list[Action]:
    return [CancelTimer(t) for t in (Timer.PROBE, Timer.STARTUP, Timer.SILENCE, Timer.STABLE, Timer.PROBATION)]


def prepare(core: Core, reason: str) -> Step:
    # STOPPED/BACKOFF/RESTARTING/GAVE_UP/WAITING -> PREPARING
    new, actions = transition(core, State.PREPARING, reason)
    return new, [*actions, Prepare()]


def give_up(core: Core, ctx: Ctx, reason: str, cause: Cause | None, *, evidence: str = "",
            keep_pid: bool = False) -> Step:
    # * -> GAVE_UP (``keep_pid``: a server still runs and is being stopped; a stop request
    # then waits for its exit, GAVE_UP -> STOPPING). Why is kept (``Core.gave_up``) until it
    # serves again, whatever state follows.
    run = core.run if keep_pid else replace(core.run, pid=None)
    note = GiveUpNote(ctx.wall_time, reason, None if cause is None else str(cause), evidence[:300], core.run.argv)
    new, actions = transition(core, State.GAVE_UP, reason, run=run, gave_up=note)
    return new, [
        *cancel_run_timers(),
        *actions,
        Emit(ev.GaveUp(reason=reason, cause=cause, mem_fraction_static=new.learned.fraction,
                       restarts=new.learned.restarts, crashes=new.failures)),
    ]


def stop_server(ctx: Ctx, v: Variant, grace_s: float, reason: str, mode: StopMode = StopMode.DRAIN,
                *, take_out: bool = True) -> list[Action]:
    """Stop the server: behind the router, out of it first (``take_out`` False: it already is)."""
    out: list[Action] = [RouterRemove(reason, ctx.now)] if v.router and take_out else []
    return [*out, StopServer(grace_s, reason, mode)]


def out_of_router(ctx: Ctx, v: Variant, reason: str) -> list[Action]:
    """-> EXITED: the router stops sending to a server that died, first thing."""
    return [RouterRemove(reason, ctx.now)] if v.router else []
