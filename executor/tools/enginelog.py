"""Keep the Mooncake engine's own log lines off stderr under `--quiet`.

The engine logs with glog from its C++ threads straight to file descriptor 2
(`E1130 04:24:56.011078 11536 tcp_transport_session_impl.h:678] ...` when a
peer goes away), and its `MC_LOG_LEVEL` stops at ERROR, so no setting silences
those. Under `--quiet` fd 2 is routed through a pipe for the run and every
line in glog's format is dropped; everything else (our own errors, Python's)
passes through unchanged. Receiver processes started meanwhile inherit the
pipe, so their engine lines are dropped too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

GLOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] ")


@contextlib.contextmanager
def engine_log_filtered(enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if not GLOG_LINE.match(line):
                    os.write(saved, line)

    thread = threading.Thread(target=pump, name="engine-log-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # our end of the pipe closes; the pump ends once children have let go too
        thread.join(timeout=2.0)
        if not thread.is_alive():
            os.close(saved)
