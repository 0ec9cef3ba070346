"""RWLock: many readers or one writer, writers first.

The lock of every shard (:class:`~distemb.kvstore.server.shard.ShardTable`): pulls hold it
shared, so they run in parallel; pushes and updates hold it exclusive; a writer waiting
keeps new readers out, so updates never starve behind a stream of pulls.

Every pull and update of a step takes it, mostly uncontended: taking and releasing it
costs two acquisitions of one plain lock, and a release wakes sleepers only when there
are some (``read()`` and ``write()`` hand out one reusable context manager each, not a
generator per call).

Example:
    >>> lock = RWLock()
    >>> with lock.read(), lock.read():  # readers share it
    ...     pass
    >>> with lock.write():
    ...     pass
"""
import threading


class RWLock:
    """Many readers or one writer; waiting writers go first (updates never starve)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._readers, self._writer, self._waiting = 0, False, 0
        self._sleeping = 0  # threads in wait(): only then does a release notify
        self._read = _Read(self)
        self._write = _Write(self)

    def read(self):
        """Context manager: hold the lock shared."""
        return self._read

    def write(self):
        """Context manager: hold the lock exclusive."""
        return self._write

    def _sleep(self):
        self._sleeping += 1
        try:
            self._cond.wait()
        finally:
            self._sleeping -= 1

    def acquire_read(self):
        with self._lock:
            while self._writer or self._waiting:
                self._sleep()
            self._readers += 1

    def release_read(self):
        with self._lock:
            self._readers -= 1
            if not self._readers and self._sleeping:
                self._cond.notify_all()

    def acquire_write(self):
        with self._lock:
            self._waiting += 1
            while self._writer or self._readers:
                self._sleep()
            self._waiting -= 1
            self._writer = True

    def release_write(self):
        with self._lock:
            self._writer = False
            if self._sleeping:
                self._cond.notify_all()


class _Read:
    __slots__ = ("_rw",)

    def __init__(self, rw):
        self._rw = rw

    def __enter__(self):
        self._rw.acquire_read()

    def __exit__(self, *exc):
        self._rw.release_read()


class _Write:
    __slots__ = ("_rw",)

    def __init__(self, rw):
        self._rw = rw

    def __enter__(self):
        self._rw.acquire_write()

    def __exit__(self, *exc):
        self._rw.release_write()
