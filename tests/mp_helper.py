"""The one multi-process test helper: spawn, free ports, a timeout, every exit code checked.

Processes get this checkout on PYTHONPATH and one thread each (2-core machines). The
helper only ever signals the PIDs it started.

Example:
    >>> with ProcessGroup() as group:
    ...     p = group.spawn([sys.executable, "-c", "print(1)"])
    ...     group.wait_all(timeout=30)
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

from distemb.transport import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker_slice(lo, hi):
    """[lo, hi) cut into one slice per pytest-xdist worker: this worker's (all of it
    outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return lo, hi
    size = (hi - lo) // count
    k = int(worker[2:]) % count
    return lo + k * size, lo + (k + 1) * size


def free_port(span=8):
    """A TCP port on 127.0.0.1 nobody listens on, with the ``span - 1`` ports after it
    free too, below the ephemeral range (see :mod:`distemb.transport.ports`).

    Under pytest-xdist each worker draws from its own slice of that range, so two tests
    running at once never try the same port.
    """
    return ports.free_port(span, *_worker_slice(ports.FIRST, ports.ephemeral_low()))


def child_env(**extra):
    """Environment of a spawned process: this checkout first, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cluster_dict(num_servers, num_trainers=1, **fields):
    """A cluster config (plain data) with servers on fresh 127.0.0.1 ports."""
    raw = {"job_id": uuid.uuid4().hex[:8], "job_token": uuid.uuid4().hex,
           "num_trainers": num_trainers,
           "trainer_machines": [0] * num_trainers,
           "servers": [{"host": "127.0.0.1", "port": free_port(), "machine": 0}
                       for _ in range(num_servers)]}
    raw.update(fields)
    return raw


def memory_files(pid, job):
    """Names of the memory files (sealed memfd segments) of job ``job`` that process
    ``pid`` holds, by a descriptor or a mapping; empty once the process is gone."""
    tag, names = f"/memfd:distemb-{job}-", set()
    try:
        for n in os.listdir(f"/proc/{pid}/fd"):
            try:
                names.add(os.readlink(f"/proc/{pid}/fd/{n}"))
            except OSError:
                pass  # closed meanwhile (or the listing's own descriptor)
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            names.update(line.split(None, 5)[-1].strip() for line in f)
    except (FileNotFoundError, ProcessLookupError):
        return []
    return sorted(n.split(" (deleted)")[0][len("/memfd:"):] for n in names
                  if n.startswith(tag))


def shm_files(job):
    """Files of job ``job`` in /dev/shm (distemb makes none: its segments are memfds)."""
    return sorted(n for n in os.listdir("/dev/shm") if job in n)


def write_json(path, raw):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    return str(path)


class ProcessGroup:
    """Processes started by one test; on exit every one still running is killed.

    ``wait_all`` asserts each exit code (0 unless ``expect`` says otherwise).
    """

    def __init__(self):
        self.procs = []

    def spawn(self, args, env=None, expect=0, cwd=ROOT, session=False, **kw):
        """Start ``args``; ``expect`` is the exit code wait_all asserts (None: any).

        ``session=True``: the process leads a new session, and kill_all signals its whole
        process group (the group id is its saved PID): for a process that starts children
        of its own that this helper cannot know (DGL's tests, its launcher).
        """
        p = subprocess.Popen(args, env=env or child_env(), cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=session,
                             **kw)
        p.expect, p.session = expect, session
        self.procs.append(p)
        return p

    def spawn_servers(self, config_path, num_servers, wait=60.0):
        """Start the servers of ``config_path`` and wait (up to ``wait`` s) until each
        accepts connections, so a short ``timeout_s`` under test measures failures, not
        the start-up of Python on a busy machine."""
        procs = [self.spawn([sys.executable, "-m", "distemb.server", "--config", config_path,
                             "--server-id", str(i)]) for i in range(num_servers)]
        with open(config_path, encoding="utf-8") as f:
            entries = json.load(f)["servers"][:num_servers]
        self.wait_listening([(e["host"], e["port"]) for e in entries], wait)
        return procs

    def wait_listening(self, addresses, timeout=60.0):
        """Wait until every (host, port) accepts a connection, or fail naming the first.

        Starting a server (Python, numpy, the kernels) takes seconds on a loaded machine:
        tests whose point is a short client timeout wait for readiness first.
        """
        deadline = time.monotonic() + timeout
        for host, port in addresses:
            while True:
                try:
                    socket.create_connection((host, port), timeout=1.0).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{host}:{port} not listening within {timeout} s")
                    if any(p.poll() is not None for p in self.procs):
                        raise AssertionError(f"a server exited before {host}:{port} listened")
                    time.sleep(0.05)

    def wait_all(self, timeout):
        """Wait for every process; assert its exit code. Returns {pid: output}."""
        deadline = time.monotonic() + timeout
        outputs = {}
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                out, _ = p.communicate()
                raise AssertionError(f"pid {p.pid} {p.args} did not exit within {timeout} s; "
                                     f"output:\n{out}") from None
            outputs[p.pid] = out
            if p.expect is not None:
                assert p.returncode == p.expect, (
                    f"pid {p.pid} {p.args} exited {p.returncode}, expected {p.expect}; "
                    f"output:\n{out}")
        return outputs

    def kill_all(self):
        """SIGTERM (so a launcher can stop its own children), then SIGKILL after 5 s."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.terminate()
        for p in alive:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.procs:  # what a session leader left: its group, by the saved PID
            if getattr(p, "session", False):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill_all()
        for p in self.procs:
            if p.stdout:
                p.stdout.close()
