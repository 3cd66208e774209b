"""The I/O shell's adapters: processes, HTTP probes, GPUs, the state directory, systemd.

Each adapter satisfies a ``Protocol`` in ``adapters/ports.py`` and takes its value types
and errors from there; adapters import no other adapter but the shared few (ports, http,
output, procstart). The daemon sees only the ports;
``supervisor/cli/run.py`` builds the real adapters, tests build fakes.
"""
