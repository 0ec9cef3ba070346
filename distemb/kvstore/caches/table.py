"""What a cache keeps of one table: :class:`TableCache`, the cached rows with their
optimizer state, versions and use stamps, and per key the slot of a cached row and how
often the key was pulled lately. Two implementations of the per-key parts, by the
table's key space:

- rows 0..N-1 of a dense table: arrays indexed by the id (:class:`ArraySlots`,
  :class:`ArrayCounts`), exact and one memory access each;
- any int64 key of a keyed table (hash or file store): a hash index over the cached keys
  only (:class:`HashSlots`, bounded by the cache's capacity) and a count-min sketch of
  the pulls (:class:`SketchCounts`, TinyLFU's frequency estimate: fixed memory whatever
  the key space, counts never under-estimated except where one batch's keys collide).

Example:
    >>> import numpy as np
    >>> s = HashSlots()
    >>> s.set(np.array([2**40, -5]), np.array([0, 1]))
    >>> s.get(np.array([-5, 7])).tolist()
    [1, -1]
    >>> c = SketchCounts(capacity=4)
    >>> c.add(np.array([2**40])); c.add(np.array([2**40, 3]))
    >>> c.get(np.array([2**40, 3, 9])).tolist()
    [2, 1, 0]
"""
from typing import Optional

import numpy as np

from distemb.kernels import cachebook
from distemb.kernels.hashtable import HashIndex
from distemb.payoff import Payoff
from distemb.partition import splitmix64


def unique_inverse(keys):
    """``(unique keys in order of first appearance, inverse)``: ``uniq[inverse] == keys``.

    A pull's ids made unique by a hash index (one pass, about 4x faster than
    ``np.unique(return_inverse=True)``'s sort on a 13,000-id batch).

    Example:
        >>> u, inv = unique_inverse(np.array([7, 3, 7, 9]))
        >>> u.tolist(), inv.tolist()
        ([7, 3, 9], [0, 1, 0, 2])
    """
    at, _ = HashIndex(capacity=len(keys)).find_or_insert(keys)
    uniq = np.empty(int(at.max()) + 1 if len(at) else 0, np.int64)
    uniq[at] = keys
    return uniq, at


class ArraySlots:
    """Slot of each cached id of a table of ``num_rows`` rows (-1: not cached); int32
    below 2**31 slots, so the map of a 10M-row table is 40 MB of random reads, not 80."""

    def __init__(self, num_rows: int, capacity: int = 0):
        self._slot = np.full(num_rows, -1, np.int32 if capacity < 2 ** 31 else np.int64)

    def lookup(self, ids, seen: "ArrayCounts", any_held=True):
        """``(unique ids in order of first appearance, inverse, their slots)`` of a pull's
        ``ids``, each unique id counted once in ``seen``: one pass (``any_held`` False:
        nothing is cached, the map is not read)."""
        return cachebook.dense_lookup(ids, self._slot, seen.counts, any_held)

    def get(self, ids):
        return self._slot[ids].astype(np.int64)

    def set(self, ids, slots):
        self._slot[ids] = slots

    def clear(self, ids):
        self._slot[ids] = -1


class HashSlots:
    """Slot of each cached key of any int64 key space (-1: not cached); holds the cached
    keys only."""

    def __init__(self):
        self._index = HashIndex()
        self._slot = np.empty(0, np.int64)  # index slot -> cache slot

    def lookup(self, keys, seen, any_held=True):
        """``(unique keys in order of first appearance, inverse, their slots)`` of a
        pull's ``keys``, each unique key counted once in ``seen`` (``any_held`` False:
        nothing is cached, the index is not searched)."""
        uniq, inverse = unique_inverse(keys)
        seen.add(uniq)
        return uniq, inverse, self.get(uniq) if any_held else np.full(len(uniq), -1,
                                                                      np.int64)

    def get(self, keys):
        found = self._index.find(keys)
        out = np.full(len(keys), -1, np.int64)
        held = found >= 0
        out[held] = self._slot[found[held]]
        return out

    def set(self, keys, slots):
        at, _ = self._index.find_or_insert(keys)
        if self._index.high_water > len(self._slot):
            grown = np.empty(max(self._index.high_water, 2 * len(self._slot)), np.int64)
            grown[:len(self._slot)] = self._slot
            self._slot = grown
        self._slot[at] = slots

    def clear(self, keys):
        self._index.remove(keys)


class ArrayCounts:
    """Recent pulls of every id of a table of ``num_rows`` rows, one byte each (the
    counts halve every :data:`DECAY` pulls, so they stay below ``2 * DECAY``)."""

    def __init__(self, num_rows: int):
        #: id -> recent pulls (:meth:`ArraySlots.lookup` adds to it in its pass)
        self.counts = np.zeros(num_rows, np.uint8)

    def add(self, ids):
        """One more pull of each of ``ids`` (unique)."""
        self.counts[ids] += np.uint8(1)

    def get(self, ids):
        return self.counts[ids]

    def halve(self):
        self.counts >>= 1


class SketchCounts:
    """Recent pulls of any int64 key, estimated by a count-min sketch.

    Args:
        capacity: rows the cache holds; the sketch has ``DEPTH`` rows of at least 8
            counters per cached row (and 1,024), so keys competing for the cache rarely
            share every counter.
    """

    DEPTH = 4
    #: Per-row seeds of the sketch's hashes (splitmix64 of key + seed).
    SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0xD6E8FEB86659FD93], np.uint64)

    def __init__(self, capacity: int):
        width = 1024
        while width < 8 * capacity:
            width *= 2
        self._mask = np.uint64(width - 1)
        self._table = np.zeros((self.DEPTH, width), np.int32)

    def _cells(self, keys):
        k = np.asarray(keys, np.int64).view(np.uint64)
        with np.errstate(over="ignore"):
            return [(splitmix64(k + seed) & self._mask).astype(np.intp) for seed in self.SEEDS]

    def add(self, keys):
        """One more pull of each of ``keys`` (unique; keys of one batch sharing a counter
        add one to it)."""
        for row, cells in zip(self._table, self._cells(keys)):
            row[cells] += 1

    def get(self, keys):
        cells = self._cells(keys)
        return np.minimum.reduce([row[c] for row, c in zip(self._table, cells)])

    def halve(self):
        self._table >>= 1


#: Pulls after which the LFU counts of a table halve, so old popularity fades (below
#: 128: :class:`ArrayCounts` holds up to ``2 * DECAY - 1`` in a byte).
DECAY = 32
#: LFU admits a row only once it was pulled this many times lately.
ADMIT_MIN = 2
#: A trainer cache whose copies served fewer than this share of the rows asked over the
#: last :data:`DECAY` pulls, while it held rows, cannot help these ids: it empties itself
#: and keeps nothing for :data:`IDLE` pulls (its pulls and updates are plain ones), then
#: tries again.
MIN_HITS = 0.02
IDLE = 4 * DECAY
#: Cached rows LFU samples per competing new row to find the ones it may displace.
SAMPLE = 4


class TableCache:
    """The cached rows of one table: values, optimizer state, versions, use stamps.

    Args:
        num_rows: rows 0..num_rows-1 of a dense table, or None for a keyed table (any
            int64 key: its slot map and pull counts are hashed,
            :class:`HashSlots`, :class:`SketchCounts`).
        dim: its row width; capacity: cached rows.
        states: {state name: (row shape, dtype)} of the table's update rule.
    """

    def __init__(self, num_rows: Optional[int], dim: int, capacity: int, states=None,
                 rule=None, timed=False):
        self.capacity, self.rule = capacity, rule
        if num_rows is None:
            self.slot_of, self.seen = HashSlots(), SketchCounts(capacity)
        else:
            self.slot_of, self.seen = ArraySlots(num_rows, capacity), ArrayCounts(num_rows)
        self.ids = np.zeros(capacity, np.int64)             # slot -> global id
        # slot -> holds a row; not ``ids == -1``: -1 is a key of a keyed table like any
        self.held = np.zeros(capacity, bool)
        self.values = np.zeros((capacity, dim), np.float32)
        self.states = {name: np.zeros((capacity,) + shape, dtype)
                       for name, (shape, dtype) in (states or {}).items()}
        self.version = np.full(capacity, -1, np.int64)
        # slot -> prefetches waiting for their lookup of its row: no admission evicts it
        self.pins = np.zeros(capacity, np.int32)
        self.checked = np.zeros(capacity, np.int64)         # step of the last validation
        self.stamp = np.zeros(capacity, np.int64)           # last use (lru) or uses (lfu)
        self.pulls = 0
        self.step = 0
        self.used = 0                                       # slots held
        self.hits = self.asked = 0   # rows served by copies / asked, this DECAY window
        self.idle_until = 0          # no row is kept before this many pulls
        self.payoff = None if not timed else Payoff()  # its time, cached vs plain
        self._window_idle, self._judged = False, 0
        self._rng = np.random.default_rng(0)                # LFU's victim samples

    def count(self, ids):
        """Count a pull of unique ``ids``; halve every count every DECAY pulls (recency)."""
        self._tick()
        self.seen.add(ids)

    def lookup(self, ids):
        """Count a pull of ``ids`` (as :meth:`count`) and find their cached copies.

        Returns:
            (unique ids in order of first appearance, ``inverse``: ``uniq[inverse] ==
            ids``, the slot of each unique id, -1 where not cached).
        """
        self._tick()
        return self.slot_of.lookup(ids, self.seen, self.used > 0)

    def _tick(self):
        self.pulls += 1
        if self.pulls % DECAY == 0:
            self.seen.halve()

    def pin(self, slots):
        """One more prefetch waits for the rows in ``slots`` (held; duplicates count
        once each): until :meth:`unpin`, no admission (:meth:`admit`,
        :meth:`worth_keeping`, :meth:`served`) evicts them."""
        np.add.at(self.pins, slots, 1)

    def unpin(self, slots):
        """A prefetch of the rows in ``slots`` had its lookup (or was dropped)."""
        np.subtract.at(self.pins, slots, 1)

    @property
    def pinned(self):
        """Slots some prefetch holds (:meth:`pin`)."""
        return int(np.count_nonzero(self.pins))

    def served(self, hits, asked):
        """Record a pull of ``asked`` unique rows, ``hits`` of them served by copies; at
        the end of each :data:`DECAY` window, a cache that held rows and served fewer than
        :data:`MIN_HITS` of the rows asked empties itself and goes idle for :data:`IDLE`
        pulls (the trainer cache only: it holds no row that is not also on its owner)."""
        self.hits += hits
        self.asked += asked
        if self.pulls % DECAY:
            return
        if self.used and self.hits < MIN_HITS * self.asked:
            self.go_idle(IDLE)
        self.hits = self.asked = 0

    def go_idle(self, pulls):
        """Empty the cache (but pinned rows) and keep no row for the next ``pulls`` pulls."""
        self.evict(np.flatnonzero(self.held & (self.pins == 0)))
        self.idle_until = max(self.idle_until, self.pulls + pulls)

    def spend(self, seconds):
        """Count the wall time of a pull or an update of the table (:class:`Payoff`)."""
        if self.payoff is not None:
            self.payoff.spend(seconds)

    def begin_pull(self):
        """Before a pull: at the end of a window of :data:`DECAY` pulls (with their
        updates), judge it by its time; a cache slower than plain pulls goes idle
        (:mod:`distemb.payoff`)."""
        if self.payoff is None or not self.pulls or self.pulls % DECAY or \
                self.pulls == self._judged:
            return
        self._judged = self.pulls
        idle = self.payoff.window(self._window_idle, DECAY)
        if idle:
            self.go_idle(idle * DECAY)
        self._window_idle = self.idle

    @property
    def idle(self):
        """Whether the cache keeps no row now (see :meth:`served`)."""
        return self.pulls < self.idle_until

    def worth_keeping(self, ids, keep):
        """Which of the new rows ``ids`` (unique, not cached) to keep: LFU admission.

        Only rows pulled at least :data:`ADMIT_MIN` times lately compete (a row seen once
        is not fetched with its optimizer state). Free slots take the most often seen
        first; then a new row displaces a cached one (not in slots ``keep``) only if it
        was seen more often (TinyLFU): each is paired with the least often seen of a
        random sample of :data:`SAMPLE` cached rows per competitor, so the cost follows
        the competitors, not the capacity.

        Returns:
            (bool mask over ``ids``, the slots of the cached rows to evict for them, one
            per kept row beyond the free slots).
        """
        seen = self.seen.get(ids)
        out = np.zeros(len(ids), bool)
        order = np.flatnonzero(seen >= ADMIT_MIN)
        order = order[np.argsort(-seen[order], kind="stable")]
        free = self.capacity - self.used
        out[order[:free]] = True
        rest = order[free:]
        if not len(rest) or not self.used:
            return out, np.empty(0, np.int64)
        sample = np.unique(self._rng.integers(0, self.capacity, SAMPLE * len(rest)))
        busy = ~self.held | (self.pins > 0)
        busy[keep] = True
        sample = sample[~busy[sample]]
        sample = sample[np.argsort(self.seen.get(self.ids[sample]), kind="stable")]
        n = min(len(rest), len(sample))
        win = seen[rest[:n]] > self.seen.get(self.ids[sample[:n]])
        out[rest[:n][win]] = True
        return out, sample[:n][win]

    def evict(self, slots):
        """Forget the rows in ``slots`` (unique; negative ones and empty slots skipped)."""
        slots = slots[slots >= 0]
        slots = slots[self.held[slots]]
        self.slot_of.clear(self.ids[slots])
        self.held[slots] = False
        self.used -= len(slots)
        self.version[slots] = -1

    def slots(self, ids):
        """The slot of each of ``ids`` (global), -1 where not cached."""
        if not self.used:  # an empty (or idle) cache: no map to read
            return np.full(len(ids), -1, np.int64)
        return self.slot_of.get(ids)

    def forget(self, ids):
        """Forget the rows ``ids`` (global) where cached."""
        self.evict(self.slots(ids))

    def admit(self, ids, keep, victims=None):
        """Slots for new rows ``ids`` (not cached): free slots, then ``victims`` (LFU's,
        from :meth:`worth_keeping`) or else the lowest stamps.

        Rows in slots ``keep`` (used by the same request) and pinned rows (a prefetch's,
        :meth:`pin`) are not evicted. Returns the slots of the first ``len(slots)`` ids;
        the others do not fit.
        """
        if victims is not None:
            self.evict(victims)
        free = np.flatnonzero(~self.held)
        spared = self.pins > 0
        spared[keep] = True
        room = self.capacity - int(np.count_nonzero(spared & self.held))
        need = min(len(ids), room) - len(free)
        if need > 0:
            stamps = self.stamp.astype(np.float64)
            stamps[spared] = np.inf
            stamps[free] = np.inf
            victims = np.argpartition(stamps, need - 1)[:need]
            self.evict(victims)
            free = np.concatenate([free, victims])
        slots = free[:min(len(ids), len(free))]
        self.ids[slots] = ids[:len(slots)]
        self.held[slots] = True
        self.used += len(slots)
        self.slot_of.set(ids[:len(slots)], slots)
        return slots
