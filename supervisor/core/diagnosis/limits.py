"""How much of a log the diagnosis reads: the bounds that keep it fast whatever the input."""

from __future__ import annotations

MAX_TAIL_BYTES = 4 * 1024 * 1024  # how much of the end of the output is read
MAX_LINE_CHARS = 4096  # longer lines are read up to this many characters
MAX_LINES = 200_000  # lines read, the last ones of the tail
MAX_CANDIDATES = 2000  # candidate lines examined, the last ones of the tail
MAX_EVIDENCE_CHARS = 500  # each evidence line is cut to this length
KEPT_SERVING_BATCHES = 200  # batch lines after an error that prove the server outlived it
INTERNAL_ERROR_TYPE = "supervisor.core.diagnosis.InternalError"  # exc_type when diagnosis itself failed

_BACK_WINDOW = 150  # lines scanned up from the evidence for its traceback
_AFTER_WINDOW = 40  # lines scanned down from it for the rest of the failure report
_OTHER_SCAN_LINES = 5000  # lines scanned for an exception line when no rule matched
