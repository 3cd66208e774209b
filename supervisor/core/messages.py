"""What goes into the core and what comes out of it: the inputs ``step`` takes (what the
shell saw happen) and the actions it returns (what the shell is to do), with ``Ctx``, the
inputs besides state and event."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from supervisor.core import events as ev
from supervisor.core.capacity import MemoryPoint
from supervisor.core.config import Config
from supervisor.core.fleet import FleetOom
from supervisor.core.model import Diagnosis, ExitStatus, Phase, StartupFacts
from supervisor.core.state import Timer

# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Boot:
    """The daemon is up and wants a server."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """Old processes are gone, the GPUs are free and preflight passed."""


class Finding(enum.StrEnum):
    """What stopped a preparation, as the shell saw it (the core names the cause)."""

    PORT_HELD = "port_held"  # the server's port is held by a process that is not ours
    GPU_LOST = "gpu_lost"  # a GPU fell off the bus (NVML says so)
    GPU_STUCK = "gpu_stuck"  # the GPUs' memory was not released in time
    PREFLIGHT = "preflight"  # a preflight check failed (``checks``: the failed ones' names)
    INTERNAL = "internal"  # the preparation itself raised


@dataclass(frozen=True, slots=True)
class PrepareFailed:
    finding: Finding
    detail: str
    permanent: bool = False  # the shell's checks said a retry cannot help
    checks: tuple[str, ...] = ()  # PREFLIGHT: the names of the checks that failed


@dataclass(frozen=True, slots=True)
class Launched:
    pid: int


@dataclass(frozen=True, slots=True)
class LaunchFailed:
    error: str


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class FactsUpdated:
    facts: StartupFacts


@dataclass(frozen=True, slots=True)
class Died:
    """A process of the server's tree died: the main process (reaped, ``status`` its exit),
    or a part of it, a scheduler or the detokenizer, while the main process lives (``status``
    None: not ours to reap). SGLang's main process notices a dead part too, sleeps, then
    kills its tree, so a part's death is the crash. The core answers a main process's death
    with ``Diagnose``; its outcome comes back as ``Diagnosed``."""

    status: ExitStatus | None
    pid: int | None = None
    title: str = "main"

    @property
    def main(self) -> bool:
        return self.status is not None


@dataclass(frozen=True, slots=True)
class Diagnosed:
    """The server's tree is gone and tidied (leftovers killed, output drained), and its log
    read when the core asked (``diagnosis`` None: a planned stop, or nothing ran)."""

    status: ExitStatus
    diagnosis: Diagnosis | None


@dataclass(frozen=True, slots=True)
class TimerFired:
    name: Timer
    # For SILENCE: when the server last printed a line (monotonic), read as the timer fires.
    last_output_at: float | None = None


@dataclass(frozen=True, slots=True)
class RestartRequested:
    """An operator asked for a planned restart with the current flags (drained)."""

    reason: str


@dataclass(frozen=True, slots=True)
class GpuLost:
    detail: str


@dataclass(frozen=True, slots=True)
class StopRequested:
    """The daemon is stopping: the server is stopped for good and the unit ends."""

    reason: str


@dataclass(frozen=True, slots=True)
class HoldRequested:
    """An operator's ``stop --server``: out of the router, drained, stopped and kept stopped
    (across daemon restarts too) while the daemon stays up; no crash is counted."""

    reason: str


@dataclass(frozen=True, slots=True)
class StartRequested:
    """An operator's ``start --server``: a held server is prepared and launched again."""

    reason: str


@dataclass(frozen=True, slots=True)
class ConfigChanged:
    """A reload was accepted; the new config is in ctx. Applied at the next launch."""


@dataclass(frozen=True, slots=True)
class GroupLaunch:
    """[group]: the leader decided generation ``number``: launch this node's rank with these
    managed flags (the group's, whatever this node learned alone)."""

    number: int
    fraction: float | None
    hicache_size_gb: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GroupEnded:
    """[group]: generation ``number`` ended (a node's server died, or a node was lost):
    stop this node's rank, drained, and wait for the next one."""

    number: int
    reason: str


@dataclass(frozen=True, slots=True)
class GroupGaveUp:
    """[group]: the leader gave up on the group (a cause a restart cannot fix, or the crash
    budget is spent): a human must look."""

    reason: str


@dataclass(frozen=True, slots=True)
class FleetAdvice:
    """What the fleet's record says of the configuration about to be launched (read while
    PREPARING). ``fraction`` None: the fleet does not know it (or etcd could not be read);
    ``key`` "": its identity could not be read."""

    key: str
    fraction: float | None = None
    oom_fractions: tuple[float, ...] = ()
    source: str = ""
    when: str = ""
    points: tuple[MemoryPoint, ...] = ()  # the memory model's points under this key (core.capacity)
    kept: float | None = None  # the highest fraction a climb kept there past its probation


@dataclass(frozen=True, slots=True)
class GpuFree:
    """The least free memory of each of the server's GPUs (GB, in the order the server sees
    them) since its launch, sent when one of them fell lower: the peak the forward passes
    reached, as NVML sees it (PyTorch's caching allocator keeps what it reserved)."""

    least_free_gb: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class KvPressure:
    """SGLang said its KV pool ran short: it retracted requests (``retraction``), refused one
    that cannot fit even alone (``refused``), or its ``/metrics`` showed the pool nearly full
    while requests wait and the queue does not shrink (``metrics``)."""

    source: str
    detail: str


@dataclass(frozen=True, slots=True)
class KvSample:
    """SGLang's ``/metrics`` read with a probe: the KV pool's highest token usage (0..1)
    and the requests waiting in its queue."""

    token_usage: float
    queue: int


@dataclass(frozen=True, slots=True)
class ClimbAllowed:
    """The shell's answer to ``AskClimb``: another server takes the traffic meanwhile (behind
    the router), or the server is alone and the core's window holds."""

    fraction: float


@dataclass(frozen=True, slots=True)
class FleetShared:
    """These lessons are in the fleet's record now."""

    entries: tuple[FleetOom, ...]


Event = (
    Boot | Prepared | PrepareFailed | Launched | LaunchFailed | ProbeResult | FactsUpdated
    | Died | Diagnosed | TimerFired | GpuLost | StopRequested | HoldRequested | StartRequested | ConfigChanged
    | RestartRequested | GroupLaunch | GroupEnded | GroupGaveUp | FleetAdvice | FleetShared | GpuFree | KvPressure | KvSample
    | ClimbAllowed | HoldRequested | StartRequested
)


# --- actions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prepare:
    """Clear old servers off the GPUs, wait for memory, run preflight."""


@dataclass(frozen=True, slots=True)
class Launch:
    argv: tuple[str, ...]
    fraction: float | None  # None: the flag is left out and SGLang chooses
    hicache_size_gb: int
    attempt: int
    rung: int | None = None  # the fraction's place on the ladder (None: off it)


class StopMode(enum.StrEnum):
    """How a stop begins; every mode ends with the whole group killed after ``grace_s``."""

    DRAIN = "drain"  # SIGTERM to SGLang's main process only: it drains in-flight requests
    DUMP = "dump"  # SIGQUIT to the main process: a hung server dumps its stacks, then dies
    AWAIT = "await"  # the server is already dying on its own: only bound its teardown


@dataclass(frozen=True, slots=True)
class StopServer:
    grace_s: float  # how long the first step may take before the group is killed
    reason: str
    mode: StopMode = StopMode.DRAIN


@dataclass(frozen=True, slots=True)
class RouterAdd:
    """Register the server with the router (it is READY: our server answering on our port)."""


@dataclass(frozen=True, slots=True)
class RouterRemove:
    """Take the server out of the router now: it died (``at``: when that was noticed), or a
    stop is about to begin, which then waits for this removal (bounded by
    ``[router] remove_wait_s``) before it signals the server."""

    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class SetTimer:
    name: Timer
    delay_s: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    name: Timer


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand ``event`` to every sink (the daemon stamps its host and instance)."""

    event: ev.Event


@dataclass(frozen=True, slots=True)
class Probe:
    """Probe the server's health endpoint now and report a ``ProbeResult``; with
    ``read_kv``, read SGLang's ``/metrics`` too and report a ``KvSample``."""

    read_kv: bool = False


@dataclass(frozen=True, slots=True)
class Diagnose:
    """The server's main process died: once its tree is tidied, read its log if
    ``read_log`` (a crash, or a stop of ours whose log may tell more: a hang) with the
    phase it died in, and report a ``Diagnosed``. A planned stop reads nothing."""

    read_log: bool
    phase: Phase


@dataclass(frozen=True, slots=True)
class Persist:
    """Write the learned state (and the live server's pid) to the state directory."""


@dataclass(frozen=True, slots=True)
class Exit:
    code: int


@dataclass(frozen=True, slots=True)
class GroupReport:
    """[group]: tell the group how this node's rank of ``generation`` ended (etcd records
    the order; the leader picks the root cause among the reports)."""

    generation: int
    diagnosis: Diagnosis
    exit: str


@dataclass(frozen=True, slots=True)
class FleetShare:
    """Merge these lessons into the fleet's record (read, merge, compare-and-swap, retried
    until it works); a ``FleetShared`` follows once they are in. With them, the memory
    model of ``model_key`` (its points and the fraction a climb kept), when there is one."""

    entries: tuple[FleetOom, ...]
    model_key: str = ""
    points: tuple[MemoryPoint, ...] = ()
    kept: float | None = None


@dataclass(frozen=True, slots=True)
class AskClimb:
    """The core would climb to ``fraction`` now: the shell answers ``ClimbAllowed`` when no
    request would be lost (behind the router, only while another server serves)."""

    fraction: float


Action = (
    Prepare | Launch | StopServer | Diagnose | SetTimer | CancelTimer | Emit | Probe | Persist | Exit | RouterAdd | RouterRemove
    | GroupReport | FleetShare | AskClimb
)


@dataclass(frozen=True, slots=True)
class Ctx:
    """The inputs besides state and event: the time, the config, the jitter source."""

    now: float
    cfg: Config
    rng: random.Random
    wall_time: str = ""  # RFC 3339, only for the history shown to people
    local_minute: int | None = None  # minutes after local midnight ([policy] climb_window)
