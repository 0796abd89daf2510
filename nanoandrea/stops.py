"""How a command stops: SIGTERM (`kill`, a job scheduler's stop) as Ctrl-C.

A command runs inside sigterm_raises(): SIGTERM then raises Terminated, a KeyboardInterrupt,
in the main thread, so the command unwinds as it does on Ctrl-C (its finally blocks run, its
temporary files go, its workers stop) and ends in one line that says which it was, where
SIGTERM's default would end the process on the spot.
"""
import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (`kill`, a job scheduler's stop): a KeyboardInterrupt, so that what
    stops cleanly on Ctrl-C stops so on SIGTERM too, whose text says which it was."""

    def __init__(self):
        super().__init__("terminated (SIGTERM)")


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Terminated in the main thread, so the command unwinds as Ctrl-C does:
    its finally blocks run (prepare's temporary folder is deleted, its workers stopped) and it
    ends in one line, where SIGTERM's default would end the process on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield                                       # (only the main thread has signals)
        return

    def terminated(signum, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
