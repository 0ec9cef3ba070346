"""How a cluster trainer's requests are split by server (a mixin of
:class:`~distemb.kvstore.remote.RemoteKVClient`).

One routine for every table: an array table's ids go by its partition policy, partition
``p`` to server ``p % num_servers``, as ids local to their partition; a keyed table's keys
go by its router (:mod:`distemb.routers`), shard ``s`` to server ``s``, as the table's
keys (the server checks them against the same router). A request to one server names its
shards and how many ids fall in each (:class:`Route`).

Example:
    >>> take_rows(np.arange(6).reshape(3, 2), np.array([0, 1])).tolist()  # no copy
    [[0, 1], [2, 3]]
    >>> Route([0], [2], np.array([5, 9]), np.array([1, 0])).counts
    [2]
"""
from typing import List, NamedTuple

import numpy as np

from distemb.kernels.hashtable import table_keys


class Route(NamedTuple):
    """The part of one request that goes to one server."""

    parts: List[int]          # shards of that server the ids fall in, in order
    counts: List[int]         # how many ids fall in each of those shards
    ids: np.ndarray           # the ids as the server takes them, grouped by shard: local
    #                           to their partition (an array table), or the table's keys
    #                           (a keyed table: the server checks them against its router)
    positions: np.ndarray     # where each id sits in the caller's request


def _joined(arrays):
    """``arrays`` concatenated (one of them: itself, no copy)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def take_rows(rows, positions):
    """``rows[positions]``, without the copy when the positions are all rows in order."""
    n = len(positions)
    if n == len(rows) and (n == 0 or (positions[0] == 0 and positions[-1] == n - 1 and
                                      bool((np.diff(positions) == 1).all()))):
        return rows[:n]
    return rows[positions]


class Routing:
    """Requests split by server; see the module docstring. The client has
    ``num_servers``, ``_meta`` (array tables), ``_routers`` (keyed tables), ``_shm``
    (mapped shards) and ``is_keyed``."""

    def _parts_by_server(self, policy):
        by = {}
        for part in range(policy.num_partitions):
            by.setdefault(part % self.num_servers, []).append(part)
        return by

    def _shards(self, name):
        """{server id: its shards of table ``name``}: an array table's partitions
        (partition ``p`` on server ``p % num_servers``), a keyed table's one store per
        server (shard ``s`` on server ``s``)."""
        if self.is_keyed(name):
            return {sid: [sid] for sid in range(self.num_servers)}
        return self._parts_by_server(self._meta_of(name).policy)

    def _checked_ids(self, table, ids, policy=True):
        """``ids`` of ``table`` as int64: a keyed table's keys checked by
        :func:`~distemb.kernels.hashtable.table_keys`, an array table's ids against its
        policy unless ``policy`` is False (the servers check them again: an update's
        ids are left to them, on the hot path).

        Raises:
            PartitionError: an id outside an array table's 0..N-1.
            TypeError, ValueError: keys that are not int64 keys of a hash table.
        """
        if self.is_keyed(table):
            return table_keys(ids)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if policy:
            self._meta_of(table).policy.check_ids(ids, f"ids of {table!r}")
        return ids

    def _route(self, table, ids, skip_shm=False):
        """Split ``ids`` of ``table`` by server (see :meth:`_shards`), by the table's
        partition policy or its router.

        Returns:
            ({sid: :class:`Route`}, [(shard, positions, ids as sent)] of the shards read
            from shared memory when ``skip_shm``).
        """
        if self.is_keyed(table):
            groups = [(s, pos, k) for s, (pos, k) in self._routers[table].split(ids).items()]
        else:
            groups = self._meta_of(table).policy.split(ids)
        by, shm = {}, []
        for part, pos, sent in groups:
            if skip_shm and (table, part) in self._shm:
                shm.append((part, pos, sent))
            else:
                by.setdefault(part % self.num_servers, []).append((part, pos, sent))
        routes = {sid: Route([p for p, _, _ in g], [len(i) for _, _, i in g],
                             _joined([i for _, _, i in g]).astype(np.int64, copy=False),
                             _joined([pos for _, pos, _ in g]))
                  for sid, g in by.items()}
        return routes, shm

    def _shard_rows(self, table, part, ids):
        """Rows of shard ``part`` of ``table`` that ``ids`` (as sent) are, as a mapped
        shard or an early answer indexes them: an array table's local ids, a keyed
        table's keys mapped by its router."""
        return self._routers[table].to_local(part, ids) if self.is_keyed(table) else ids
