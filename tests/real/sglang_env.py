"""Where the real SGLang server for the end-to-end tier lives (written by ``make real-sglang``).

``scripts/setup-real-sglang`` writes ``real-sglang.json`` into the cache root
(``$SGLANG_SUPERVISOR_CACHE``, default ``~/.cache/sglang-supervisor``); :func:`load` reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

JSON_NAME = "real-sglang.json"


class RealSGLangMissing(RuntimeError):
    """The real SGLang install is not set up here."""


def cache_root() -> Path:
    root = os.environ.get("SGLANG_SUPERVISOR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-supervisor")
    return Path(root)


@dataclass(frozen=True)
class RealSGLang:
    version: str
    python: str
    site_packages: str
    stub_dir: str
    model: str  # the tiny model in bf16, as real models ship: the reference every real test runs
    extra_args: tuple[str, ...]
    env: dict[str, str]
    model_fp32: str = ""  # the same model in float32 (no real test needs it now; kept for comparisons)

    def in_fp32(self) -> RealSGLang:
        """The same server with the float32 model."""
        from dataclasses import replace

        return replace(self, model=self.model_fp32)

    def command(self) -> list[str]:
        """The server's launcher; add ``--model-path``, ``--host``, ``--port`` and :attr:`extra_args`."""
        return [self.python, "-m", "sglang.launch_server"]

    def launch_args(self, port: int, host: str = "127.0.0.1", *more: str) -> list[str]:
        """The full command line for a CPU server of the tiny model on ``host:port``."""
        return [*self.command(), "--model-path", self.model, "--host", host, "--port", str(port), *self.extra_args, *more]

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the server's variables on top."""
        merged = dict(os.environ if base is None else base)
        merged.update(self.env)
        return merged


def load(path: str | os.PathLike[str] | None = None) -> RealSGLang:
    """Read ``real-sglang.json``; raises :class:`RealSGLangMissing` if it or what it names is absent."""
    p = Path(path) if path is not None else cache_root() / JSON_NAME
    hint = "run `make real-sglang` first"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise RealSGLangMissing(f"no real SGLang set up: {p} is missing; {hint}") from None
    except (OSError, ValueError) as e:
        raise RealSGLangMissing(f"cannot read {p} ({e}); {hint}") from None
    try:
        real = RealSGLang(
            version=str(data["version"]),
            python=str(data["python"]),
            site_packages=str(data["site_packages"]),
            stub_dir=str(data["stub_dir"]),
            model=str(data["model_bf16"]),
            extra_args=tuple(str(a) for a in data["extra_args"]),
            env={str(k): str(v) for k, v in data["env"].items()},
            model_fp32=str(data["model"]),
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise RealSGLangMissing(f"{p} is malformed ({e!r}); {hint}") from None
    for what in (real.python, real.stub_dir, real.model, real.model_fp32):
        if not os.path.exists(what):
            raise RealSGLangMissing(f"{p} names {what}, which does not exist; {hint}")
    return real
