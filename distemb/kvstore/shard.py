"""ShardTable: one shard of one table, a RowStore and everything that guards it.

Every shard a process holds is one ShardTable, whatever its store: a dense array (or
several, its optimizer state as columns beside the weight), a hash table, a file. The
store says where the rows are; the ShardTable owns what the server needs around them:

- a reader/writer lock: pulls hold it shared, pushes and updates exclusive, so a pull
  never sees a row between an update's read and its write, and pulls run in parallel;
- seqlock counters: readers outside the process (trainers mapping a column from
  /dev/shm, see :mod:`distemb.transport.shm`) cannot take the lock, so each write makes
  the counters of the mapped columns odd while it runs;
- a per-row version (write counter), made on first use: what trainer caches validate
  their copies against. A fixed key set keeps it in an array beside the store (its slots
  never move); a store that inserts and evicts keeps it as a hidden column, so a row's
  version is evicted with the row and a re-inserted key starts again from the table's
  first version.

Concurrency: one writer per row (DESIGN.md). Stores that insert on read (a hash store's
lookup may grow its arrays or evict) take the write lock for lookups too.

Example:
    >>> import numpy as np
    >>> from distemb.stores import HashStore
    >>> t = ShardTable(HashStore(2))
    >>> with t.write():
    ...     t.store.scatter(np.array([2**40]), np.ones((1, 2), np.float32))
    ...     t.bump(t.store.slots(np.array([2**40])))
    >>> t.versions(np.array([2**40]), first=0).tolist()
    [1]
"""
import threading
from contextlib import contextmanager

import numpy as np

#: Hidden column of a store that inserts and evicts: each row's write counter.
VERSION = "~version"
#: Distance between the first versions of two version arrays of one holder, so a table
#: dropped and made again never repeats a version a trainer's cache holds.
VERSION_EPOCH = 1 << 40


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


class ShardTable:
    """One shard: ``store`` (a :class:`~distemb.stores.types.RowStore`), its lock, seqlock
    counters and row versions; see the module docstring.

    Args:
        store: the shard's rows and optimizer-state columns.

    Example:
        >>> from distemb.stores import DenseStore
        >>> t = ShardTable(DenseStore(4, 2))
        >>> with t.read():
        ...     t.store.gather(np.array([3])).shape
        (1, 2)
    """

    def __init__(self, store):
        self.store = store
        self.lock = RWLock()
        self._counters = {}  # column -> 1-element int64 array (seqlock of a mapped column)
        self._fixed_versions = None  # versions of a fixed key set, indexed by slot
        self._tracked = False

    @property
    def inserts_on_read(self):
        """Whether a lookup may insert keys (and so must hold the write lock)."""
        return not self.store.fixed_keys

    def read(self):
        """Context manager: the shared lock (reads of rows that cannot move)."""
        return self.lock.read()

    @contextmanager
    def write(self):
        """Context manager: the exclusive lock, with every seqlock counter odd meanwhile."""
        with self.lock.write():
            counters = list(self._counters.values())
            for v in counters:
                v[0] += 1  # odd: a write is under way
            try:
                yield
            finally:
                for v in counters:
                    v[0] += 1  # even again: the rows are consistent

    def set_counter(self, column, counter):
        """Make ``counter`` (a 1-element int64 array) the seqlock counter of ``column``
        (None forgets it): :meth:`write` makes it odd while it writes."""
        with self.lock.write():
            if counter is None:
                self._counters.pop(column, None)
            else:
                self._counters[column] = counter

    def columns(self):
        """``{name: (row_shape, dtype)}`` of the store's columns, the hidden ones left out."""
        return {c: s for c, s in self.store.columns().items() if c != VERSION}

    # -- versions ---------------------------------------------------------------------

    @property
    def tracks_versions(self):
        """Whether rows have versions yet (made by the first :meth:`versions` call)."""
        return self._tracked

    def _version_array(self):
        if self._fixed_versions is not None:
            return self._fixed_versions
        return self.store.column(VERSION)  # a hash store's arrays move as it grows

    def versions(self, slots, first):
        """Versions of the rows at ``slots``, every row starting at ``first`` on the first
        call (the holder's next :data:`VERSION_EPOCH` multiple)."""
        if not self._tracked:
            with self.lock.write():
                if not self._tracked:
                    if self.store.fixed_keys:
                        self._fixed_versions = np.full(self.store.capacity, first, np.int64)
                    else:
                        self.store.add_column(VERSION, (), "int64", fill=first)
                    self._tracked = True
        return self._version_array()[slots]

    def bump(self, slots, by=1):
        """Add ``by`` (an int, or one per slot) to the versions of ``slots``; the caller
        holds the write lock. Duplicate slots change once: enough to void a cached copy."""
        if self._tracked:
            self._version_array()[slots] += by

    def bump_all(self):
        """Change every row's version (its optimizer state was reset)."""
        if self._tracked:
            with self.write():
                self._version_array()[...] += 1
