"""``python -m distemb.session_guard CMD...``: run CMD until it exits or stdin closes.

With ``--launcher ssh`` every remote process runs under this guard, whose stdin is its
ssh session's: the launcher keeps a pipe to each ``ssh`` open and never writes it, so
when the launcher dies (even by SIGKILL), or ssh or its connection does, the remote
side reads end-of-file. The guard then stops CMD's whole process group (SIGTERM, and
SIGKILL after :data:`GRACE_S` s), so nothing of the job stays on the remote machine
(its shared memory is memory files, freed with the last process that maps them). SIGTERM, SIGINT and SIGHUP to the guard are passed on to CMD; CMD's
own stdin is /dev/null; the guard exits with CMD's exit code (128 + N after signal N).

Example::

    ssh host 'cd /job && python -m distemb.session_guard python train.py'
"""
import os
import signal
import subprocess
import sys
import threading

GRACE_S = 5.0


def _stop(child, sig):
    try:
        os.killpg(child.pid, sig)  # CMD leads its own group: its children go too
    except ProcessLookupError:
        pass


def _watch_stdin(child):
    """Stop ``child`` once stdin reads end-of-file (the session that started us ended)."""
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    _stop(child, signal.SIGTERM)
    try:
        child.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        _stop(child, signal.SIGKILL)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m distemb.session_guard CMD...", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: _stop(child, signum))
    threading.Thread(target=_watch_stdin, args=(child,), daemon=True).start()
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
