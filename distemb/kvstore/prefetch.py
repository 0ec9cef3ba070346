"""Prefetched rows: what a client read ahead of a coming lookup, kept equal to the rows
that lookup would read.

``emb.prefetch(next_ids)`` (:meth:`~distemb.kvstore.types.KVClient.prefetch`) starts
reading the next batch's rows while the current batch computes. A client whose rows live
elsewhere keeps each such read as a :class:`Prefetch` in its :class:`Prefetches`:

- a lookup takes its rows from the oldest prefetch of its table (the next batch's),
  reads the others as usual, and marks it used; the table's next update releases the
  prefetches used so far (so the several lookups of one batch all find it);
- until then, every write that reaches a prefetched row is applied to it: the table's
  updates name the prefetched rows (``watched``) and their owners answer with those the
  update (in ``sync_exact``: the step, every trainer's rows) wrote, as they are after it
  (``patch``); a row written otherwise by this trainer (a push, a removal) is dropped
  from the prefetch (``void``) and read again at the lookup. So a lookup after a prefetch
  returns exactly the rows a lookup without it returns.

A cache in front of the rows keeps a prefetch's rows in its own slots instead, pinned
until the prefetch is released: a :class:`Prefetch` then holds each key's slot, and
its ``unpin`` releases them (:mod:`distemb.kvstore.caches`).

Counters (``stats``): prefetches made, rows read ahead, rows lookups took from them,
rows patched by updates, rows voided (read again at their lookup), prefetches dropped
unused (more than :data:`MAX_AHEAD` waiting).

Example:
    >>> p = Prefetches()
    >>> p.add("t", Prefetch(np.array([2, 5]), np.array([[2.0], [5.0]], np.float32)))
    >>> keys, plan = p.watched("t")
    >>> p.patch("t", plan, [(np.array([1]), np.array([[9.0]], np.float32), np.empty(0, int))])
    >>> hit, rows = p.take("t", np.array([5, 7, 2]))
    >>> hit.tolist(), rows[:, 0].tolist()
    ([True, False, True], [9.0, 2.0])
"""
import collections
from typing import Callable, List, Optional, Tuple

import numpy as np

from distemb.errors import KVStoreError
from distemb.kvstore.routes import route
from distemb.stores.types import WEIGHT

#: Prefetches of one table waiting for their lookup, at most; a new one beyond this drops
#: the oldest (a prefetch whose lookup never came).
MAX_AHEAD = 4


class Prefetch:
    """The rows of one prefetch of one table.

    Args:
        keys: the table's keys, sorted and unique.
        rows: one row per key (filled by the read as it arrives).
        ok: per key, whether its row is read ahead (default: every key); False for keys
            left to the lookup (read in place, or voided since).
        arrival: called to wait for the read (None: the rows are there).
    """

    def __init__(self, keys, rows, ok=None, arrival: Optional[Callable[[], None]] = None):
        self.keys, self.rows = keys, rows
        self.ok = np.ones(len(keys), bool) if ok is None else ok
        self.used = False
        self._then: List[Callable[[], None]] = [] if arrival is None else [arrival]
        #: a cache's: ``unpin(positions)`` releases what it holds for those keys (their
        #: slots), when they are voided and when the prefetch is released
        self.unpin: Optional[Callable[[np.ndarray], None]] = None

    def after_arrival(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the read (and what was queued before ``fn``) is in."""
        self._then.append(fn)

    def settle(self) -> None:
        """Wait for the read, then apply what came after it, in order."""
        while self._then:
            self._then.pop(0)()

    @property
    def read(self) -> bool:
        """Whether its rows are read (or on their way); False for keys kept for a read
        to come (a collective client's, at the next step)."""
        return self.rows is not None

    def positions(self, ids) -> Tuple[np.ndarray, np.ndarray]:
        """(bool per id: its row is here, its position in ``keys``)."""
        at = np.searchsorted(self.keys, ids)
        at = np.minimum(at, max(len(self.keys) - 1, 0))
        hit = (self.keys[at] == ids) & self.ok[at] if len(self.keys) else \
            np.zeros(len(ids), bool)
        return hit, at


class Prefetches:
    """A client's prefetches by table (see the module docstring)."""

    def __init__(self):
        self._by = collections.defaultdict(collections.deque)
        self.stats = dict(prefetches=0, prefetched_rows=0, served_rows=0, patched_rows=0,
                          voided_rows=0, dropped=0)

    def __contains__(self, name: str) -> bool:
        return bool(self._by.get(name))

    def add(self, name: str, prefetch: Prefetch) -> None:
        """Keep ``prefetch`` of table ``name`` for its lookup."""
        q = self._by[name]
        q.append(prefetch)
        self.stats["prefetches"] += 1
        self.stats["prefetched_rows"] += int(prefetch.ok.sum())
        while len(q) > MAX_AHEAD:
            self._release(q.popleft())
            self.stats["dropped"] += 1

    def take(self, name: str, ids) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The rows the oldest prefetch of ``name`` holds for ``ids`` (table keys, any
        order, duplicates allowed), as the table is now.

        Returns:
            (bool per id: served, rows of the served ids in order), or None when the
            table has no prefetch (or its oldest is not read yet: it counts as used).
        """
        q = self._by.get(name)
        if not q:
            return None
        p = q[0]
        p.used = True
        if not p.read:
            return None
        p.settle()
        hit, at = p.positions(ids)
        self.stats["served_rows"] += int(hit.sum())
        return hit, p.rows[at[hit]]

    def serve(self, requests, read, read_rest=None):
        """Rows of each ``(table, column, ids)`` of ``requests``: a table's rows its
        oldest prefetch holds from there (:meth:`take`), the others by ``read(requests)``.

        Args:
            read: the rows of each request of a list of them, from where they live.
            read_rest: reads what the prefetches did not hold instead of ``read`` (a
                collective client's asks every rank first whether any misses rows).
        """
        prefetched = [c == WEIGHT and t.name in self for t, c, _ in requests]
        if not any(prefetched):
            return read(requests)
        served = [self.take(t.name, ids) if p else None
                  for (t, _, ids), p in zip(requests, prefetched)]
        got = (read_rest or read)([(t, c, ids if s is None else ids[~s[0]])
                                   for (t, c, ids), s in zip(requests, served)])
        outs = []
        for (_, _, ids), s, rows in zip(requests, served, got):
            if s is not None:
                hit, kept = s
                merged = np.empty((len(ids),) + kept.shape[1:], kept.dtype)
                merged[hit] = kept
                merged[~hit] = rows
                rows = merged
            outs.append(rows)
        return outs

    def waiting(self, name: str) -> List[Prefetch]:
        """The prefetches of ``name`` still waiting for their lookup, oldest first."""
        return [p for p in self._by.get(name, ()) if not p.used]

    def watched(self, name: str):
        """The keys of the prefetches of ``name`` still waiting for their lookup, for the
        table's next update to name; None when there are none.

        Returns:
            (keys, plan): ``plan`` says which prefetch each range of ``keys`` is
            (:meth:`patch` takes it back).
        """
        waiting = self.waiting(name)
        if not waiting:
            return None
        plan, start = [], 0
        for p in waiting:
            plan.append((p, start, start + len(p.keys)))
            start += len(p.keys)
        return np.concatenate([p.keys for p in waiting]), plan

    def patch(self, name: str, plan, answers) -> None:
        """Apply what the owners answered for the watched keys (:meth:`watched`).

        Args:
            answers: ``(positions in the watched keys, their rows now, positions of keys
                no longer held)`` per owner; the rows may also be a callable giving them
                later (a read still on its way).
        """
        for p, lo, hi in plan:
            for pos, rows, gone in answers:
                mine = (pos >= lo) & (pos < hi)
                drop = np.unique(gone[(gone >= lo) & (gone < hi)] - lo)
                drop = drop[p.ok[drop]]
                if drop.size:
                    if p.unpin is not None:
                        p.unpin(drop)
                    p.ok[drop] = False
                    self.stats["voided_rows"] += len(drop)
                if mine.any():
                    self._write(p, pos[mine] - lo, rows, mine)

    def _write(self, p: Prefetch, at, rows, mine) -> None:
        def write():
            got = rows() if callable(rows) else rows
            p.rows[at] = got[mine]
        p.after_arrival(write)
        self.stats["patched_rows"] += len(at)

    def void(self, name: str, keys) -> None:
        """Rows ``keys`` of ``name`` were written outside an update (or are gone): leave
        them to their lookup, which reads them again."""
        for p in self._by.get(name, ()):
            hit, at = p.positions(keys)
            at = np.unique(at[hit])
            self.stats["voided_rows"] += len(at)
            if p.unpin is not None and len(at):
                p.unpin(at)
            p.ok[at] = False

    def refetch(self, name: str, written, read) -> None:
        """Rows ``written`` (arrays of keys) of ``name`` were written by an update with
        no reply (async): its prefetched rows among them are patched with ``read(keys)``
        (a read sent now, behind the update; it returns a callable giving the rows)."""
        watched = self.watched(name)
        if watched is None:
            return
        keys, plan = watched
        at = np.flatnonzero(np.isin(keys, np.concatenate([np.empty(0, np.int64)] +
                                                         list(written))))
        if len(at):
            self.patch(name, plan, [(at, read(keys[at]), np.empty(0, np.int64))])

    def stepped(self, name: str) -> None:
        """Table ``name`` was updated: release the prefetches its lookups used."""
        q = self._by.get(name)
        while q and q[0].used:
            self._release(q.popleft())

    def drop(self, name: Optional[str] = None) -> None:
        """Forget every prefetch of ``name`` (of every table when None)."""
        for n in [name] if name is not None else list(self._by):
            for p in self._by.pop(n, ()):
                self._release(p)

    def _release(self, p: Prefetch) -> None:
        if p.unpin is not None:
            p.unpin(np.flatnonzero(p.ok))
            p.unpin = None


class Watch:
    """One update's question about the rows prefetched for the coming lookups of its
    table: each owner's Update names its share of those keys (``watch``) and its reply
    ends with the ones the update wrote, as they are after it, and the ones it no longer
    holds; :meth:`peel` takes that answer off each reply, :meth:`patch` applies them.

    Args:
        prefetches: the client's :class:`Prefetches`.
        name: the table.
        requests: ``{sid: Update}`` of one step of the table (their ``watch`` set here).
        router, num_servers: the table's router and the job's server count.
    """

    def __init__(self, prefetches: Prefetches, name: str, requests, router, num_servers):
        self.prefetches, self.name = prefetches, name
        self.watched = prefetches.watched(name)
        self.at, self.answers = {}, []
        if self.watched is None:
            return
        routes, _ = route(router, self.watched[0], num_servers)
        for sid, r in routes.items():
            m = requests.get(sid)
            if m is not None:  # a server not updated wrote none of them (not exact)
                m.watch, m.watch_parts, m.watch_counts = r.ids, r.parts, r.counts
                self.at[sid] = r.positions

    def peel(self, sid, frame) -> None:
        """Take server ``sid``'s answer off the end of its reply ``frame``.

        Raises:
            KVStoreError: a reply without a well-formed answer, naming server and table.
        """
        at = self.at.get(sid)
        if at is None:
            return
        a = frame.arrays
        if len(a) < 3 or any(x.dtype != np.int64 or x.ndim != 1 for x in (a[-3], a[-1])) \
                or a[-2].shape[:1] != a[-3].shape or \
                any(len(x) and (x.min() < 0 or x.max() >= len(at)) for x in (a[-3], a[-1])):
            raise KVStoreError(f"server {sid}: update reply without its answer to the "
                               f"prefetched rows of {self.name!r}")
        self.answers.append((at[a[-3]], a[-2], at[a[-1]]))
        frame.arrays = a[:-3]

    def patch(self) -> None:
        """Apply every owner's answer to the prefetched rows."""
        if self.watched is not None:
            self.prefetches.patch(self.name, self.watched[1], self.answers)
