"""RWLock: many readers or one writer, writers first.

The lock of every shard (:class:`~distemb.kvstore.server.shard.ShardTable`): pulls hold it
shared, so they run in parallel; pushes and updates hold it exclusive; a writer waiting
keeps new readers out, so updates never starve behind a stream of pulls.

Example:
    >>> lock = RWLock()
    >>> with lock.read(), lock.read():  # readers share it
    ...     pass
    >>> with lock.write():
    ...     pass
"""
import threading
from contextlib import contextmanager


class RWLock:
    """Many readers or one writer; waiting writers go first (updates never starve)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers, self._writer, self._waiting = 0, False, 0

    @contextmanager
    def read(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
