"""What train.py's process survives without losing its updates: the reader of its output going away (`| head`
having read enough, a `tee` killed, an ssh connection dropped: a closed pipe, a hung-up terminal), and its stop's
signal arriving again once the run has stopped (a scheduler's SIGTERM sent twice). train.main runs in guarded()."""
import atexit
import contextlib
import errno
import os
import signal
import sys
import time

GONE = (errno.EPIPE, errno.EIO)  # the reader closed its end of the pipe; the terminal hung up
STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s)  # a scheduler's time limit, Ctrl-C, a closed terminal
SAME_STOP_SECONDS = 2.0  # a scheduler may signal the process and its parent passes the signal on too
_stopped_at = [None]  # when the last stop was requested in this process (stop_requested)


def install(handler):
    """`handler` for each stop signal, but a SIGHUP that the process ignores (nohup's stays ignored; SIGTERM and
    SIGINT stop a run as they always did); returns the handlers it replaced."""
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS
            if sig != getattr(signal, "SIGHUP", None) or signal.getsignal(sig) is not signal.SIG_IGN}


def silence(fd):
    """Point fd at /dev/null: whatever is written to it from now on goes nowhere, without an error."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def stop_requested(message):
    """A signal handler's announcement of a stop: notes its time (same_stop) and writes `message` to stderr with
    os.write (a print in a handler can reenter the print the signal interrupted), into nothing when stderr's
    reader has gone."""
    _stopped_at[0] = time.monotonic()
    try:
        os.write(2, message.encode())
    except OSError as exc:
        if exc.errno not in GONE:
            raise
        silence(2)


def same_stop():
    """Whether a stop signal now is the last stop's arriving again (within SAME_STOP_SECONDS of it)."""
    return _stopped_at[0] is not None and time.monotonic() - _stopped_at[0] < SAME_STOP_SECONDS


@atexit.register
def _ignore_the_stop_arriving_again():
    """As the process ends, the stop's signal arriving again is ignored (same_stop) also where no handler of
    Python's runs any more: Python puts the default handlers back before it tears down its modules, which for
    torch's takes a second or more, and the default would kill a process that has checkpointed its stop."""
    if same_stop():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


class Survivor:
    """A text stream whose reader may go away: once a write or a flush finds it gone (EPIPE, EIO), its file
    descriptor is pointed at /dev/null, and that write and every later one (print's, tqdm's, a warning's) goes
    nowhere while the run carries on."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as exc:
            self._gone(exc)
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self.stream.flush()
        except OSError as exc:
            self._gone(exc)

    def _gone(self, exc):
        if exc.errno not in GONE:
            raise exc
        silence(self.stream.fileno())
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()  # what the stream still holds goes to /dev/null too


@contextlib.contextmanager
def guarded():
    """stdout and stderr as Survivors; and a stop signal that comes outside a run's StopRequest (before the run,
    or once it has put the handlers back on its way out) ignored when it is the stop's arriving again (same_stop):
    the run has its checkpoint, and the status 3 that says so is not lost to a kill. Any other signal does what it
    did before (ends the process, or raises KeyboardInterrupt). All is put back at the end, the streams flushed,
    except that the signal handlers stay while the stop's signal may still arrive again: the process is ending
    (and _ignore_the_stop_arriving_again covers its very end)."""
    _stopped_at[0] = None
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Survivor(sys.stdout), Survivor(sys.stderr)

    def outside_the_run(signum, frame):
        if same_stop():
            return
        handler = previous[signum] or signal.SIG_DFL  # None: not set from Python, the default
        signal.signal(signum, handler)
        if callable(handler):
            return handler(signum, frame)
        os.kill(os.getpid(), signum)  # as the signal ended the process before
    previous = install(outside_the_run)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        if not same_stop():
            for sig, handler in previous.items():
                signal.signal(sig, handler or signal.SIG_DFL)
