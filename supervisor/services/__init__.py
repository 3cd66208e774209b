"""The services between the daemon and the adapters: what the shell does over the ports
besides carrying out the core's actions, one module each (checks before a launch, waiting for
GPU memory, the router's view, a group's etcd records and its leader's writes, the fleet's
record, the daily summary, the rolling restart). They see the core, the ports and ``aio``;
never the daemon, a unit or each other's insides. A concrete adapter or a sink's reader is
handed in by the composition root (``preflight.HostPreflight(cleanup)``, ``daily.Readers``);
import-linter holds this (``pyproject.toml``: "services reach adapters only through the
ports, and no sink")."""
