"""The fleet key's SGLang version, read from the real SGLang venv's package metadata
(scripts/setup-real-sglang) without importing sglang."""

from __future__ import annotations

import time

from supervisor.adapters.versions import server_python, sglang_version
from tests.real.sglang_env import RealSGLang


def test_the_real_venv_reports_its_sglang_version_without_importing_it(real_sglang: RealSGLang) -> None:
    """The version setup-real-sglang installed, read through the server command's Python in
    well under the seconds an ``import sglang`` (torch) takes."""
    python = server_python(real_sglang.command())
    assert python == real_sglang.python
    started = time.monotonic()
    assert sglang_version(python) == real_sglang.version
    assert time.monotonic() - started < 10
