"""process_guard.py in this process: the output streams a run writes through and gets back, the stop's signal arriving
again within its window, and a second run in the same process (compare.py, the tests) starting with no stop."""
import errno
import os
import signal
import sys
import time

import pytest

import process_guard


@pytest.fixture(autouse=True)
def fresh_guard():
    """The stop signals' handlers and the last stop's time put back after each test."""
    handlers = {sig: signal.getsignal(sig) for sig in process_guard.STOP_SIGNALS}
    yield
    process_guard._stopped_at[0] = None
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


class Failing:
    """A text stream whose writes fail with errno `code`, over a real file descriptor."""

    def __init__(self, code, fd):
        self.code, self.fd, self.written = code, fd, []

    def write(self, text):
        raise OSError(self.code, os.strerror(self.code))

    def flush(self):
        pass

    def fileno(self):
        return self.fd


def term_received():
    """A handler of SIGTERM that records each signal, installed now; returns what it received."""
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    return received


def send_term():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)


def test_a_gone_reader_silences_the_stream_but_another_write_error_is_raised(tmp_path):
    """A closed pipe (EPIPE) or a hung-up terminal (EIO) costs the run only its output; a full disk under a
    redirected log (ENOSPC) is no reader going away, and is not swallowed."""
    for code in process_guard.GONE:
        fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT)
        try:
            survivor = process_guard.Survivor(Failing(code, fd))
            assert survivor.write("lost") == 4
            os.write(fd, b"after")  # the descriptor now points at /dev/null
            assert (tmp_path / "log").read_bytes() == b""
        finally:
            os.close(fd)
    with open(tmp_path / "other", "w") as f:
        survivor = process_guard.Survivor(Failing(errno.ENOSPC, f.fileno()))
        with pytest.raises(OSError) as info:
            survivor.write("x")
        assert info.value.errno == errno.ENOSPC


def test_guarded_wraps_the_streams_for_the_run_and_gives_the_originals_back():
    out, err = sys.stdout, sys.stderr
    with process_guard.guarded():
        assert isinstance(sys.stdout, process_guard.Survivor) and sys.stdout.stream is out
        assert isinstance(sys.stderr, process_guard.Survivor) and sys.stderr.stream is err
    assert sys.stdout is out and sys.stderr is err


def test_the_same_stop_is_only_a_signal_within_its_window():
    assert not process_guard.same_stop()
    process_guard.stop_requested("")
    assert process_guard.same_stop()
    process_guard._stopped_at[0] = time.monotonic() - process_guard.SAME_STOP_SECONDS - 0.5
    assert not process_guard.same_stop()


def test_a_signal_outside_the_run_is_ignored_only_when_it_is_the_stop_arriving_again():
    """Before the run, or after it put its handlers back: the stop's signal sent again is ignored (the checkpoint
    is made, exit status 3 must not become a kill); any other signal reaches the handler it had before."""
    received = term_received()
    with process_guard.guarded():
        process_guard.stop_requested("")
        send_term()
        assert received == []
        process_guard._stopped_at[0] = None  # no stop: the signal is the process's as before
        send_term()
        assert received == [signal.SIGTERM]


def test_a_second_guarded_run_in_the_process_starts_with_no_stop():
    """compare.py runs train.main several times in one process: the last run's stop must not make the next run
    ignore a real stop signal as that stop arriving again, nor keep its handlers past its end."""
    before = signal.getsignal(signal.SIGTERM)
    process_guard.stop_requested("")  # an earlier run, stopped a moment ago
    with process_guard.guarded():
        assert not process_guard.same_stop()
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_stop_arriving_again_just_after_the_run_ends_is_still_ignored():
    """A run that stopped keeps the guard's handlers past its end while the stop's signal may still arrive again:
    the handler put back at once would hand that late copy to what ran before (a kill, for the default)."""
    received = term_received()
    with process_guard.guarded():
        process_guard.stop_requested("")
    send_term()
    assert received == []
