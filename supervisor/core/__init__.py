"""The pure core: every decision the supervisor makes, as functions of (state, event, now, config).

No I/O, no clock, no randomness of its own (the caller passes ``now`` and an ``rng``);
mypy ``--strict``. It imports nothing of ours outside ``supervisor.core`` and no I/O
library (import-linter contracts in ``pyproject.toml``). ``machine.step`` returns actions;
``supervisor.daemon`` carries them out.
"""
