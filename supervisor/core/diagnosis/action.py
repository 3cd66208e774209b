"""What happens next: the sentence that says what the supervisor does about a crash."""

from __future__ import annotations

from supervisor.core.model import Cause, Diagnosis, Remedy


def describe_action(d: Diagnosis, *, fraction: float | None = None) -> str:
    """One sentence: what the supervisor does about this crash, and why."""
    now = f" from {fraction:.2f}" if fraction is not None else ""
    remedy, cause = d.remedy, d.cause
    if remedy is Remedy.FRACTION_DOWN:
        return (
            f"Lower --mem-fraction-static{now} to the next rung down and restart, because {cause.summary} "
            "means activations or CUDA graphs did not fit outside the static pool."
        )
    if remedy is Remedy.FRACTION_UP:
        return (
            f"Raise --mem-fraction-static{now} one rung (never to a fraction that ran out of memory while "
            f"serving) and restart, because {cause.summary} means the KV pool did not fit after the weights; "
            "lowering it would make this worse."
        )
    if remedy is Remedy.HICACHE_DOWN:
        return f"Halve --hicache-size and restart, because {cause.summary} killed or refused the server."
    if remedy is Remedy.CLEAR_GPU:
        if cause is Cause.PORT_IN_USE:
            return "Kill whatever holds the port, then restart, because the server could not bind it."
        return (
            f"Kill whatever still holds the GPU (orphaned schedulers, other processes) and restart with the "
            f"same fraction{now}, because the weights or KV pool did not fit; a lower fraction would not help."
        )
    if remedy is Remedy.GIVE_UP:
        return f"Give up and alert a human, because {cause.summary} is not something a restart can fix."
    if not d.certain and remedy is Remedy.RESTART:
        read = f"read as {cause}" + (f", runner-up {d.runner_up}" if d.runner_up else "")
        return (f"Unsure of the cause ({read}): restart with backoff, because only a certain reading may stop "
                "the night; it gives up if it repeats.")
    if cause is Cause.KV_POOL_TOO_SMALL:
        return (
            "Restart with backoff, keeping the fraction, because the KV/request pool ran out under load; "
            "lowering the fraction would make it worse (consider a lower --max-running-requests)."
        )
    return f"Restart with backoff, because {cause.summary} is often transient; give up if it keeps happening."
