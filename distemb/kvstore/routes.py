"""How a cluster trainer's requests are split by server: one routine for every table.

A table's router (:mod:`distemb.routers`) puts each key on a shard, shard ``p`` on server
``p % num_servers``; a request to one server names its shards and how many keys fall in
each (:class:`Route`), the keys as the table's keys (each server checks them against the
same router and maps them to its stores' keys).

Example:
    >>> from distemb.routers import PolicyRouter
    >>> routes, _ = route(PolicyRouter.ranges(10, 2), np.array([7, 1, 8]), 2)
    >>> {sid: (r.parts, r.ids.tolist(), r.positions.tolist()) for sid, r in routes.items()}
    {0: ([0], [1], [1]), 1: ([1], [7, 8], [0, 2])}
    >>> take_rows(np.arange(6).reshape(3, 2), np.array([0, 1])).tolist()  # no copy
    [[0, 1], [2, 3]]
"""
from typing import Dict, List, NamedTuple, Tuple

import numpy as np

from distemb.errors import KVStoreError


class Route(NamedTuple):
    """The part of one request that goes to one server."""

    parts: List[int]          # shards of that server the keys fall in, in order
    counts: List[int]         # how many keys fall in each of those shards
    ids: np.ndarray           # the keys, grouped by shard (the table's keys)
    positions: np.ndarray     # where each key sits in the caller's request


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


def reply_rows(sid, frame, route: Route, row_shape, dtype, table: str) -> np.ndarray:
    """The rows of server ``sid``'s reply (``frame``) to the request ``route`` of table
    ``table``: its one array, a row of ``row_shape`` and ``dtype`` per key (a dtype of
    None: any).

    Raises:
        KVStoreError: a reply of another shape or dtype, naming the server and table.
    """
    got = frame.arrays[0] if len(frame.arrays) == 1 else None
    if got is None or got.shape != (len(route.ids),) + tuple(row_shape) or \
            (dtype is not None and got.dtype != dtype):
        raise KVStoreError(f"server {sid}: reply of the wrong shape or dtype for {table!r}")
    return got


def shards_by_server(router, num_servers: int) -> Dict[int, List[int]]:
    """{server id: its shards} of a table routed by ``router`` (shard ``p`` on server
    ``p % num_servers``; a server of none is left out)."""
    by = {}
    for part in range(router.num_parts):
        by.setdefault(part % num_servers, []).append(part)
    return by


def route(router, ids, num_servers: int, mapped=()
          ) -> Tuple[Dict[int, Route], List[Tuple[int, np.ndarray, np.ndarray]]]:
    """Split ``ids`` (the table's keys) by server.

    Args:
        mapped: the shards this trainer reads from shared memory instead (left out).

    Returns:
        ({sid: :class:`Route`}, [(shard, positions, keys)] of the ``mapped`` shards).
    """
    by, shm = {}, []
    for part, (pos, keys) in router.split(ids).items():
        if part in mapped:
            shm.append((part, pos, keys))
        else:
            by.setdefault(part % num_servers, []).append((part, pos, keys))
    routes = {sid: Route([p for p, _, _ in g], [len(k) for _, _, k in g],
                         _joined([k for _, _, k in g]).astype(np.int64, copy=False),
                         _joined([pos for _, pos, _ in g]))
              for sid, g in by.items()}
    return routes, shm
