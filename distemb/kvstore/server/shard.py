"""ShardTable: one shard of one table, a RowStore and everything that guards it.

Every shard a process holds is one ShardTable, whatever its store: a dense array (its
optimizer state as columns beside the weight), a hash table, a file. The store says
where the rows are, the table's router which keys are the shard's; the ShardTable owns
what the server needs around them:

- a reader/writer lock: pulls hold it shared, pushes and updates exclusive, so a pull
  never sees a row between an update's read and its write, and pulls run in parallel;
- seqlock counters: readers outside the process (trainers mapping a column from
  /dev/shm, see :mod:`distemb.transport.shm`) cannot take the lock, so each write makes
  the counters of the mapped columns odd while it runs;
- a per-row version (write counter), made on first use: what trainer caches validate
  their copies against. A fixed key set keeps it in an array beside the store (its slots
  never move); a store that inserts and evicts keeps it as a hidden column, so a row's
  version is evicted with the row, and a key inserted (or inserted again after its
  removal) starts above every version the shard has issued: a copy of an evicted row
  never matches the version of the row that replaced it.
- what changed since its last saves (:class:`~distemb.kvstore.checkpoint.changes.Changes`:
  the versions then, and the keys removed since), which an incremental checkpoint
  writes; and, for a store that evicts, the sink its evictions hand their rows to
  (:mod:`distemb.kvstore.checkpoint.sink`).

Concurrency: one writer per row (DESIGN.md). Stores that insert on read (a hash store's
lookup may grow its arrays or evict) take the write lock for lookups too.

Example:
    >>> import numpy as np

    >>> from distemb.routers import KeyHashRouter
    >>> from distemb.stores import HashStore
    >>> t = ShardTable(HashStore(2), KeyHashRouter(1))
    >>> v = t.versions(np.array([2**40]), first=0)  # the key is inserted, above version 0
    >>> t.push(np.array([2**40]), np.ones((1, 2), np.float32))
    >>> (t.versions(np.array([2**40]), first=None) - v).tolist(), t.pull(np.array([2**40])).tolist()
    ([1], [[1.0, 1.0]])
"""
import numpy as np

from distemb.enums import Rounding
from distemb.errors import KVStoreError, StoreError
from distemb.kvstore.checkpoint.changes import Changes
from distemb.kvstore.server.rwlock import RWLock
from distemb.rules import rule_of
from distemb.stores.types import WEIGHT

#: Hidden column of a store that inserts and evicts: each row's write counter.
VERSION = "~version"
#: Distance between the first versions of two version arrays of one holder, so a table
#: dropped and made again never repeats a version a trainer's cache holds.
VERSION_EPOCH = 1 << 40


class ShardTable:
    """One shard: ``store`` (a :class:`~distemb.stores.types.RowStore`), its lock, seqlock
    counters and row versions; see the module docstring.

    Args:
        store: the shard's rows and optimizer-state columns.
        router: the table's :class:`~distemb.routers.Router`: requests carry the table's
            keys, which must be this shard's (:meth:`local_keys`), and checkpoints and
            exports give the table's keys back.
        part: the shard's number among the router's shards.
        spec: the table spec the store was made from (:mod:`distemb.stores.spec`).
        sink: where the rows an eviction removes go (:func:`~distemb.kvstore.checkpoint.
            sink.make_sink`), or None.

    Example:
        >>> from distemb.routers import PolicyRouter
        >>> from distemb.stores import DenseStore
        >>> t = ShardTable(DenseStore(4, 2), PolicyRouter.ranges(4, 1))
        >>> t.pull(np.array([3])).shape
        (1, 2)
    """

    def __init__(self, store, router, part=0, spec=None, sink=None):
        self.store, self.router, self.part, self.spec = store, router, part, spec
        self.sink = sink
        self.changes = Changes()
        if not store.fixed_keys:
            store.on_remove = self._leaving
        self.lock = RWLock()
        # write()'s context manager: one, reused (it keeps no state of its own)
        self._writing = _Writing(self._begin_write, self._end_write)
        self._counters = {}  # column -> its segment's header (seqlock counter first)
        self._fixed_versions = None  # versions of a fixed key set, indexed by slot
        self._tracked = False
        self._high = 0  # >= every version issued (a store that inserts: new rows go above)
        #: [start, stop): the keys of a range partition's shard (store key = key - start)
        self._range = router.key_range(part)

    @property
    def inserts_on_read(self):
        """Whether a lookup may insert keys (and so must hold the write lock)."""
        return not self.store.fixed_keys

    @property
    def wire_dtype(self):
        """The dtype of weight rows in pulls and pushes: their storage dtype (half rows
        travel as 2 bytes; the trainer decodes and rounds them)."""
        return self.store.column(WEIGHT).dtype

    def read(self):
        """Context manager: the shared lock (reads of rows that cannot move)."""
        return self.lock.read()

    def write(self):
        """Context manager: the exclusive lock, with every seqlock counter odd meanwhile."""
        return self._writing

    def _begin_write(self):
        self.lock.acquire_write()
        try:
            if self._tracked and not self.store.fixed_keys:
                self._high += 1  # rows this write inserts start above every version issued
                self.store.set_fill(VERSION, self._high)
        except BaseException:
            self.lock.release_write()
            raise
        for v in self._counters.values():
            v[0] += 1  # odd: a write is under way

    def _end_write(self):
        # the counters cannot change meanwhile: set_counter takes the lock to change them
        for v in self._counters.values():
            v[0] += 1  # even again: the rows are consistent
        self.lock.release_write()

    def set_counter(self, column, counter):
        """Make ``counter`` (a segment's header: int64 words, the seqlock counter first,
        :mod:`distemb.transport.shm`) the seqlock counter of ``column``
        (None forgets it): :meth:`write` makes it odd while it writes. The caller holds
        no lock of this table."""
        with self.lock.write():
            if counter is None:
                self._counters.pop(column, None)
            else:
                self._counters[column] = counter

    def columns(self):
        """``{name: (row_shape, dtype)}`` of the store's columns, the hidden ones left out."""
        return {c: s for c, s in self.store.columns().items() if c != VERSION}

    def init_states(self, rule, options):
        """(Re)create update rule ``rule``'s state columns at their initial values
        (``options``: the rule's initial-value options) and void every cached copy.

        A new optimizer starts from fresh state, except on a persistent store (a file
        store reopened to resume), which keeps state columns of the same shape.

        Returns:
            the state names of the rule, in order.

        Raises:
            KVStoreError: an option the rule's states do not start from, or not finite.
        """
        impl = rule_of(rule)
        options = impl.options_from(options)
        specs = impl.states
        with self.write():
            for spec in specs:
                fill = options.get(spec.init_option, 0) if spec.init_option else 0
                self.store.add_column(spec.name, spec.shape(self.store.dim), spec.dtype, fill,
                                      keep=self.store.persistent)
        self.bump_all()
        return [s.name for s in specs]

    def _leaving(self, keys, slots, evicted):
        """The store is about to remove ``keys`` (at ``slots``; the write lock is held):
        an eviction's rows and state go to the sink first; the keys are logged for the
        next incremental checkpoint."""
        if evicted and self.sink is not None:
            self.sink.write(self.router.to_global(self.part, keys),
                            {c: (shape, dtype, self.store.read_rows(c, slots, stored=True))
                             for c, (shape, dtype) in self.columns().items()})
        if self.changes.tracking:
            self.changes.removed(self.router.to_global(self.part, keys))

    # -- keys of requests -------------------------------------------------------------

    def local_keys(self, ids, what):
        """The store keys of request ids ``ids`` (the table's keys, int64); ``what`` names
        the shard in errors. Each must be this shard's by the table's router (a trainer
        that routed with another server count would lose its rows to every other
        trainer), then they map to the store's keys.

        Raises:
            PartitionError: a key outside a fixed key space.
            ValueError: a key a hash index reserves.
            KVStoreError: a key another shard owns.
        """
        if not len(ids):
            return ids
        if self._range is not None and ids.dtype == np.int64:  # one pass maps and checks
            start, stop = self._range
            local = ids - start if start else ids
            if int(local.view(np.uint64).max()) < stop - start:  # a negative one is above
                return local
        self.router.check(ids, f"ids of {what}")  # the error naming the key
        if self.router.identity:  # the store keys are the table's keys: no mapping
            return ids
        owner = self.router.part_of(ids)
        if (owner != self.part).any():
            bad = int(np.flatnonzero(owner != self.part)[0])
            raise KVStoreError(f"key {int(ids[bad])} of {what} belongs to shard "
                               f"{int(owner[bad])}, not shard {self.part} (the trainer "
                               "routed it for another number of servers)")
        return self.router.to_local(self.part, ids)

    # -- rows -------------------------------------------------------------------------

    def pull(self, keys, column=WEIGHT, out=None, num_threads=1, access=True):
        """Rows ``keys`` of ``column``, into ``out`` when given
        (:meth:`RowStore.read <distemb.stores.types.RowStore.read>`: the weight is a
        training lookup, a hash store's inserting absent keys and counting the access
        unless ``access`` is False; half rows decoded to float32 unless ``out`` has their
        storage dtype, as the wire does)."""
        inserting = self.inserts_on_read and column == WEIGHT
        with self.write() if inserting else self.read():
            return self.store.read(keys, column, out, num_threads, access)

    def push(self, keys, values, column=WEIGHT):
        """Write (upsert) rows ``keys`` of ``column``; float32 weight values into half rows
        are rounded to nearest-even."""
        with self.write():
            self.store.scatter(keys, values, column)
            self.bump(keys)

    def update(self, rule, keys, grads, hyper, num_threads=1, contributions=1):
        """Apply update ``rule`` to unique ``keys`` and add ``contributions`` (an int, or
        one per key) to their versions.

        A key a store that inserts no longer holds (removed or evicted since the lookup
        the gradient came from) is not updated: its gradient is dropped, and the key stays
        gone (a removal holds, and so does a capacity).

        Returns:
            the keys' versions before the update, read under the same lock (-1 for a
            dropped key, so no cached copy of it matches), or None while rows have no
            versions.
        """
        with self.write():
            at = self.store.update(rule, keys, grads, hyper, num_threads)
            if at is None:
                return self.bump(keys, contributions)
            before = self.bump(keys[at], contributions if np.ndim(contributions) == 0
                               else np.asarray(contributions)[at])
        if before is None:
            return None
        out = np.full(len(keys), -1, np.int64)
        out[at] = before
        return out

    def update_later(self, rule, keys, grads, hyper, num_threads=1, first=0):
        """:meth:`update` (of one trainer's gradients) in two halves: the write lock is
        taken, every seqlock counter odd, now; ``apply(on_failure=None)`` updates the
        rows and releases the lock (also when it raises), and must be called exactly
        once. If it fails, ``on_failure(error)`` runs before the lock is released (the
        server tells the trainer there, which learns it the moment the counter moves).

        Args:
            first: the first ``first`` rows are applied first (rows of a store whose
                rows never move), and then the header's second word is set to the
                counter's value: those rows are final while the others are written.

        Returns:
            (the weight column's seqlock counter meanwhile, None when it has none; apply).
            While the counter holds that value, no row but ``keys`` is being written.
        """
        writing = self.write()
        writing.__enter__()
        header = self._counters.get(WEIGHT)
        counter = None if header is None else int(header[0])
        # Not when rounding is stochastic: each store update takes the next rounding
        # seed, and the rows must not depend on whether a prefetch split the update.
        split = header is not None and self.store.fixed_keys and 0 < first < len(keys) \
            and self.store.rounding is not Rounding.STOCHASTIC

        def apply(on_failure=None):
            try:
                if split:  # a fixed store's update writes every key
                    self.store.update(rule, keys[:first], grads[:first], hyper, num_threads)
                    self.bump(keys[:first])
                    header[1] = counter  # seen after the rows (x86-64 keeps stores in order)
                    self.store.update(rule, keys[first:], grads[first:], hyper, num_threads)
                    self.bump(keys[first:])
                else:
                    at = self.store.update(rule, keys, grads, hyper, num_threads)
                    self.bump(keys if at is None else keys[at])  # a key gone: as in update
            except BaseException as e:
                if on_failure is not None:
                    on_failure(e)
                raise
            finally:
                writing.__exit__(None, None, None)
        return counter, apply

    # -- keys -------------------------------------------------------------------------

    def _columns_of(self, columns, name):
        missing = [c for c in columns if c not in self.columns()]
        if missing:
            raise StoreError(f"columns: {missing} not in {name!r} (has {sorted(self.columns())})")

    def contains(self, keys):
        """Bool per store key: held or not (nothing inserted, no access counted)."""
        with self.read():
            return self.store.find(keys) >= 0

    def get(self, keys, column=WEIGHT, name="the table"):
        """Rows of ``column`` of held store keys (the weight as float32), nothing inserted
        or counted.

        Raises:
            MissingKeyError: a key not held. StoreError: no such column.
        """
        self._columns_of([column], name)
        with self.read():
            return self.store.gather(keys, column, insert=False)

    def remove(self, keys, name="the table"):
        """Remove store keys with their state; how many were held.

        Raises:
            StoreError: the store holds fixed keys (it says so).
        """
        with self.write():
            return self.store.remove(keys)

    def evict(self, target_size, policy=None, name="the table"):
        """Evict keys by ``policy`` (the store's when None) down to ``target_size``;
        returns the evicted store keys.

        Raises:
            StoreError: the store holds fixed keys (it says so).
        """
        with self.write():
            return self.store.evict(target_size, policy)

    def export(self, start=0, count=None, columns=None, name="the table"):
        """Held keys ``start .. start+count-1`` in ascending order (every one from
        ``start`` when ``count`` is None), as the table's keys, with their rows of
        ``columns`` (every column when None; the weight as float32).

        Returns:
            (keys, {column: rows}).
        """
        self._columns_of(columns or (), name)
        with self.read():
            cols = list(columns) if columns else list(self.columns())
            keys = self.store.keys()[start:None if count is None else start + count]
            slots = self.store.slots(keys) if len(keys) else np.empty(0, np.int64)
            rows = {c: self.store.read_rows(c, slots) for c in cols}
        return self.router.to_global(self.part, keys), rows

    # -- versions ---------------------------------------------------------------------

    @property
    def tracks_versions(self):
        """Whether rows have versions yet (made by the first :meth:`versions` call)."""
        return self._tracked

    def row_versions(self):
        """Every row's version by slot, a host array (the caller holds the lock; a
        store's in host memory is the live array), or None while rows have none."""
        return self.store.host_versions(self._version_array()) if self._tracked else None

    def _version_array(self):
        if self._fixed_versions is not None:
            return self._fixed_versions
        return self.store.column(VERSION)  # a hash store's arrays move as it grows

    def versions(self, keys, first, insert=True):
        """Versions of the rows of ``keys``, every row starting at ``first`` on the first
        call (the holder's next :data:`VERSION_EPOCH` multiple).

        A store that inserts on read looks the keys up (a versioned pull is a lookup:
        absent keys are inserted and the access is counted, as :meth:`pull` does); without
        ``insert``, a key it does not hold has version -1."""
        if not self._tracked:
            with self.lock.write():
                if not self._tracked:
                    if self.store.fixed_keys:
                        self._fixed_versions = self.store.new_versions(first)
                    else:
                        self.store.add_column(VERSION, (), "int64", fill=first)
                    self._high = first
                    self._tracked = True
        if self.inserts_on_read and insert:
            with self.write():
                slots = self.store.access(keys)  # first: it may grow the version array
                return self._version_array()[slots]
        if self.inserts_on_read:
            with self.read():
                slots = self.store.find(keys)
                out = np.full(len(keys), -1, np.int64)
                out[slots >= 0] = self._version_array()[slots[slots >= 0]]
                return out
        return self._version_array()[keys]

    def bump(self, keys, by=1):
        """Add ``by`` (an int, or one per key) to the versions of ``keys``; the caller
        holds the write lock. Duplicate keys change once: enough to void a cached copy.
        Returns the versions before (None while rows have no versions)."""
        if not self._tracked:
            return None
        if not len(keys):
            return np.empty(0, np.int64)
        # a fixed key set's keys are its slots; another store's keys were just written
        slots = keys if self.store.fixed_keys else self.store.slots(keys)
        arr = self._version_array()
        before = arr[slots]
        bumped = before + by
        arr[slots] = bumped
        if not self.store.fixed_keys:  # where a store that inserts starts new rows
            self._high = max(self._high, int(bumped.max()))
        return before

    def bump_all(self):
        """Change every row's version (its optimizer state was reset)."""
        if self._tracked:
            with self.write():
                self._version_array()[...] += 1
                self._high += 1


class _Writing:
    """:meth:`ShardTable.write`'s context manager: ``begin()`` on entry, ``end()`` on
    exit."""

    __slots__ = ("_begin", "_end")

    def __init__(self, begin, end):
        self._begin, self._end = begin, end

    def __enter__(self):
        self._begin()

    def __exit__(self, *exc):
        self._end()
