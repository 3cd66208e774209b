"""sglang-supervisor: owns an SGLang server, reads why it died, relaunches it the right way.

Layers, each importing only those below it (enforced by import-linter, ``pyproject.toml``):
``cli`` > ``daemon`` > ``preflight`` | ``release`` | ``routing`` > ``adapters`` | ``sinks`` > ``core``.
``sim`` (the simulator) is outside them: only ``cli/registry.py`` reaches it.
"""

__version__ = "0.1.0"
