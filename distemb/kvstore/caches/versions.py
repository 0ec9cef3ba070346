"""The versioned protocol of a trainer cache (:mod:`distemb.kvstore.caches.trainer`)
over a :class:`~distemb.kvstore.remote.RemoteKVClient`'s routing and connections.

The servers keep a version per row (:meth:`KVServer.versions
<distemb.kvstore.server.kvserver.KVServer.versions>`): :func:`pull_versioned` sends the
versions a cache holds and gets back only the rows (and, optionally, their optimizer
state) whose version differs; :func:`push_update_held` is an exact update that names
the rows a cache holds, whose owners answer what keeps the copies equal to their rows.
"""
from typing import NamedTuple

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kvstore.routes import route
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


def pull_versioned(client, name, ids, have, states=()):
    """The rows of ``ids`` whose version on their server differs from ``have``.

    Args:
        client: the :class:`~distemb.kvstore.remote.RemoteKVClient`.
        name: the table; ids: its keys.
        have: int64 version held of each row; -1: not held and not to be kept (the
            row only), -2: not held, to be kept (the row and its states).
        states: optimizer state names (e.g. ``["sum"]``) to return with kept rows.

    Returns:
        (positions in ``ids``, their current versions, their rows, [state rows of the
        positions whose ``have`` is not -1, in order]).
    """
    table = client.table(name)
    shape = table.row_shape
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    table.router.check(ids, f"ids of {name!r}")
    have = np.ascontiguousarray(have, dtype=np.int64)
    routes, _ = route(table.router, ids, client.num_servers)
    got = {}

    def take(sid, frame):
        a, pos = frame.arrays, routes[sid].positions
        n = a[0].shape[0] if a else -1
        if len(a) != 3 + len(states) or a[0].dtype != np.int64 or a[1].shape[0] != n or \
                a[2].shape != (n,) + shape or n > len(pos) or \
                (n and (a[0].min() < 0 or a[0].max() >= len(pos))):
            raise KVStoreError(f"server {sid}: versioned pull reply of the wrong shape")
        got[sid] = (pos[a[0]], a[1], a[2], a[3:])

    client.servers.call({sid: VersionedPull(name=name, parts=r.parts, counts=r.counts,
                                            states=list(states), ids=r.ids,
                                            have=have[r.positions])
                         for sid, r in routes.items()}, on_reply=take)
    parts = [got[sid] for sid in routes]
    if not parts:
        return (np.empty(0, np.int64), np.empty(0, np.int64),
                np.empty((0,) + shape, half.storage_dtype(table.dtype)), [])
    if len(parts) == 1:
        return parts[0][0], parts[0][1], parts[0][2], list(parts[0][3])
    return (np.concatenate([g[0] for g in parts]), np.concatenate([g[1] for g in parts]),
            np.concatenate([g[2] for g in parts]),
            [np.concatenate([g[3][i] for g in parts]) for i in range(len(states))])


def push_update_held(client, name, ids, grads, rule, hyper, have):
    """An exact update of table ``name`` naming the rows a cache holds (``have``: the
    version of each, -1 for rows it does not hold); the owners answer, after summing the
    step, what keeps the held copies equal to their rows.

    Returns:
        a :class:`HeldRows`.

    Raises:
        KVStoreError: the job's updates are not exact.
    """
    requests, routes = client.update_requests(name, ids, grads, rule, hyper, have=have)
    held = HeldReplies({sid: r.positions for sid, r in routes.items()}, grads.shape[1])
    client.send_update(name, requests, held.take)
    return held.result()
