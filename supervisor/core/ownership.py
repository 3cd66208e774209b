"""What makes a server provably ours, and the environment it is launched with (pure).

Every server the daemon launches carries ``MARK_VAR`` (this daemon's instance id) and
``LAUNCH_VAR`` (a nonce per launch) in its environment; the state file records its process
group, launch time and tree. The cleanup adapter reads these back to tell our leftovers
from another user's server (``supervisor.adapters.cleanup``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

MARK_VAR = "SGLANG_SUPERVISOR_INSTANCE"
LAUNCH_VAR = "SGLANG_SUPERVISOR_LAUNCH"


def recorded_server(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a state file records of the last server launched, as ``find_stale``'s keyword
    arguments: its process group, launch time and tree, the boot it ran in and its tree's
    starts in that boot (pure; malformed values are dropped)."""
    pgid, since, tree = state.get("server_pgid"), state.get("server_since"), state.get("server_tree")
    boot, started = state.get("server_boot"), state.get("server_tree_started")
    return {
        "recorded_pgid": pgid if isinstance(pgid, int) and not isinstance(pgid, bool) else None,
        "recorded_since": float(since) if isinstance(since, int | float) else None,
        "recorded_tree": [
            (int(t[0]), float(t[1])) for t in (tree if isinstance(tree, list) else [])
            if isinstance(t, list) and len(t) == 2 and all(isinstance(x, int | float) for x in t)
        ],
        "recorded_boot": boot if isinstance(boot, str) and boot else None,
        "recorded_started": [
            (t[0], t[1]) for t in (started if isinstance(started, list) else [])
            if isinstance(t, list) and len(t) == 2 and all(type(x) is int for x in t)
        ],
    }


def gpu_env(indices: Sequence[int]) -> dict[str, str]:
    """The server's GPUs as CUDA sees them: ``[gpu] indices`` (NVML's, in PCI bus order)
    as ``CUDA_VISIBLE_DEVICES``, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA counts
    the cards in the same order NVML does (its default, fastest first, may not). Empty
    without indices: the server sees what the daemon's environment passes on."""
    if not indices:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in indices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def server_env(
    pass_env: Sequence[str], extra: Mapping[str, str], environ: Mapping[str, str],
    mark: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Only the variables the config names: ``pass_env`` (names or shell patterns such as
    ``NCCL_*``) from our environment, plus ``env``, plus ``mark`` (our ownership mark), which
    nothing overrides."""
    patterns = [p for p in pass_env if any(c in p for c in "*?[")]
    env = {k: environ[k] for k in pass_env if k in environ}
    for name, value in environ.items():
        if name not in env and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            env[name] = value
    env.update(extra)
    env.update(mark or {})
    return env
