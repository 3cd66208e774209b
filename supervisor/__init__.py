"""sglang-supervisor: owns an SGLang server, reads why it died, relaunches it the right way.

Layers, each importing only those below it (enforced by import-linter, ``pyproject.toml``):
``cli`` > ``daemon`` > ``preflight`` | ``release`` | ``routing`` > ``adapters`` | ``sinks`` > ``core``.
``sim`` (the simulator) is outside them: only ``cli/registry.py`` reaches it.
"""

__version__ = "0.1.0"

# The SGLang release the project is tested against (the real tier, scripts/setup-real-sglang):
# `preflight` warns about any other, and the [sglang] extra pins it (pyproject.toml;
# tests/test_preflight.py holds the pin and the setup script's default to this).
TESTED_SGLANG = "0.5.23"
