"""The trainer cache's read of a remote table: only the rows whose version changed.

A mixin of :class:`~distemb.kvstore.remote.RemoteKVClient` (it uses that client's
routing and its one ``_call``), kept apart because only
:class:`~distemb.kvstore.caches.trainer.CachedKVClient` asks for it: the servers keep a version per
row (:meth:`KVServer.versions <distemb.kvstore.server.KVServer.versions>`), the cache sends
the versions it holds and gets back the rows, and optionally their optimizer state, that
differ.
"""
from typing import NamedTuple

import numpy as np

from distemb.enums import Consistency
from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.transport.messages import VersionedPull


class HeldRows(NamedTuple):
    """The answer of an exact update that named the rows a cache holds (``have``).

    Positions are in the update's ids. ``drop``: held rows whose copy is void (written
    outside the step); ``summed``: held rows other trainers' gradients reached too, with
    their ``versions`` after the step and the step's ``sums`` (the summed gradients the
    owner applied). Every other held row had the cache's own gradient alone (its version
    moved by 1).

    Example:
        >>> e = np.empty(0, np.int64)
        >>> HeldRows(e, np.array([3]), np.array([7]), np.ones((1, 2), np.float32)).summed
        array([3])
    """

    drop: np.ndarray
    summed: np.ndarray
    versions: np.ndarray
    sums: np.ndarray


class HeldReplies:
    """Collects :class:`HeldRows` from the servers' replies to one exact update.

    Args:
        positions: {server id: positions, in the update's ids, of the ids sent to it}.
        dim: the row width.

    Example:
        >>> from distemb.transport.base import Frame
        >>> held = HeldReplies({0: np.array([4, 9])}, dim=2)
        >>> held.take(0, Frame(100, "", {}, [np.array([0]), np.array([1]), np.array([8]),
        ...                                  np.ones((1, 2), np.float32)], 0))
        >>> r = held.result(); r.drop.tolist(), r.summed.tolist(), r.versions.tolist()
        ([4], [9], [8])
    """

    def __init__(self, positions, dim):
        self.positions, self.dim, self.parts = positions, dim, []

    def take(self, sid, frame):
        """``on_reply`` of :meth:`RemoteKVClient._call`: check and keep one reply."""
        if sid not in self.positions:
            return
        a, pos = frame.arrays, self.positions[sid]
        if len(a) != 4 or any(x.dtype != np.int64 or x.ndim != 1 for x in a[:3]) or \
                a[1].shape != a[2].shape or a[3].shape != (len(a[1]), self.dim) or \
                a[3].dtype != np.float32 or any(len(x) and (x.min() < 0 or x.max() >= len(
                    pos)) for x in a[:2]):
            raise KVStoreError(f"server {sid}: update reply without the held rows' answer")
        self.parts.append((pos[a[0]], pos[a[1]], a[2], a[3]))

    def result(self):
        if not self.parts:
            e = np.empty(0, np.int64)
            return HeldRows(e, e, e, np.empty((0, self.dim), np.float32))
        return HeldRows(*(np.concatenate([p[i] for p in self.parts]) for i in range(4)))


class VersionedPulls:
    """Versioned pulls over a RemoteKVClient's connections (see the module docstring).

    Example:
        >>> from distemb.kvstore.remote import RemoteKVClient
        >>> issubclass(RemoteKVClient, VersionedPulls)  # cache.py calls it on that client
        True
    """

    def pull_versioned(self, name, ids, have, states=()):
        """The rows of ``ids`` whose version on their server differs from ``have``.

        Args:
            name: the table; ids: global ids.
            have: int64 version held of each row; -1: not held and not to be kept (the
                row only), -2: not held, to be kept (the row and its states).
            states: optimizer state names (e.g. ``["sum"]``) to return with kept rows.

        Returns:
            (positions in ``ids``, their current versions, their rows, [state rows of the
            positions whose ``have`` is not -1, in order]).
        """
        self._check_open()
        _, shape, dtype = self._rows(name)
        ids = self._checked_ids(name, ids)
        have = np.ascontiguousarray(have, dtype=np.int64)
        routes, _ = self._route(name, ids)
        got = {}

        def take(sid, frame):
            a, pos = frame.arrays, routes[sid].positions
            n = a[0].shape[0] if a else -1
            if len(a) != 3 + len(states) or a[0].dtype != np.int64 or a[1].shape[0] != n or \
                    a[2].shape != (n,) + shape or n > len(pos) or \
                    (n and (a[0].min() < 0 or a[0].max() >= len(pos))):
                raise KVStoreError(f"server {sid}: versioned pull reply of the wrong shape")
            got[sid] = (pos[a[0]], a[1], a[2], a[3:])

        self._call({sid: VersionedPull(name=name, parts=r.parts, counts=r.counts,
                                       states=list(states), ids=r.ids,
                                       have=have[r.positions])
                    for sid, r in routes.items()}, on_reply=take)
        parts = [got[sid] for sid in routes]
        if not parts:
            return (np.empty(0, np.int64), np.empty(0, np.int64),
                    np.empty((0,) + shape, half.storage_dtype(dtype)), [])
        if len(parts) == 1:
            return parts[0][0], parts[0][1], parts[0][2], list(parts[0][3])
        return (np.concatenate([g[0] for g in parts]), np.concatenate([g[1] for g in parts]),
                np.concatenate([g[2] for g in parts]),
                [np.concatenate([g[3][i] for g in parts]) for i in range(len(states))])

    def _check_have(self, have):
        """Whether updates are exact; KVStoreError if ``have`` is given and they are not."""
        exact = self.consistency == Consistency.SYNC_EXACT
        if have is not None and not exact:
            raise KVStoreError(f"have: the held rows' versions go with sync_exact updates "
                               f"only (a step summed at the owner); consistency is "
                               f"{self.consistency.value!r}")
        return exact
