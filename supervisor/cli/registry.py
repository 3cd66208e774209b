"""The one door from the product to the simulator (``supervisor.sim``).

Core, adapters, sinks, preflight and the daemon never import ``supervisor.sim``, and no
other CLI module does (import-linter, ``pyproject.toml``). Two things come through here:

- the ``simulated`` GPU backend, for ``adapters.gpu.make_probe``;
- the ``demo`` command.

The simulator's own process (``python -m supervisor.sim.simulator``) needs the ``[sim]``
extra (``setproctitle``, for SGLang's process titles, and ``aiohttp``, its HTTP server and the
demo's load; the daemon speaks HTTP by h11); without it the demo says so in one
line instead of watching a simulator die at import.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.adapters import gpu
from supervisor.adapters.ports import GpuProbe
from supervisor.core.config import GpuConfig

SIM_EXTRA_HINT = "pip install 'sglang-supervisor[sim]' (make demo does)"


def _simulated(cfg: GpuConfig) -> GpuProbe:
    from supervisor.sim.gpuprobe import SimulatedProbe

    return SimulatedProbe(cfg.sim_dir, cfg.indices, cfg.call_timeout_s)


def gpu_backends() -> Mapping[str, gpu.ProbeFactory]:
    """The GPU backends besides ``nvml`` and ``none``."""
    return {"simulated": _simulated}


def make_probe(cfg: GpuConfig) -> GpuProbe:
    """The configured GPU probe, with every backend this install has."""
    return gpu.make_probe(cfg, gpu_backends())


def sim_missing() -> str | None:
    """Why the simulator cannot run here (one line), or None."""
    missing = [name for name in ("setproctitle", "aiohttp") if importlib.util.find_spec(name) is None]
    if missing:
        return f"the demo runs the simulator, which needs the [sim] extra ({', '.join(missing)}): {SIM_EXTRA_HINT}"
    return None


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from supervisor.sim import demo

    demo.add_arguments(p)


def run_demo(
    args: argparse.Namespace, run_daemon: Callable[..., Any], write_report: Callable[..., Any] | None = None,
) -> int:
    """The demo's night, its daemon run by ``run_daemon`` (``cli.run.run_daemon_async``, handed
    in by ``cli/demo.py``: the registry never imports the composition root, which imports it)."""
    from supervisor.sim import demo

    return demo.run(args, run_daemon, write_report)
