"""The children of ``distemb-launch``: started, watched, stopped by PID, and their output
relayed line by line with a ``[role rank]: `` prefix (:class:`Supervisor`).

Example:
    >>> sup = Supervisor()
    >>> p = sup.start([sys.executable, "-c", "pass"], {}, server=False, label="trainer0")
    >>> sup.watch(), p.returncode
    (0, 0)
"""
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time

from distemb.orphans import death_signal_setter

#: Seconds children get to stop after SIGTERM before they are killed.
STOP_GRACE_S = 5.0
#: Most bytes a relay reads from a child at once.
RELAY_CHUNK = 1 << 16
#: How long a relay waits for the rest of a line before it forwards its start.
PARTIAL_WAIT_S = 0.1
_LINE_ENDS = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)?")
_BARE_ENDS = (b"\n", b"\r", b"\r\n")


def _relay(stream, prefix, out, lock, lines):
    """Copy ``stream`` to ``out`` as the child writes it, with ``prefix`` at the start of
    every line.

    Whole lines go on as they arrive; the start of a line not yet ended goes on once the
    child has written nothing more for :data:`PARTIAL_WAIT_S` (a progress bar, which tqdm
    redraws after a carriage return, shows while the child runs; a line printed in
    several writes, as an unbuffered ``print`` does, stays whole). ``lines`` (shared by
    the relays of one ``out``, under ``lock``) says whose line is unfinished there:
    another child's output ends it first, and its owner's next bytes start a new prefixed
    line.
    """
    fd = stream.fileno()
    state = {"at_start": True}
    pending = b""
    while True:
        try:
            ready = select.select([fd], [], [], PARTIAL_WAIT_S if pending else None)[0]
            chunk = os.read(fd, RELAY_CHUNK) if ready else None
        except (OSError, ValueError):
            break
        if chunk == b"":
            break
        if chunk is None:  # quiet for a while: what there is of the line goes on
            _emit(pending, fd, prefix, out, lock, lines, state)
            pending = b""
            continue
        data = pending + chunk
        cut = data.rfind(b"\n") + 1
        if cut:
            _emit(data[:cut], fd, prefix, out, lock, lines, state)
        pending = data[cut:]
    if pending:
        _emit(pending, fd, prefix, out, lock, lines, state)
    stream.close()


def _emit(data, fd, prefix, out, lock, lines, state):
    """Write ``data`` of the child reading on ``fd`` to ``out`` (see :func:`_relay`)."""
    with lock:
        parts = []
        if lines.get("open") not in (None, fd):  # another child's line: end it
            parts.append(b"\n")
            lines.setdefault("cut", set()).add(lines["open"])
        if fd in lines.get("cut", ()):
            lines["cut"].discard(fd)
            state["at_start"] = True
        for piece in _LINE_ENDS.findall(data):
            if not piece:
                continue
            if state["at_start"] and piece not in _BARE_ENDS:  # no prefix for a bare end
                parts.append(prefix)
            parts.append(piece)
            state["at_start"] = piece.endswith((b"\n", b"\r"))
        lines["open"] = None if parts[-1].endswith(b"\n") else fd
        try:
            out.write(b"".join(parts))
            out.flush()
        except (OSError, ValueError):
            pass  # our own output is gone: keep draining so the child never blocks


class Supervisor:
    """Children of the launcher: started, watched, and stopped by PID.

    Children started with ``local=True`` die with the launcher: servers get SIGTERM (file
    tables flush), trainers SIGKILL (they hold nothing to clean up, and a user's SIGTERM
    handler must not keep them alive). Their output is relayed line by line
    as they write it, every line with a ``[role rank]: `` prefix, once
    :meth:`relay_output` starts the readers (after the last fork: a fork while other
    threads run is unsafe).
    """

    def __init__(self):
        self.servers, self.trainers = [], []
        self._labels, self._relays = [], []
        self._lock = threading.Lock()
        self._lines = {}  # per output: whose line is unfinished there (see _relay)

    def start(self, argv, env, server, label=None, local=True, ssh=False):
        sig = signal.SIGTERM if server else signal.SIGKILL
        # An ssh child gets a pipe for stdin that we never write: when we die (or it
        # does), its remote side reads end-of-file, and distemb.session_guard stops the
        # remote process.
        p = subprocess.Popen(argv, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             stdin=subprocess.PIPE if ssh else None,
                             preexec_fn=death_signal_setter(sig) if local else None)
        (self.servers if server else self.trainers).append(p)
        self._labels.append((p, label or ("server" if server else "trainer")))
        return p

    def relay_output(self):
        """Start relaying every child's stdout/stderr to ours, lines prefixed, without
        waiting for line ends."""
        for p, label in self._labels:
            prefix = f"[{label}]: ".encode()
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_relay, args=(
                    stream, prefix, out.buffer, self._lock,
                    self._lines.setdefault(id(out), {})), daemon=True)
                t.start()
                self._relays.append(t)

    def drain_output(self, timeout=2.0):
        """Wait (up to ``timeout`` s) for the last lines of exited children."""
        deadline = time.monotonic() + timeout
        for t in self._relays:
            t.join(max(0.0, deadline - time.monotonic()))

    def stop_all(self):
        alive = [p for p in self.servers + self.trainers if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def watch(self):
        """Wait for the trainers; stop everything when one fails. Returns the exit code."""
        while True:
            for p in self.servers + self.trainers:
                code = p.poll()
                if code not in (None, 0):
                    print(f"distemb-launch: pid {p.pid} ({shlex.join(p.args[:4])} ...) exited "
                          f"with {code}; stopping every process", file=sys.stderr, flush=True)
                    self.stop_all()
                    return code
            if all(p.poll() == 0 for p in self.trainers):
                break
            time.sleep(0.1)
        # Trainers that closed their context said goodbye and the servers are exiting;
        # servers of trainers that never did are stopped after a grace period.
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.servers):
            time.sleep(0.05)
        self.stop_all()
        return max([p.returncode or 0 for p in self.servers] + [0])
