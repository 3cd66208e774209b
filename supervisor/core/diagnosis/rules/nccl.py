"""NCCL / distributed communication, and its echoes: what the other ranks see after one
rank died."""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _ci, _Rule
from supervisor.core.model import Cause

ERRORS: tuple[_Rule, ...] = (
    # -- NCCL / distributed communication
    _Rule(
        "nccl",
        Cause.NCCL_ERROR,
        (
            "nccl error", "ncclinternalerror", "ncclsystemerror", "ncclunhandledcudaerror",
            "ncclremoteerror", "ncclinvalidusage", "distbackenderror", "distnetworkerror", "nccl communicator",
        ),
        origin="nccl",
        origins=(("distbackenderror", "torch"), ("distnetworkerror", "torch"), ("nccl error", "torch")),
        cites=(
            ("nccl error", "sglang 0.5.23 srt/distributed/device_communicators/pynccl_wrapper.py:474: 'NCCL error: <*>'"),
            ("ncclinternalerror", "nccl.h ncclInternalError"), ("ncclsystemerror", "nccl.h ncclSystemError"),
            ("ncclunhandledcudaerror", "nccl.h ncclUnhandledCudaError"), ("ncclremoteerror", "nccl.h ncclRemoteError"),
            ("ncclinvalidusage", "nccl.h ncclInvalidUsage"),
            ("distbackenderror", "torch/distributed: DistBackendError"),
            ("distnetworkerror", "torch/distributed: DistNetworkError"),
            ("nccl communicator", "torch ProcessGroupNCCL: 'NCCL communicator was aborted'"),
        ),
    ),
)

ECHOES: tuple[_Rule, ...] = (
    # -- echoes: a collective that timed out or a peer that vanished is what the other ranks
    # see after one rank died; the cause is that rank's failure when the log has it
    _Rule(
        "nccl_watchdog",
        Cause.NCCL_ERROR,
        ("collective operation timeout", "process group watchdog"),
        strength="echo",
        origin="torch",
        cites=(("collective operation timeout", "torch ProcessGroupNCCL.cpp: 'Watchdog caught collective operation timeout'"),
               ("process group watchdog", "torch ProcessGroupNCCL.cpp: 'Process group watchdog thread terminated with exception'")),
    ),
    _Rule(  # torch's NCCL watchdog; its warnings ("using GPU 0 to perform barrier") do not count
        "nccl_timeout",
        Cause.NCCL_ERROR,
        ("processgroupnccl",),
        pattern=_ci(
            r"checktimeout|detected by watchdog|failed or timed out|taking the entire process down|was aborted"
        ),
        strength="echo",
        origin="torch",
        cites=(("processgroupnccl", "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"),),
    ),
    # gloo failures (its transport or mesh setup), not "[Gloo] Rank 0 is connected to 7 peer ranks"
    _Rule("gloo", Cause.NCCL_ERROR, ("gloo/transport/", "connectfullmesh failed", "connection closed by peer",
                                     "connection reset by peer"),
          strength="echo", origin="gloo",
          origins=(("connection reset by peer", "kernel"),),
          cites=(("gloo/transport/", "gloo/transport/tcp/pair.cc: '[.../gloo/transport/tcp/pair.cc:534] Connection closed by peer'"),
                 ("connectfullmesh failed", "gloo/rendezvous/context.cc: 'connectFullMesh failed'"),
                 ("connection closed by peer", "gloo/transport/tcp/pair.cc: 'Connection closed by peer'"),
                 ("connection reset by peer", "glibc strerror(ECONNRESET): 'Connection reset by peer'"))),
)
