"""Unit tests of the state machine (issue 2): one test per ``# FROM -> TO`` edge of
``supervisor/core/machine/``, the seed's night, and a property test over random events.

Pure: no event loop, no sleeps, no processes. Time is a number the test advances; jitter
comes from ``random.Random(0)``.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.config import Config, build_config
from supervisor.core.machine import step
from supervisor.core.messages import (
    Action,
    Boot,
    CancelTimer,
    ConfigChanged,
    Ctx,
    Diagnose,
    Diagnosed,
    Died,
    Emit,
    Event,
    Exit,
    FactsUpdated,
    Finding,
    GpuLost,
    HoldRequested,
    Launch,
    Launched,
    LaunchFailed,
    Persist,
    Prepare,
    Prepared,
    PrepareFailed,
    Probe,
    ProbeResult,
    RestartRequested,
    RouterAdd,
    RouterRemove,
    SetTimer,
    StartRequested,
    StopMode,
    StopRequested,
    StopServer,
    TimerFired,
)
from supervisor.core.model import (
    Cause,
    Diagnosis,
    ExitStatus,
    Phase,
    RankFacts,
    Remedy,
    StartupFacts,
    State,
)
from supervisor.core.state import Core, Learned, Timer

PID = 4242
SIGKILL = 9
START = 1000.0


def make_cfg(**sections: dict[str, Any]) -> Config:
    """A valid config with the defaults, plus per-section overrides."""
    data: dict[str, dict[str, Any]] = {
        "server": {"model_path": "moonshotai/Kimi-K2.5", "tp_size": 8, "mem_fraction_static": 0.93}
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return build_config(data)


def oom_runtime() -> Diagnosis:
    """The seed's crash: a CUDA OOM in the first big prefill burst."""
    return Diagnosis(
        cause=Cause.CUDA_OOM_RUNTIME,
        phase=Phase.SERVING,
        evidence=("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",),
        evidence_lineno=412,
        exc_type="torch.OutOfMemoryError",
        exc_message="CUDA out of memory. Tried to allocate 2.00 GiB.",
        location="deepseek_v2.py:2919 forward",
        rank="TP3",
    )


def crash(cause: Cause = Cause.OTHER, *, phase: Phase = Phase.STARTING,
          override: Remedy | None = None, status: ExitStatus | None = None) -> Diagnosed:
    """A server exit with the given diagnosis (SIGKILL by default, as SGLang dies)."""
    return Diagnosed(
        status or ExitStatus(signal=SIGKILL),
        Diagnosis(cause=cause, phase=phase, evidence=(f"{cause} here",), remedy_override=override),
    )


def facts(avail_after_capture: float, rank: str = "TP5") -> FactsUpdated:
    """Startup facts where ``rank`` is the tightest after CUDA-graph capture."""
    ranks = {
        "TP0": RankFacts("TP0", avail_mem_after_capture_gb=avail_after_capture + 1.0),
        rank: RankFacts(rank, avail_mem_after_capture_gb=avail_after_capture),
    }
    return FactsUpdated(StartupFacts(ranks=ranks, progress="capture"))


class Night:
    """Drives one core through events on a clock the test advances."""

    def __init__(self, cfg: Config | None = None, *, now: float = START) -> None:
        self.cfg = cfg or make_cfg()
        self.core = Core.initial(Learned.initial(self.cfg))
        self.now = now
        self.rng = random.Random(0)

    @property
    def state(self) -> State:
        return self.core.state

    def send(self, event: Event, *, after: float = 0.0) -> list[Action]:
        self.now += after
        ctx = Ctx(now=self.now, cfg=self.cfg, rng=self.rng, wall_time="2026-10-01T03:00:00+00:00")
        self.core, actions = step(self.core, event, ctx)
        return actions

    def starting(self) -> list[Action]:
        """STOPPED -> PREPARING -> STARTING; returns the launch's actions."""
        self.send(Boot())
        actions = self.send(Prepared())
        self.send(Launched(PID))
        return actions

    def ready(self, *, after: float = 60.0) -> list[Action]:
        self.starting()
        return self.send(ProbeResult(ok=True), after=after)

    def backoff(self, event: Diagnosed | None = None) -> list[Action]:
        self.ready()
        return self.send(event or crash(Cause.OTHER, phase=Phase.SERVING))

    def relaunch(self, *, after: float = 1000.0) -> list[Action]:
        """BACKOFF -> PREPARING -> STARTING once the backoff timer fires."""
        self.send(TimerFired(Timer.BACKOFF), after=after)
        actions = self.send(Prepared())
        self.send(Launched(PID + self.core.attempt))
        return actions


def of(actions: list[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def emitted(actions: list[Action], name: str) -> dict[str, Any]:
    """The fields of the one ``Emit(name)`` among ``actions``."""
    found = [a.event.fields() for a in of(actions, Emit) if a.event.kind == name]
    assert len(found) == 1, f"expected one {name!r} emit, got {names(actions)}"
    return found[0]


def names(actions: list[Action]) -> list[str]:
    return [a.event.kind for a in of(actions, Emit)]


def timers(actions: list[Action]) -> dict[Timer, float]:
    return {a.name: a.delay_s for a in of(actions, SetTimer)}


def strings_are_plain(value: object) -> bool:
    """Every string in an event's fields is a ``str``, not an enum: sinks get the edge form."""
    if isinstance(value, str):
        return type(value) is str
    if isinstance(value, dict):
        return all(strings_are_plain(k) and strings_are_plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(strings_are_plain(v) for v in value)
    return True


def launch_of(actions: list[Action]) -> Launch:
    (launch,) = of(actions, Launch)
    return launch


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- STOPPED -> PREPARING / PREPARING -> ... ------------------------------------------------


def test_stopped_to_preparing_on_boot() -> None:
    """Boot asks for the GPUs to be cleared and checked before anything is launched."""
    night = Night()
    actions = night.send(Boot())
    assert night.state is State.PREPARING
    assert of(actions, Prepare) and not of(actions, Launch)
    changed = emitted(actions, "state_changed")
    assert (changed["from"], changed["to"]) == ("STOPPED", "PREPARING")
    assert of(actions, Persist)


def test_preparing_to_starting_when_prepared() -> None:
    """Prepared launches attempt 1 at the configured fraction and arms the startup timers."""
    night = Night()
    night.send(Boot())
    actions = night.send(Prepared())
    assert night.state is State.STARTING
    launch = launch_of(actions)
    assert (launch.fraction, launch.attempt, launch.hicache_size_gb) == (0.93, 1, 0)
    assert flag(launch.argv, "--mem-fraction-static") == "0.93"
    assert timers(actions) == {
        Timer.STARTUP: night.cfg.health.startup_timeout_s,
        Timer.SILENCE: night.cfg.health.startup_silence_s,
        Timer.PROBE: night.cfg.health.startup_poll_s,
    }


def test_preparing_to_gave_up_on_permanent_prepare_failure() -> None:
    """A permanent preflight failure gives up at once, naming the cause."""
    night = Night()
    night.send(Boot())
    actions = night.send(PrepareFailed(Finding.PREFLIGHT, "driver: too old", permanent=True, checks=("driver",)))
    assert night.state is State.GAVE_UP
    gave_up = emitted(actions, "gave_up")
    assert gave_up["cause"] == "preflight_failed"
    assert "driver: too old" in gave_up["reason"]
    assert not of(actions, SetTimer)


def test_a_missing_model_found_by_preflight_is_the_model_load_error_sglang_would_report() -> None:
    """The core names a preparation's cause: a failed ``model_path`` check is the finding
    SGLang itself would make a minute later."""
    night = Night()
    night.send(Boot())
    actions = night.send(PrepareFailed(Finding.PREFLIGHT, "model_path: /m missing", permanent=True,
                                       checks=("model_path",)))
    assert night.state is State.GAVE_UP and emitted(actions, "gave_up")["cause"] == "model_load_error"


def test_a_port_held_by_another_process_is_retried_as_port_in_use() -> None:
    night = Night(make_cfg(policy={"backoff_jitter": 0.0}))
    night.send(Boot())
    actions = night.send(PrepareFailed(Finding.PORT_HELD, "port 30000 is held by pid 7 python, not ours"))
    assert night.state is State.BACKOFF and emitted(actions, "preflight_retry")["cause"] == "port_in_use"


def test_preparing_to_gave_up_when_prepare_cause_cannot_be_fixed() -> None:
    """GPU memory that never freed needs a GPU reset: no retry even if not marked permanent."""
    night = Night()
    night.send(Boot())
    actions = night.send(PrepareFailed(Finding.GPU_STUCK, "GPU 3: 96 GB still used"))
    assert night.state is State.GAVE_UP and emitted(actions, "gave_up")["cause"] == "gpu_memory_stuck"


def test_preparing_to_backoff_on_retryable_prepare_failure() -> None:
    """A transient preflight failure retries after the backoff delay, without a crash alert."""
    night = Night(make_cfg(policy={"backoff_jitter": 0.0}))
    night.send(Boot())
    actions = night.send(PrepareFailed(Finding.PREFLIGHT, "disk: 1 GB free", checks=("disk",)))
    assert night.state is State.BACKOFF
    assert timers(actions) == {Timer.BACKOFF: 10.0}
    assert emitted(actions, "preflight_retry")["delay_s"] == 10.0
    assert "crash" not in names(actions)


# --- STARTING -> ... ------------------------------------------------------------------------


def test_starting_to_gave_up_when_launch_fails() -> None:
    """A command that cannot even be executed is a config error: give up."""
    night = Night()
    night.send(Boot())
    night.send(Prepared())
    actions = night.send(LaunchFailed("No such file or directory: '/opt/sglang/venv/bin/python'"))
    assert night.state is State.GAVE_UP
    assert emitted(actions, "gave_up")["cause"] == "config_error"


def test_launched_records_the_pid() -> None:
    """Launched keeps the server's pid and persists it, without changing state."""
    night = Night()
    night.send(Boot())
    night.send(Prepared())
    actions = night.send(Launched(PID))
    assert (night.state, night.core.pid) == (State.STARTING, PID)
    assert of(actions, Persist)


def test_starting_probe_timer_probes_and_failed_probe_polls_again() -> None:
    """While starting, a probe timer probes and a refused probe re-arms the poll timer."""
    night = Night()
    night.starting()
    assert of(night.send(TimerFired(Timer.PROBE), after=2.0), Probe)
    actions = night.send(ProbeResult(ok=False, detail="connection refused"))
    assert night.state is State.STARTING
    assert timers(actions) == {Timer.PROBE: night.cfg.health.startup_poll_s}


def test_starting_to_ready_on_first_good_probe() -> None:
    """The first 200 makes it READY, reports the startup time and arms probe and stable timers."""
    night = Night()
    night.starting()
    night.send(facts(5.0))
    actions = night.send(ProbeResult(ok=True), after=754.0)
    assert night.state is State.READY
    ready = emitted(actions, "server_ready")
    assert ready == {"startup_s": 754.0, "mem_fraction_static": 0.93, "hicache_size_gb": 0, "attempt": 1}
    assert emitted(actions, "startup_facts")["avail_mem_after_capture_gb"] == 5.0
    assert "recovered" not in names(actions)
    assert timers(actions) == {Timer.PROBE: night.cfg.health.interval_s, Timer.STABLE: 600.0}
    assert CancelTimer(Timer.STARTUP) in actions


def test_starting_to_ready_measures_startup_from_a_clock_at_zero() -> None:
    """A launch at t = 0 still gives the right startup time (0.0 is a time, not "unset")."""
    night = Night(now=0.0)
    night.send(Boot())
    night.send(Prepared())
    actions = night.send(ProbeResult(ok=True), after=30.0)
    assert emitted(actions, "server_ready")["startup_s"] == 30.0


def test_ready_at_zero_still_counts_as_serving() -> None:
    """A server that became READY at t = 0 and is then stopped for a hang died serving."""
    night = Night(now=-60.0)
    night.ready(after=60.0)
    assert night.core.run.ready_at == 0.0
    for _ in range(night.cfg.health.failures):
        night.send(ProbeResult(ok=False))
    assert night.state is State.RESTARTING
    assert night.core.phase is Phase.SERVING


def test_ready_after_a_crash_emits_recovered() -> None:
    """The first READY after a crash reports which cause it recovered from."""
    night = Night()
    night.backoff(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()))
    night.relaunch()
    actions = night.send(ProbeResult(ok=True), after=60.0)
    recovered = emitted(actions, "recovered")
    assert (recovered["cause"], recovered["mem_fraction_static"]) == ("cuda_oom_runtime", 0.88)
    assert night.core.recovering_from is None


def test_causes_stay_typed_inside_and_become_strings_in_events() -> None:
    """The core and its history keep Cause/Remedy/Phase; emitted fields carry their values."""
    night = Night()
    actions = night.backoff(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()))
    record = night.core.learned.history[-1]
    assert (record.cause, record.remedy, record.phase) == (Cause.CUDA_OOM_RUNTIME, Remedy.FRACTION_DOWN, Phase.SERVING)
    assert (type(record.cause), type(record.remedy), type(record.phase)) == (Cause, Remedy, Phase)
    assert night.core.last_cause is Cause.CUDA_OOM_RUNTIME
    assert night.core.recovering_from is Cause.CUDA_OOM_RUNTIME
    for emit in of(actions, Emit):
        assert strings_are_plain(emit.event.fields()), emit
    assert emitted(actions, "state_changed")["last_cause"] == "cuda_oom_runtime"
    # ... and the events themselves stay typed: strings only at the edge (fields())
    (crash_event,) = [a.event for a in of(actions, Emit) if a.event.kind == "crash"]
    assert type(crash_event.cause) is Cause and type(crash_event.phase) is Phase
    (changed,) = [a.event for a in of(actions, Emit) if a.event.kind == "state_changed"]
    assert changed.last_cause is Cause.CUDA_OOM_RUNTIME and changed.to is State.BACKOFF


def test_a_misspelt_timer_name_fails_where_it_is_written() -> None:
    """Timers are an enum: "silense" is an error at once, not an event that means nothing."""
    assert TimerFired(Timer("silence")).name is Timer.SILENCE
    with pytest.raises(ValueError, match="silense"):
        Timer("silense")


def test_starting_to_restarting_on_startup_timeout() -> None:
    """Not ready within startup_timeout_s: stop the server with the normal grace period."""
    night = Night()
    night.starting()
    actions = night.send(TimerFired(Timer.STARTUP), after=1800.0)
    assert night.state is State.RESTARTING
    assert of(actions, StopServer) == [StopServer(night.cfg.server.stop_grace_s, "startup_timeout")]
    assert night.core.job.cause is Cause.STARTUP_TIMEOUT


def test_starting_to_restarting_on_low_headroom_step_down() -> None:
    """Too little memory after CUDA-graph capture restarts one rung down before traffic."""
    night = Night()
    night.starting()
    actions = night.send(facts(0.82))
    assert night.state is State.RESTARTING
    alert = emitted(actions, "headroom_low")
    assert alert == {
        "avail_mem_gb": 0.82, "threshold_gb": 2.0, "rank": "TP5", "action": "step_down",
        "mem_fraction_static": 0.93, "next_mem_fraction_static": 0.88,
    }
    assert of(actions, StopServer) == [StopServer(night.cfg.server.stop_grace_s, "headroom_low")]


def test_ready_to_restarting_on_low_headroom_step_down() -> None:
    """Facts that arrive after READY are checked too, once."""
    night = Night()
    night.ready()
    night.send(facts(1.0))
    assert night.state is State.RESTARTING


@pytest.mark.parametrize(
    ("gpu", "fraction"),
    [({"headroom_action": "warn"}, 0.93), ({}, 0.80)],
    ids=["action-warn", "at-ladder-floor"],
)
def test_low_headroom_only_warns_when_told_to_or_at_the_floor(gpu: dict[str, Any], fraction: float) -> None:
    """With headroom_action = "warn", or no rung left below, the guard alerts and keeps serving."""
    night = Night(make_cfg(gpu=gpu, server={"mem_fraction_static": fraction}))
    night.starting()
    actions = night.send(facts(0.5))
    assert night.state is State.STARTING
    alert = emitted(actions, "headroom_low")
    assert (alert["action"], alert["next_mem_fraction_static"]) == ("warn", None)
    assert not of(actions, StopServer)
    assert night.send(facts(0.4)) == []  # checked once per launch


def test_enough_headroom_is_silent() -> None:
    """Headroom at or above the threshold (or not yet known) raises nothing."""
    night = Night()
    night.starting()
    assert night.send(facts(2.0)) == []
    assert night.send(FactsUpdated(StartupFacts(progress="loading_weights"))) == []
    assert night.state is State.STARTING


def test_starting_to_backoff_on_exit_zero() -> None:
    """An exit we did not ask for is a crash even with code 0 (SGLang as PID 1 exits 0)."""
    night = Night()
    night.starting()
    actions = night.send(crash(Cause.OTHER, status=ExitStatus(code=0)), after=40.0)
    assert night.state is State.BACKOFF
    report = emitted(actions, "crash")
    assert (report["exit_code"], report["signal"], report["cause"]) == (0, None, "other")
    assert night.core.crash_times == (night.now,)


def test_starting_to_backoff_on_startup_oom_steps_down() -> None:
    """A CUDA OOM during graph capture lowers the fraction one rung."""
    night = Night()
    night.starting()
    actions = night.send(crash(Cause.CUDA_OOM_STARTUP))
    assert night.state is State.BACKOFF
    assert emitted(actions, "restart_scheduled")["mem_fraction_static"] == 0.88


def test_ready_to_backoff_on_runtime_oom() -> None:
    """A runtime CUDA OOM schedules a restart one rung down and remembers the fraction OOMed."""
    night = Night()
    actions = night.backoff(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()))
    assert night.state is State.BACKOFF
    assert night.core.learned.fraction == 0.88
    assert night.core.learned.oom_fractions == frozenset({0.93})
    scheduled = emitted(actions, "restart_scheduled")
    assert (scheduled["mem_fraction_static"], scheduled["attempt"], scheduled["rung"]) == (0.88, 2, 1)
    assert 9.0 <= timers(actions)[Timer.BACKOFF] <= 11.0
    for name in (Timer.PROBE, Timer.STARTUP, Timer.STABLE):
        assert CancelTimer(name) in actions


@pytest.mark.parametrize(
    ("cause", "override"),
    [
        (Cause.CONFIG_ERROR, None),
        (Cause.MODEL_LOAD_ERROR, None),
        (Cause.GPU_HW_ERROR, None),
        (Cause.CUDA_ERROR, Remedy.GIVE_UP),  # "no kernel image is available": deterministic
    ],
)
def test_ready_to_gave_up_when_a_restart_cannot_fix_it(cause: Cause, override: Remedy | None) -> None:
    """Causes a restart cannot fix give up at once, with a crash alert and no timer."""
    night = Night()
    night.ready()
    actions = night.send(crash(cause, phase=Phase.SERVING, override=override))
    assert night.state is State.GAVE_UP
    assert names(actions)[0] == "crash"
    assert emitted(actions, "crash")["next_retry_s"] is None
    assert emitted(actions, "gave_up")["cause"] == str(cause)
    assert not of(actions, SetTimer)
    assert night.core.learned.restarts == 0


def test_ready_to_gave_up_below_the_ladder_floor() -> None:
    """A runtime OOM at the floor rung gives up rather than going below it."""
    night = Night(make_cfg(server={"mem_fraction_static": 0.80}))
    actions = night.backoff(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()))
    assert night.state is State.GAVE_UP
    assert "floor" in emitted(actions, "gave_up")["reason"]


def test_starting_to_gave_up_after_max_crashes_in_window() -> None:
    """The fifth crash within the hour gives up; the fourth still restarts."""
    night = Night()
    night.starting()
    for _ in range(4):
        night.send(crash(Cause.NCCL_ERROR), after=60.0)
        assert night.state is State.BACKOFF
        night.relaunch(after=200.0)
    actions = night.send(crash(Cause.NCCL_ERROR), after=60.0)
    assert night.state is State.GAVE_UP
    assert "5 crashes within 3600 s" in emitted(actions, "gave_up")["reason"]


def test_crashes_older_than_the_window_are_forgotten() -> None:
    """Crashes spread wider than crash_window_s never spend the budget."""
    night = Night(make_cfg(policy={"crash_window_s": 600.0}))
    night.starting()
    for _ in range(8):
        night.send(crash(Cause.NCCL_ERROR), after=60.0)
        assert night.state is State.BACKOFF
        night.relaunch()  # 1000 s later: the previous crash is out of the window
        assert len(night.core.crash_times) <= 1


def test_oom_while_loading_weights_restarts_without_changing_the_fraction() -> None:
    """A CUDA OOM while loading weights (remedy CLEAR_GPU) keeps the fraction and the OOM set."""
    night = Night()
    night.starting()
    night.send(crash(Cause.CUDA_OOM_STARTUP, override=Remedy.CLEAR_GPU))
    assert night.state is State.BACKOFF
    assert night.core.learned.fraction == 0.93
    assert night.core.learned.oom_fractions == frozenset()


def test_kv_pool_too_small_raises_one_rung_up_to_the_top() -> None:
    """The startup KV-pool error raises the fraction a rung at a time; at the top it gives up."""
    night = Night(make_cfg(server={"mem_fraction_static": 0.85}))
    night.starting()
    night.send(crash(Cause.KV_POOL_TOO_SMALL))
    assert launch_of(night.relaunch()).fraction == 0.88
    night.send(crash(Cause.KV_POOL_TOO_SMALL))
    assert launch_of(night.relaunch()).fraction == 0.93
    actions = night.send(crash(Cause.KV_POOL_TOO_SMALL))
    assert night.state is State.GAVE_UP
    assert "no higher rung" in emitted(actions, "gave_up")["reason"]


def test_kv_pool_too_small_never_raises_to_a_fraction_that_oomed() -> None:
    """After a runtime OOM at 0.93 and a step to 0.88, a KV-pool failure gives up, not 0.93."""
    night = Night()
    night.backoff(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()))
    night.relaunch()
    night.send(crash(Cause.KV_POOL_TOO_SMALL))
    assert night.state is State.GAVE_UP
    assert night.core.learned.fraction == 0.88


def test_host_oom_halves_the_hierarchical_cache() -> None:
    """A host OOM halves hicache_size_gb and turns it off below hicache_min_gb."""
    night = Night(make_cfg(server={"hicache_size_gb": 24}))
    night.starting()
    actions = night.send(crash(Cause.HOST_OOM))
    report = emitted(actions, "crash")
    assert (report["hicache_size_gb"], report["next_hicache_size_gb"]) == (24, 12)
    launch = launch_of(night.relaunch())
    assert flag(launch.argv, "--hicache-size") == "12"
    night.send(crash(Cause.HOST_OOM))
    launch = launch_of(night.relaunch())
    assert launch.hicache_size_gb == 0
    assert "--enable-hierarchical-cache" not in launch.argv


# --- READY -> ... ---------------------------------------------------------------------------


def test_ready_to_restarting_after_n_failed_probes() -> None:
    """Three failed probes in a row while serving: SIGQUIT first (SGLang dumps its stacks into
    its log), then the group is killed after hang_dump_wait_s."""
    night = Night()
    night.ready()
    for _ in range(night.cfg.health.failures - 1):
        actions = night.send(ProbeResult(ok=False, detail="503"), after=10.0)
        assert night.state is State.READY
        assert timers(actions) == {}  # the probe timer runs at a fixed rate, not per answer
    actions = night.send(ProbeResult(ok=False, detail="timeout after 30 s"), after=10.0)
    assert night.state is State.RESTARTING
    assert of(actions, StopServer) == [StopServer(night.cfg.health.hang_dump_wait_s, "hang", StopMode.DUMP)]
    assert night.core.job.cause is Cause.HANG


def test_probe_timer_while_ready_probes_and_rearms_at_a_fixed_rate() -> None:
    """While serving, each probe tick re-arms the next one at once: a slow (hung) probe does
    not delay the next, so a hang is caught after interval x failures + timeout."""
    night = Night()
    night.ready()
    actions = night.send(TimerFired(Timer.PROBE), after=10.0)
    assert of(actions, Probe) and timers(actions) == {Timer.PROBE: night.cfg.health.interval_s}


def test_ready_to_exited_when_the_server_dies() -> None:
    """The exit is noticed as a state change at once, before the crash log is read."""
    night = Night()
    night.ready()
    actions = night.send(Died(ExitStatus(signal=9)))
    assert night.state is State.EXITED
    assert {a.name for a in of(actions, CancelTimer)} == {Timer.PROBE, Timer.STARTUP, Timer.SILENCE, Timer.STABLE, Timer.PROBATION}
    assert emitted(actions, "state_changed")["reason"] == "server killed by SIGKILL"


def test_exited_to_backoff_when_the_diagnosis_arrives() -> None:
    """EXITED -> BACKOFF with the diagnosis' remedy: a runtime OOM steps down to 0.88."""
    night = Night()
    night.ready()
    night.send(Died(ExitStatus(signal=9)))
    actions = night.send(crash(Cause.CUDA_OOM_RUNTIME, phase=Phase.SERVING))
    assert night.state is State.BACKOFF
    assert emitted(actions, "crash")["next_mem_fraction_static"] == 0.88


def test_exited_to_stopped_on_sigterm() -> None:
    """A stop request while the crash is being read: nothing runs, so stop at once."""
    night = Night()
    night.ready()
    night.send(Died(ExitStatus(signal=9)))
    actions = night.send(StopRequested("SIGTERM"))
    assert night.state is State.STOPPED and of(actions, Exit) == [Exit(0)]


def test_server_died_while_restarting_waits_for_the_exit_report() -> None:
    """A death we caused (RESTARTING) is not a crash: the state stays until Diagnosed. A hung
    server's log is still read (what it said is kept beside our finding)."""
    night = Night()
    night.ready()
    for _ in range(night.cfg.health.failures):
        night.send(ProbeResult(ok=False))
    assert night.send(Died(ExitStatus(signal=9))) == [Diagnose(read_log=True, phase=Phase.SERVING)]
    assert night.state is State.RESTARTING


@pytest.mark.parametrize("how", ["operator", "daemon stop", "gpu lost"])
def test_a_planned_stop_does_not_read_the_log(how: str) -> None:
    """One death, one path: the core asks for the tidy-up of every death, and reads the log
    only where it can tell something (a crash, a hang)."""
    night = Night()
    night.ready()
    night.send({"operator": RestartRequested("rolling restart"), "daemon stop": StopRequested("SIGTERM"),
                "gpu lost": GpuLost("Xid 79")}[how])
    assert of(night.send(Died(ExitStatus(signal=15))), Diagnose) == [Diagnose(read_log=False, phase=Phase.SERVING)]


def test_a_crash_is_read_once_its_tree_is_tidied() -> None:
    """READY -> EXITED at the death, with the diagnosis asked for; a part's death asks only
    for the bounded teardown, whose end (the main process) is then read."""
    night = Night()
    night.ready()
    actions = night.send(Died(None, 4300, "sglang::scheduler_TP0"))
    assert night.state is State.EXITED and not of(actions, Diagnose) and of(actions, StopServer)
    assert of(night.send(Died(ExitStatus(code=0))), Diagnose) == [Diagnose(read_log=True, phase=Phase.SERVING)]


def test_good_probe_while_ready_resets_the_failed_probe_count() -> None:
    """Failed probes must be consecutive: one good answer starts the count again."""
    night = Night()
    night.ready()
    assert of(night.send(TimerFired(Timer.PROBE), after=10.0), Probe)
    for _ in range(5):
        night.send(ProbeResult(ok=False))
        night.send(ProbeResult(ok=False))
        night.send(ProbeResult(ok=True))
    assert (night.state, night.core.run.probe_failures) == (State.READY, 0)


def test_stable_period_resets_the_backoff_streak() -> None:
    """After stable_after_s READY, the next crash waits the initial delay again."""
    night = Night(make_cfg(policy={"backoff_jitter": 0.0}))
    night.starting()
    for _ in range(3):
        night.send(crash(Cause.NCCL_ERROR))
        night.relaunch()
    night.send(ProbeResult(ok=True))
    assert night.core.failures == 3
    assert names(night.send(TimerFired(Timer.STABLE), after=600.0)) == ["stable"]
    assert night.core.failures == 0
    actions = night.send(crash(Cause.NCCL_ERROR, phase=Phase.SERVING))
    assert timers(actions) == {Timer.BACKOFF: 10.0}


# --- RESTARTING / BACKOFF / STOPPING -> ... ------------------------------------------------


def test_restarting_to_backoff_when_the_requested_stop_is_done() -> None:
    """The exit we asked for is recorded with our cause (hang), not the exit's own diagnosis."""
    night = Night()
    night.ready()
    for _ in range(night.cfg.health.failures):
        night.send(ProbeResult(ok=False, detail="timeout"))
    actions = night.send(crash(Cause.CUDA_OOM_RUNTIME, phase=Phase.SERVING))
    assert night.state is State.BACKOFF
    report = emitted(actions, "crash")
    assert (report["cause"], report["phase"], report["exit_code"], report["signal"]) == (
        "hang", "serving", None, None,
    )
    assert night.core.learned.fraction == 0.93  # a hang is no reason to change the fraction
    assert night.core.learned.history[-1].exit == "stopped by the supervisor"


def test_restarting_to_preparing_at_once_after_headroom_step_down() -> None:
    """A preemptive step-down relaunches at once one rung down (no BACKOFF, no timer) and is
    not counted as a crash."""
    night = Night()
    night.starting()
    night.send(facts(0.82))
    actions = night.send(crash(Cause.OTHER, status=ExitStatus(code=0)))
    assert night.state is State.PREPARING and of(actions, Prepare)
    assert "crash" not in names(actions)
    assert timers(actions) == {}
    assert (night.core.failures, night.core.crash_times) == (0, ())
    assert launch_of(night.send(Prepared())).fraction == 0.88


def test_restarting_to_gave_up_when_the_crash_budget_is_spent() -> None:
    """A startup timeout that is the max_crashes-th crash of the window gives up."""
    night = Night(make_cfg(policy={"max_crashes": 1}))
    night.starting()
    night.send(TimerFired(Timer.STARTUP), after=1800.0)
    night.send(crash(Cause.OTHER))
    assert night.state is State.GAVE_UP


def test_backoff_to_preparing_when_delay_elapsed() -> None:
    """When the backoff timer fires the GPUs are prepared again before the relaunch."""
    night = Night()
    night.backoff()
    actions = night.send(TimerFired(Timer.BACKOFF), after=10.0)
    assert night.state is State.PREPARING
    assert of(actions, Prepare) and not of(actions, Launch)


def test_stopping_to_stopped_when_server_exits() -> None:
    """Our own stop is not a crash: STOPPED, a server_stopped event, and exit 0."""
    night = Night()
    night.ready()
    night.send(StopRequested("SIGTERM"))
    actions = night.send(crash(Cause.OTHER, status=ExitStatus(signal=15)))
    assert night.state is State.STOPPED
    assert "crash" not in names(actions)
    assert emitted(actions, "server_stopped") == {"reason": "SIGTERM", "exit_code": None, "signal": 15}
    assert of(actions, Exit) == [Exit(0)]
    assert night.core.learned.restarts == 0


# --- * -> GAVE_UP on a lost GPU ------------------------------------------------------------


def _drive_to(night: Night, state: State) -> None:
    """Bring a fresh night into ``state`` by ordinary events."""
    if state is State.PREPARING:
        night.send(Boot())
    elif state is State.STARTING:
        night.starting()
    elif state is State.READY:
        night.ready()
    elif state is State.RESTARTING:
        night.ready()
        night.send(TimerFired(Timer.PROBE))
        for _ in range(night.cfg.health.failures):
            night.send(ProbeResult(ok=False))
    elif state is State.BACKOFF:
        night.backoff()
    elif state is State.GAVE_UP:
        night.starting()
        night.send(crash(Cause.CONFIG_ERROR))
    elif state is State.STOPPING:
        night.ready()
        night.send(StopRequested("SIGTERM"))
    assert night.state is state


@pytest.mark.parametrize(
    "state", [State.PREPARING, State.STARTING, State.READY, State.RESTARTING, State.BACKOFF]
)
def test_any_active_state_to_gave_up_on_gpu_lost(state: State) -> None:
    """A GPU that fell off the bus gives up from any active state and stops a live server."""
    night = Night()
    _drive_to(night, state)
    had_server = night.core.pid is not None
    actions = night.send(GpuLost("GPU 3: NVML_ERROR_GPU_IS_LOST"))
    assert night.state is State.GAVE_UP
    assert emitted(actions, "gave_up")["cause"] == "gpu_hw_error"
    assert bool(of(actions, StopServer)) == had_server


def test_starting_to_gave_up_on_gpu_lost_stops_a_launch_in_flight() -> None:
    """A GPU lost between Launch and Launched still stops the server being launched."""
    night = Night()
    night.send(Boot())
    night.send(Prepared())
    assert night.core.pid is None
    actions = night.send(GpuLost("GPU 0 lost"))
    assert of(actions, StopServer) == [StopServer(night.cfg.server.stop_grace_s, "gpu_hw_error")]


def test_gave_up_with_live_server_to_stopping_on_stop_request() -> None:
    """After a lost GPU the server is still being stopped: shutdown waits for its exit."""
    night = Night()
    night.ready()
    night.send(GpuLost("GPU 3 lost"))
    assert night.core.pid == PID
    actions = night.send(StopRequested("SIGTERM"))
    assert night.state is State.STOPPING
    assert of(actions, StopServer) and not of(actions, Exit)
    assert of(night.send(crash()), Exit) == [Exit(0)]
    assert night.state is State.STOPPED


def test_gave_up_forgets_the_pid_when_the_server_exits() -> None:
    """The exit of a server we gave up on is recorded, not treated as a crash."""
    night = Night()
    night.ready()
    night.send(GpuLost("GPU 3 lost"))
    actions = night.send(crash())
    assert (night.state, night.core.pid) == (State.GAVE_UP, None)
    assert actions == [Persist()]


# --- -> STOPPING / -> STOPPED on a stop request --------------------------------------------


@pytest.mark.parametrize("state", [State.STARTING, State.READY, State.RESTARTING])
def test_server_states_to_stopping_on_stop_request(state: State) -> None:
    """A stop request with a server up stops it with grace and waits for its exit."""
    night = Night()
    _drive_to(night, state)
    actions = night.send(StopRequested("SIGTERM"))
    assert night.state is State.STOPPING
    assert of(actions, StopServer) == [StopServer(night.cfg.server.stop_grace_s, "SIGTERM")]
    assert not of(actions, Exit)


@pytest.mark.parametrize("state", [State.STOPPED, State.PREPARING, State.BACKOFF, State.GAVE_UP])
def test_idle_states_to_stopped_on_stop_request(state: State) -> None:
    """With no server up a stop request ends the daemon at once."""
    night = Night()
    _drive_to(night, state)
    actions = night.send(StopRequested("SIGINT"))
    assert night.state is State.STOPPED
    assert of(actions, Exit) == [Exit(0)]
    assert CancelTimer(Timer.BACKOFF) in actions


def test_stop_request_while_stopping_is_ignored() -> None:
    """A second SIGTERM while stopping does nothing more."""
    night = Night()
    _drive_to(night, State.STOPPING)
    assert night.send(StopRequested("SIGTERM")) == []
    assert night.state is State.STOPPING


# --- non-edges --------------------------------------------------------------------------------


def test_config_change_rebases_only_when_the_starting_point_changed() -> None:
    """A reload keeps the learned rung unless the configured fraction itself changed."""
    night = Night()
    night.backoff(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()))
    assert night.send(ConfigChanged()) == []
    night.cfg = make_cfg(server={"mem_fraction_static": 0.85})
    assert night.send(ConfigChanged()) == [Persist()]
    learned = night.core.learned
    assert (learned.fraction, learned.oom_fractions, learned.restarts) == (0.85, frozenset({0.93}), 1)
    assert night.state is State.BACKOFF


@pytest.mark.parametrize(
    "event",
    [Prepared(), Launched(1), ProbeResult(ok=True), ProbeResult(ok=False), TimerFired(Timer.STARTUP),
     TimerFired(Timer.STABLE), TimerFired(Timer.PROBE), crash(), LaunchFailed("x"), facts(0.1), Boot()],
)
def test_late_events_mean_nothing_in_backoff(event: Event) -> None:
    """Events left over from an earlier server (a late probe, a stale timer) change nothing."""
    night = Night()
    night.backoff()
    before = night.core
    assert night.send(event) == []
    assert night.core == before


# --- the seed's night -------------------------------------------------------------------------


def test_full_night_oom_at_093_relaunches_at_088() -> None:
    """The seed: launched at 0.93, runtime OOM under the first prefill burst, relaunched at 0.88."""
    night = Night()
    first = launch_of(night.starting())
    assert flag(first.argv, "--mem-fraction-static") == "0.93"
    assert flag(first.argv, "--tp-size") == "8"
    night.send(facts(2.5))  # headroom fine by the guard's threshold
    night.send(ProbeResult(ok=True), after=900.0)
    assert night.state is State.READY
    actions = night.send(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()), after=3 * 3600.0)

    assert night.state is State.BACKOFF
    report = emitted(actions, "crash")
    delay = timers(actions)[Timer.BACKOFF]
    assert report == {
        "cause": "cuda_oom_runtime",
        "remedy": "fraction_down",
        "phase": "serving",
        "exit_code": None,
        "signal": SIGKILL,
        "evidence": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."],
        "evidence_lineno": 412,
        "location": "deepseek_v2.py:2919 forward",
        "rank": "TP3",
        "exc_type": "torch.OutOfMemoryError",
        "exc_message": "CUDA out of memory. Tried to allocate 2.00 GiB.",
        "mem_fraction_static": 0.93,
        "hicache_size_gb": 0,
        "attempt": 1,
        "next_mem_fraction_static": 0.88,
        "next_hicache_size_gb": 0,
        "next_retry_s": round(delay, 3),
        "consecutive_failures": 1,
        "certain": True,
        "phase_source": "",
        "runner_up": None,
        "min_fraction": None,
        "part_died": None,
        "log_cause": None,
        "log_evidence": [],
        "basis": "",
        "unrecognised": None,
        "killed": None,
    }
    assert 9.0 <= delay <= 11.0
    record = night.core.learned.history[-1]
    assert (record.cause, record.fraction, record.next_fraction, record.exit) == (
        Cause.CUDA_OOM_RUNTIME, 0.93, 0.88, "killed by SIGKILL",
    )

    night.send(TimerFired(Timer.BACKOFF), after=delay)
    assert night.state is State.PREPARING
    actions = night.send(Prepared())
    assert night.state is State.STARTING
    second = launch_of(actions)
    assert (second.attempt, second.fraction) == (2, 0.88)
    assert flag(second.argv, "--mem-fraction-static") == "0.88"
    assert "--tp" not in second.argv


# --- property: random events ------------------------------------------------------------------

_CAUSES = st.sampled_from(list(Cause))
_DIAGNOSES = st.builds(
    Diagnosis,
    cause=_CAUSES,
    phase=st.sampled_from(list(Phase)),
    remedy_override=st.none() | st.sampled_from(list(Remedy)),
)
_STATUSES = st.builds(ExitStatus, code=st.integers(0, 255)) | st.builds(
    ExitStatus, signal=st.integers(1, 64)
)
_FACTS = st.builds(
    lambda avail: StartupFacts(ranks={"TP0": RankFacts("TP0", avail_mem_after_capture_gb=avail)}),
    st.none() | st.floats(0.0, 10.0),
)
_EVENTS: st.SearchStrategy[Event] = st.one_of(
    st.just(Boot()),
    st.just(Prepared()),
    st.builds(PrepareFailed, finding=st.sampled_from(list(Finding)), detail=st.just("x"), permanent=st.booleans(),
              checks=st.sampled_from([(), ("model_path",), ("disk",)])),
    st.builds(Launched, pid=st.integers(2, 10**6)),
    st.builds(LaunchFailed, error=st.just("ENOENT")),
    st.builds(ProbeResult, ok=st.booleans()),
    st.builds(FactsUpdated, facts=_FACTS),
    st.builds(Diagnosed, status=_STATUSES, diagnosis=_DIAGNOSES),
    st.builds(Died, status=_STATUSES),
    st.builds(Died, status=st.none(), pid=st.integers(2, 10**6), title=st.just("sglang::scheduler_TP0")),
    st.builds(TimerFired, name=st.sampled_from(list(Timer))),
    st.builds(GpuLost, detail=st.just("lost")),
    st.builds(StopRequested, reason=st.just("SIGTERM")),
    st.builds(HoldRequested, reason=st.just("maintenance")),
    st.builds(StartRequested, reason=st.just("maintenance done")),
    st.just(ConfigChanged()),
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(_EVENTS, st.floats(0.0, 5000.0)), max_size=60),
    max_crashes=st.integers(1, 8),
    headroom_action=st.sampled_from(["step_down", "warn"]),
)
def test_random_events_never_raise_and_never_run_two_servers(
    steps: list[tuple[Event, float]], max_crashes: int, headroom_action: str
) -> None:
    """Any event sequence (until the daemon exits) keeps a valid state, sane timers and at
    most one server: no second Launch without a Diagnosed in between. A new state is
    persisted before ``state_changed`` announces it."""
    night = Night(make_cfg(policy={"max_crashes": max_crashes}, gpu={"headroom_action": headroom_action}))
    ladder = night.cfg.policy.fraction_ladder
    server_may_run = False
    for event, after in steps:
        if isinstance(event, Diagnosed):
            server_may_run = False
        actions = night.send(event, after=after)
        assert isinstance(night.state, State)
        assert ladder[-1] <= night.core.learned.fraction <= ladder[0]
        for timer in of(actions, SetTimer):
            assert math.isfinite(timer.delay_s) and timer.delay_s >= 0
        for emit in of(actions, Emit):
            assert strings_are_plain(emit.event.fields()), emit
        if "state_changed" in names(actions):
            # on disk before it is announced: a daemon killed right after the event leaves it
            announced = next(i for i, a in enumerate(actions) if isinstance(a, Emit) and a.event.kind == "state_changed")
            assert any(isinstance(a, Persist) for a in actions[:announced]), actions
        for _launch in of(actions, Launch):
            assert not server_may_run, "a second Launch while a server may still run"
            server_may_run = True
        if of(actions, Exit):
            assert night.state is State.STOPPED
            break  # the daemon exits: no event follows



# --- issue 12: the real server's ways --------------------------------------------------------


def test_starting_silence_timer_rearms_while_the_server_prints() -> None:
    """A start that still prints lines is progress: the silence timer re-arms for the rest."""
    night = Night()
    night.starting()
    limit = night.cfg.health.startup_silence_s
    actions = night.send(TimerFired(Timer.SILENCE, last_output_at=night.now + limit - 100.0), after=limit)
    assert night.state is State.STARTING
    assert timers(actions) == {Timer.SILENCE: pytest.approx(limit - 100.0)}


def test_starting_to_restarting_after_silence() -> None:
    """No new line for startup_silence_s while starting: a startup timeout, stopped with grace."""
    night = Night()
    night.starting()
    launched = night.now
    actions = night.send(
        TimerFired(Timer.SILENCE, last_output_at=launched + 5.0), after=night.cfg.health.startup_silence_s + 5.0
    )
    assert night.state is State.RESTARTING
    assert night.core.job.cause is Cause.STARTUP_TIMEOUT
    assert of(actions, StopServer) == [StopServer(night.cfg.server.stop_grace_s, "startup_timeout", StopMode.DRAIN)]


def test_ready_to_exited_when_a_part_dies() -> None:
    """A dead scheduler is the crash: READY is left and the down alert emitted at once, and
    SGLang's own teardown is awaited (bounded by the grace period) before the diagnosis."""
    night = Night()
    night.ready()
    actions = night.send(Died(None, 777, "sglang::scheduler_TP0"))
    assert night.state is State.EXITED
    down = emitted(actions, "server_down")
    assert (down["pid"], down["title"], down["phase"]) == (777, "sglang::scheduler_TP0", "serving")
    assert of(actions, StopServer) == [
        StopServer(night.cfg.server.stop_grace_s, "sglang::scheduler_TP0 (pid 777) died", StopMode.AWAIT)
    ]
    actions = night.send(crash(Cause.OTHER, phase=Phase.SERVING))
    assert night.state is State.BACKOFF
    assert emitted(actions, "crash")["part_died"] == "sglang::scheduler_TP0 (pid 777)"


def test_ready_to_restarting_on_a_restart_request() -> None:
    """An operator's restart drains (SIGTERM to main), relaunches at once with the same flags,
    and is not counted as a crash."""
    night = Night()
    night.ready()
    actions = night.send(RestartRequested("sglang-supervisor restart"))
    assert night.state is State.RESTARTING
    assert of(actions, StopServer) == [
        StopServer(night.cfg.server.stop_grace_s, "operator_restart", StopMode.DRAIN)
    ]
    actions = night.send(Diagnosed(ExitStatus(code=0), Diagnosis(Cause.OTHER, Phase.SERVING)))
    assert night.state is State.PREPARING and of(actions, Prepare)
    assert timers(actions) == {}
    assert "crash" not in names(actions)
    assert night.core.crash_times == ()
    launch = launch_of(night.send(Prepared()))
    assert launch.fraction == 0.93


def test_a_planned_restart_is_one_job_with_one_queue_trip_and_no_backoff() -> None:
    """The machine's event order for a planned restart: the request makes a job (queued, then
    run) and RESTARTING; the server's stop, in one step, ends the job and goes RESTARTING ->
    PREPARING with the relaunch scheduled at once. No BACKOFF state, no timer to wait for."""
    night = Night()
    night.ready()
    requested = night.send(RestartRequested("sglang-supervisor restart"))
    assert names(requested) == ["job_queued", "job_started", "state_changed"]
    assert emitted(requested, "job_queued")["job_type"] == "restart"
    assert emitted(requested, "state_changed")["to"] == "RESTARTING"
    stopped = night.send(Diagnosed(ExitStatus(code=0), Diagnosis(Cause.OTHER, Phase.SERVING)))
    assert names(stopped) == ["job_done", "state_changed", "restart_scheduled"]
    assert (emitted(stopped, "state_changed")["from"], emitted(stopped, "state_changed")["to"]) == (
        "RESTARTING", "PREPARING")
    assert emitted(stopped, "restart_scheduled")["delay_s"] == 0.0
    assert of(stopped, Prepare) and not of(stopped, SetTimer)
    assert night.core.job is None and night.core.queued is None
    night.send(Prepared())
    assert night.state is State.STARTING and night.core.attempt == 2


def test_a_restart_asked_for_while_preparing_is_merged_into_that_launch() -> None:
    """systemd merges a restart job into a start under way: so does the core."""
    night = Night()
    night.send(Boot())
    actions = night.send(RestartRequested("now"))
    assert names(actions) == ["job_queued", "job_done"]
    assert "merged" in emitted(actions, "job_done")["detail"]
    assert night.state is State.PREPARING and night.core.queued is None


def test_a_restart_asked_for_while_a_crash_is_read_runs_in_backoff() -> None:
    """A restart that cannot run while the crash is diagnosed waits, then prepares at once
    from BACKOFF with the crash budget afresh."""
    night = Night()
    night.ready()
    night.send(Died(ExitStatus(signal=SIGKILL)))
    assert night.state is State.EXITED
    queued = night.send(RestartRequested("now"))
    assert names(queued) == ["job_queued"] and night.core.queued is not None
    actions = night.send(crash(Cause.OTHER, phase=Phase.SERVING))
    assert night.state is State.PREPARING and night.core.crash_times == ()
    assert names(actions)[-2:] == ["state_changed", "job_done"] and "job_started" in names(actions)


def test_a_stop_cancels_the_restart_under_way() -> None:
    night = Night()
    night.ready()
    night.send(RestartRequested("rolling restart"))
    actions = night.send(StopRequested("SIGTERM"))
    assert night.state is State.STOPPING
    assert emitted(actions, "job_cancelled")["job_type"] == "restart"
    assert emitted(actions, "job_started")["job_type"] == "stop"
    done = night.send(Diagnosed(ExitStatus(code=0), None))
    assert night.state is State.STOPPED and emitted(done, "job_done")["job_type"] == "stop"


def test_backoff_to_preparing_on_a_restart_request() -> None:
    """In BACKOFF a restart request prepares at once and starts the crash budget afresh."""
    night = Night()
    night.backoff()
    actions = night.send(RestartRequested("now"))
    assert night.state is State.PREPARING
    assert of(actions, Prepare) and CancelTimer(Timer.BACKOFF) in actions
    assert night.core.crash_times == ()


def test_hang_keeps_what_the_servers_log_said() -> None:
    """After a hang kill the crash record keeps the log's own reading next to ours."""
    night = Night()
    night.ready()
    for _ in range(night.cfg.health.failures):
        night.send(ProbeResult(ok=False, detail="timeout"), after=10.0)
    assert night.state is State.RESTARTING
    log_said = Diagnosis(Cause.OTHER, Phase.SERVING, evidence=("Received sigquit from a child process.",))
    actions = night.send(Diagnosed(ExitStatus(signal=SIGKILL), log_said))
    report = emitted(actions, "crash")
    assert report["cause"] == "hang"
    assert (report["log_cause"], report["log_evidence"]) == ("other", ["Received sigquit from a child process."])


def test_unset_fraction_launches_without_the_flag_and_learns_sglangs_choice() -> None:
    """No mem_fraction_static: SGLang chooses; its server_args line teaches the ladder where it is,
    and a runtime OOM then steps down to the highest rung below that choice."""
    night = Night(_unset_cfg())
    launch = launch_of(night.starting())
    assert launch.fraction is None and "--mem-fraction-static" not in launch.argv
    actions = night.send(FactsUpdated(StartupFacts(progress="launching", mem_fraction_static=0.9)))
    assert emitted(actions, "fraction_learned")["mem_fraction_static"] == 0.9
    night.send(ProbeResult(ok=True), after=60.0)
    actions = night.send(Diagnosed(ExitStatus(signal=SIGKILL), oom_runtime()), after=60.0)
    assert emitted(actions, "crash")["next_mem_fraction_static"] == 0.88
    assert flag(launch_of(night.relaunch()).argv, "--mem-fraction-static") == "0.88"


def _unset_cfg() -> Config:
    return build_config({"server": {"model_path": "m", "tp_size": 8}})


def test_kv_pool_failure_goes_up_past_the_fraction_sglang_names() -> None:
    """'Raise --mem-fraction-static above 0.004' at 0.0001 goes to the next rung above 0.004."""
    cfg = make_cfg(server={"mem_fraction_static": 0.0001}, policy={"fraction_ladder": [0.10, 0.05, 0.0001]})
    night = Night(cfg)
    night.starting()
    kv = Diagnosis(Cause.KV_POOL_TOO_SMALL, Phase.STARTING, evidence=("ValueError: ...",), min_fraction=0.004)
    actions = night.send(Diagnosed(ExitStatus(code=1), kv), after=20.0)
    assert emitted(actions, "crash")["next_mem_fraction_static"] == 0.05
    assert launch_of(night.relaunch()).fraction == 0.05



# --- issue 15: the router's view follows the server ------------------------------------------

ROUTER = {"router": {"enabled": True, "url": "http://127.0.0.1:30080"}}


def router_night() -> Night:
    return Night(make_cfg(**ROUTER))


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_registered_once_ready() -> None:
    night = router_night()
    night.starting()
    actions = night.send(ProbeResult(ok=True), after=60.0)
    assert night.state is State.READY
    assert of(actions, RouterAdd) == [RouterAdd()]
    assert kinds(actions).index("RouterAdd") > kinds(actions).index("Persist")  # after the state is READY


def test_a_dead_server_is_taken_out_first_thing() -> None:
    """At the moment a death is noticed (main or a part), the removal is the first action:
    before the state is written, the alerts and SGLang's own teardown."""
    for death in (Died(ExitStatus(signal=9)), Died(None, 4300, "sglang::scheduler_TP0")):
        night = router_night()
        night.ready()
        actions = night.send(death, after=5.0)
        assert night.state is State.EXITED
        assert isinstance(actions[0], RouterRemove) and actions[0].at == night.now
        assert len(of(actions, RouterRemove)) == 1  # the AWAIT stop that follows a part's death adds none


@pytest.mark.parametrize("how", ["headroom", "hang", "operator", "daemon stop", "gpu lost"])
def test_every_planned_stop_takes_the_server_out_before_it(how: str) -> None:
    night = router_night()
    night.ready()
    event: Event = {
        "headroom": facts(0.5),
        "hang": ProbeResult(ok=False, detail="timeout"),
        "operator": RestartRequested("rolling restart"),
        "daemon stop": StopRequested("SIGTERM"),
        "gpu lost": GpuLost("Xid 79"),
    }[how]
    for _ in range(night.cfg.health.failures if how == "hang" else 1):
        actions = night.send(event, after=1.0)
    order = kinds(actions)
    assert "StopServer" in order, order
    assert order.index("RouterRemove") < order.index("StopServer"), order
    assert order.count("RouterRemove") == 1


def test_no_router_actions_when_it_is_off() -> None:
    night = Night()
    night.ready()
    actions = night.send(Died(ExitStatus(signal=9)))
    assert not of(actions, RouterRemove) and not of(actions, RouterAdd)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(_EVENTS, st.floats(0.0, 5000.0)), max_size=60))
def test_random_events_never_stop_a_server_the_router_still_sends_to(steps: list[tuple[Event, float]]) -> None:
    """Whatever happens: a stop comes after a removal (in the same step, or at the death
    that made the server EXITED), and a registration only on the way into READY."""
    night = router_night()
    for event, after in steps:
        before = night.state
        actions = night.send(event, after=after)
        order = kinds(actions)
        if "StopServer" in order and before is not State.EXITED:
            assert "RouterRemove" in order[: order.index("StopServer")], order
        if of(actions, RouterAdd):
            assert night.state is State.READY and before is not State.READY
        if of(actions, Exit):
            break
