"""How data/prepare.py ends when it is stopped: whole, its tokenizing workers with it, its unfinished build removed.
"""
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys


def die_with_parent():
    """From now on each process the main thread forks (datasets' workers, their manager) is killed when this one
    ends, however it ends (Linux's PR_SET_PDEATHSIG): killed with -9, its workers tokenized on for many seconds."""
    if sys.platform.startswith("linux"):
        import ctypes, threading  # noqa: E401
        prctl = ctypes.CDLL(None).prctl  # looked up here: a dlopen in a child forked beside running threads can hang
        forking = []  # before a fork: the parent's pid if its main thread forks (whose end the child's signal follows)

        def child():
            if forking[-1]:
                prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
                if os.getppid() != forking[-1]:  # the parent ended before that: no signal would come
                    os._exit(1)
        os.register_at_fork(before=lambda: forking.append(threading.current_thread() is threading.main_thread()
                                                          and os.getpid()), after_in_parent=forking.pop,
                            after_in_child=child)


@contextlib.contextmanager
def stopped_by_signals(build):
    """While the command runs, SIGTERM or SIGINT ends it whole: the tokenizing workers are killed (each works
    through a whole shard, GBs for minutes, and would run on alone), the unfinished build is removed, and the
    process exits with 128 + the signal's number. No unwinding through datasets' pools, which can hang on a
    killed worker. `build`: the folder the command builds in. The handler runs when the main thread next runs Python, which a BPE training or a
    one-process tokenizing batch can delay. A forked worker dies of the signal as if no handler were set."""
    import multiprocess  # datasets' pools, a fork of multiprocessing
    main_pid = os.getpid()
    die_with_parent()  # and of a SIGKILL, which no handler sees

    def stop(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for child in multiprocess.active_children() + multiprocessing.active_children():
            child.kill()
        shutil.rmtree(build, ignore_errors=True)
        # os.write: the main thread may be inside a write to stderr; "\n" ends a progress bar's line
        os.write(2, f"\nerror: stopped by {signal.Signals(signum).name}; the unfinished build was removed\n".encode())
        os._exit(128 + signum)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
