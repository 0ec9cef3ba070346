"""No process of a job outlives it: the kernel's death signal, and a reaper for servers.

The launcher asks the kernel to send each child SIGTERM when the launcher dies
(:func:`death_signal_setter`), and a server stops on it within its grace. Both need the
server's Python to run: a server whose interpreter is stuck (a thread holding the GIL in a
blocking C call) would never act on either. :func:`start_reaper` forks, before the server
starts any thread or opens any socket, a small process that SIGKILLs the server once the
server's parent has been gone for longer than the grace plus a margin; it dies with the
server (its own death signal is SIGKILL).
"""
import ctypes
import os
import signal
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: How often the reaper looks at the server's parent.
POLL_S = 0.5


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux


def death_signal_setter(sig):
    """A preexec_fn asking the kernel to send ``sig`` to the child when we die.

    libc is loaded here, in the parent, so the child between fork and exec only makes one
    foreign call. The parent-pid check closes the race of a parent that died before the
    request took hold. None where prctl is unavailable (not Linux).
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def setter():
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
    return setter


def _parent_of(pid):
    """The parent pid of ``pid``; None once ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def start_reaper(after_s):
    """Fork the reaper of this process: it SIGKILLs us once our parent of now has been
    gone ``after_s`` seconds (we were reparented and still run). Call it before starting
    threads or opening descriptors the reaper should not hold; its stdio is /dev/null.

    Returns:
        the reaper's pid, or None where it cannot run (not Linux: no death signal to end
        it with us).
    """
    prctl = _prctl()
    if prctl is None:
        return None
    me, parent = os.getpid(), os.getppid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the reaper: no Python of the server runs here beyond this function
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # stop with the job's signals too
        orphaned_at = None
        while os.getppid() == me:  # the server runs (it is our parent)
            if _parent_of(me) not in (parent, None):
                orphaned_at = orphaned_at or time.monotonic()
                if time.monotonic() - orphaned_at >= after_s:
                    os.kill(me, signal.SIGKILL)
                    break
            time.sleep(POLL_S)
    finally:
        os._exit(0)
