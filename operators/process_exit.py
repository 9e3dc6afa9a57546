"""The end of a job's process: its exit handlers run, its streams and logs are flushed, and the
interpreter's own teardown is skipped.

Arrow's native thread pools can abort the process while they are torn down at interpreter exit,
after every output was written and the summary printed (SIGABRT, "terminate called without an
active exception": apache/arrow#34314, #39862). A chain step that did all its work then reads as
failed. Exiting with ``os._exit`` once the exit handlers (Ray's shutdown among them) have run
skips that teardown and keeps the job's own exit code.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import sys


def exit_code(result) -> int:
    """A job's ``main`` result or ``SystemExit.code`` as ``sys.exit`` reads it: an int is the code,
    None is 0, a message is printed to stderr and is 1; a job's summary (a dict) is 0."""
    if result is None or isinstance(result, dict):
        return 0
    if isinstance(result, bool) or not isinstance(result, int):
        print(result, file=sys.stderr)
        return 1
    return result


def run(main) -> None:
    """Run a job's ``main()`` as the process and end it with :func:`finish` (a ``SystemExit`` from
    argument parsing or a refusal keeps its code; an exception's traceback still prints as usual)."""
    try:
        result = main()
    except SystemExit as exc:
        result = exc.code
    finish(exit_code(result))


def finish(code: int) -> None:
    """End the process with ``code`` after what a normal exit does that matters: unreferenced
    files closed, exit handlers run, logs and standard streams flushed."""
    gc.collect()                 # files left to the garbage collector are closed (and flushed)
    atexit._run_exitfuncs()      # Ray's shutdown, temporary servers' stops
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):    # a closed or broken pipe: nothing more can be written
            pass
    os._exit(code)
