"""The launch command line: SGLang's flags, spelled as its ``launch_server`` parser knows them."""

from __future__ import annotations

from supervisor.core.config import Config

# --- the launch command line --------------------------------------------------------------

SECRET_FLAGS = ("--api-key", "--admin-api-key", "--hf-token", "--token", "--password")


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """argv with the values of secret-bearing flags replaced by ``***`` (the log and the
    journal keep the launch command this way)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            out.append(f"{flag}=***" if eq else arg)
            hide_next = not eq
            continue
        out.append(arg)
    return out



def build_argv(cfg: Config, fraction: float | None, hicache_size_gb: int) -> tuple[str, ...]:
    """The exact argv: flags spelled as SGLang's ``launch_server`` parser knows them. A
    ``fraction`` of None leaves ``--mem-fraction-static`` out: SGLang chooses it."""
    s = cfg.server
    argv = [
        *s.command,
        "--model-path", s.model_path,
        "--host", s.host,
        "--port", str(s.port),
        "--tp-size", str(s.tp_size),
    ]
    if s.dp_size != 1:
        argv += ["--dp-size", str(s.dp_size)]
    if fraction is not None:
        argv += ["--mem-fraction-static", f"{fraction:g}"]
    if hicache_size_gb > 0:
        argv += ["--enable-hierarchical-cache", "--hicache-size", str(hicache_size_gb)]
    g = cfg.group
    if g.enabled:
        argv += ["--nnodes", str(g.nnodes), "--node-rank", str(g.node_rank), "--dist-init-addr", g.dist_init_addr]
    argv += list(s.extra_args)
    return tuple(argv)
