"""``python -m supervisor.cli``: the same as the ``sglang-supervisor`` script."""

import sys

from supervisor.cli import main

sys.exit(main())
