"""What changed in one shard since its last saves: what an incremental save writes.

A shard that has made or loaded a checkpoint keeps a *mark* of it: the save's id, its
row versions then (the shard's write counters,
:meth:`ShardTable.versions <distemb.kvstore.server.shard.ShardTable.versions>`, by slot),
the columns it holds and where the log of removed keys stood. A delta against that save
is the rows whose version moved since (a version only grows: every write of a row or of
its state adds to it, and a key inserted into a slot starts above every version the
shard has issued) and the keys removed or evicted since. Two marks are kept: a delta's
parent and the delta itself, or the newest and a full save, so a save that died before
its manifest was written leaves the mark of the save that is still the head.

Memory: each mark holds a copy of the versions (8 bytes a row, 16 with two marks); the
log holds each key removed since the oldest mark (8 bytes a key).

Concurrency: the shard calls :meth:`Changes.removed` under its write lock and takes a
:meth:`Changes.snapshot` under its read lock, so a snapshot sees every removal before
it and none after; the marks and the log have their own lock.

Example:
    >>> c = Changes()
    >>> c.mark("aa00bb11", c.snapshot(np.array([3, 5])), {"weight"})
    >>> c.removed(np.array([-7]))
    >>> m = c.since("aa00bb11", {"weight"}, "shard 0 of 't'")
    >>> (np.array([3, 6]) != m.versions).tolist(), c.removed_since(m).tolist()
    ([False, True], [-7])
"""
import threading
from typing import NamedTuple

import numpy as np

from distemb.errors import KVStoreError


class Snapshot(NamedTuple):
    """A shard's versions (by slot) and the place in its removal log, taken together."""

    versions: np.ndarray
    removed_at: int


class Mark(NamedTuple):
    """A save as a shard made or loaded it: a :class:`Snapshot` and its columns."""

    versions: np.ndarray
    removed_at: int
    columns: frozenset


class Changes:
    """The marks of one shard's saves and the keys removed since (module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._marks = {}  # save id -> Mark, oldest first
        self._log = []  # arrays of the table's keys removed, in order
        self._dropped = 0  # log entries before self._log[0]

    @property
    def tracking(self) -> bool:
        """Whether a save is marked (removals are then logged)."""
        return bool(self._marks)

    def removed(self, keys: np.ndarray) -> None:
        """Log the table's ``keys`` as removed (while a save is marked)."""
        if self._marks:
            with self._lock:
                self._log.append(np.array(keys, dtype=np.int64))

    def snapshot(self, versions: np.ndarray) -> Snapshot:
        """``versions`` (a copy, by slot) and where the log stands now."""
        with self._lock:
            return Snapshot(np.array(versions, dtype=np.int64), self._dropped + len(self._log))

    def mark(self, save_id: str, snap: Snapshot, columns, keep=None) -> None:
        """Mark save ``save_id``, whose rows were read at ``snap``, holding ``columns``;
        the marks kept besides are ``keep``'s (a delta's parent), or else the newest."""
        with self._lock:
            kept = {k: m for k, m in self._marks.items() if k == keep} if keep is not None \
                else dict(list(self._marks.items())[-1:])
            kept.pop(save_id, None)
            kept[save_id] = Mark(snap.versions, snap.removed_at, frozenset(columns))
            self._marks = kept
            start = min(m.removed_at for m in kept.values())
            del self._log[:max(0, start - self._dropped)]
            self._dropped = max(self._dropped, start)

    def forget(self) -> None:
        """Drop every mark (the rows were replaced without a save to mark)."""
        with self._lock:
            self._marks, self._log, self._dropped = {}, [], 0

    def since(self, save_id: str, columns, what: str) -> Mark:
        """The mark of save ``save_id``, holding ``columns``; ``what`` names the shard.

        Raises:
            KVStoreError: no mark of that save here, or one of fewer columns.
        """
        with self._lock:
            mark = self._marks.get(save_id)
            have = sorted(self._marks)
        if mark is None:
            raise KVStoreError(f"incremental save: {what} did not make or load save "
                               f"{save_id}, the checkpoint's last (it knows {have}), so what "
                               "changed since is unknown here; make a full save")
        missing = sorted(set(columns) - mark.columns)
        if missing:
            raise KVStoreError(f"incremental save: {what} saved or loaded columns "
                               f"{sorted(mark.columns)} at save {save_id}, not {missing}; "
                               "make a full save")
        return mark

    def removed_since(self, mark: Mark) -> np.ndarray:
        """The distinct keys removed since ``mark``."""
        with self._lock:
            logged = self._log[max(0, mark.removed_at - self._dropped):]
        return np.unique(np.concatenate(logged)) if logged else np.empty(0, np.int64)
