"""The stamping exec trampoline: ``python -I -S bench/stamp_exec.py STAMPFILE -- ARGV...``.

Appends ``time.monotonic_ns()`` as one line to STAMPFILE, then replaces itself with ARGV
(``os.execv``: same pid, same fds, same session), so the stamp marks the moment the server
is exec'd. Both supervisors run the server behind it, so both are measured the same way.
Standard library only, run without ``site``: its own start costs a few milliseconds.
"""

import os
import sys
import time


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: stamp_exec.py STAMPFILE -- ARGV...")
    fd = os.open(argv[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"%d\n" % time.monotonic_ns())
    os.close(fd)
    os.execv(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
