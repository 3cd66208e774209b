"""SGLang's own scheduler watchdog (not NCCL's)."""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _Rule
from supervisor.core.model import Cause, Phase

RULES: tuple[_Rule, ...] = (
    # -- SGLang's own scheduler watchdog (not NCCL's, matched above)
    _Rule(
        "watchdog",
        Cause.WATCHDOG_HANG,
        ("(self.watchdog_timeout=", "scheduler watchdog timeout", "scheduler debug info:"),
        usual_phase=Phase.SERVING,  # it fires only with a batch in flight
        phase_in_text=True,
        source_text=(
            ("(self.watchdog_timeout=", ("({self.watchdog_timeout=}",)),
            ("scheduler watchdog timeout", ('f"{self.debug_name} watchdog timeout "', 'debug_name="Scheduler"')),
            ("scheduler debug info:", ('f"{self.debug_name} debug info:', 'debug_name="Scheduler"')),
        ),
        cites=(("(self.watchdog_timeout=", "sglang 0.5.23 srt/utils/watchdog.py:154-155"),
               ("scheduler watchdog timeout", "sglang 0.5.23 srt/utils/watchdog.py:154"),
               ("scheduler debug info:", "sglang 0.5.23 srt/utils/watchdog.py:150")),
    ),
)
