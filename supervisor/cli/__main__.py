"""``python -m supervisor.cli``: the same as the ``sglang-supervisor`` script."""

import contextlib
import sys

from supervisor.cli import main

with contextlib.suppress(BrokenPipeError):
    sys.exit(main())
