"""Routers: which shard holds a table's key, and the key's name inside that shard.

One interface, two implementations, so every client splits requests the same way
whatever the table's key space:

- :class:`PolicyRouter`: keys 0..N-1 sharded by a :class:`~distemb.partition.
  PartitionPolicy` (range, hash, or DGL's partition book): a shard's keys are its local
  ids 0..n-1, so a dense or file store holds exactly its part of the rows.
- :class:`KeyHashRouter`: any int64 key, on shard ``key_partition(key, P)``; a shard
  keeps the keys themselves (hash stores).

Messages carry global keys; the shard's owner checks :meth:`Router.owns` and turns them
into its store's keys with :meth:`Router.to_local` (and back with :meth:`Router.to_global`
when it exports or saves), so a checkpoint holds global keys and loads under any count
of shards.

Example:
    >>> import numpy as np
    >>> r = PolicyRouter.ranges(10, 2)
    >>> {p: (pos.tolist(), k.tolist()) for p, (pos, k) in r.split(np.array([7, 1])).items()}
    {0: ([1], [1]), 1: ([0], [7])}
    >>> r.to_local(1, np.array([7])).tolist(), r.to_global(1, np.array([2])).tolist()
    ([2], [7])
"""
import abc
from functools import cached_property
from typing import Dict, Optional, Tuple

import numpy as np

from distemb.kernels.hashtable import keys_array, table_keys
from distemb.partition import PartitionPolicy, key_partition, range_policy

#: {shard: (positions in the request, the global keys it holds)}.
Split = Dict[int, Tuple[np.ndarray, np.ndarray]]


class Router(abc.ABC):
    """Keys of one table -> shards (see the module docstring).

    Attributes:
        num_parts: the number of shards.
    """

    num_parts: int

    @abc.abstractmethod
    def part_of(self, keys: np.ndarray) -> np.ndarray:
        """(N,) int64 shard of each key.

        Raises:
            PartitionError: a key outside a fixed key space.
        """

    @abc.abstractmethod
    def to_local(self, part: int, keys: np.ndarray) -> np.ndarray:
        """Keys of shard ``part`` as its store's keys."""

    @abc.abstractmethod
    def to_global(self, part: int, local: np.ndarray) -> np.ndarray:
        """Store keys of shard ``part`` as the table's keys."""

    @property
    def num_keys(self) -> Optional[int]:
        """Keys 0..N-1 of a fixed key space: N; None for any int64 key."""
        return None

    @cached_property
    def identity(self) -> bool:
        """Whether the table is one shard whose store keys are the table's keys (start
        0, step 1): a request's keys need no routing or mapping, and the store's own
        range check is the table's (asked once: a router does not change)."""
        return self.num_parts == 1 and self.progression(0) == (0, 1)

    def check(self, keys: np.ndarray, what: str = "keys") -> None:
        """Refuse keys this table cannot hold: PartitionError for a key outside a fixed
        key space (ValueError for a key a hash index reserves)."""
        if self.num_keys is not None:
            self.part_of(keys)

    def progression(self, part: int) -> Optional[Tuple[int, int]]:
        """(start, step) when store key ``k`` of shard ``part`` is the table's key
        ``start + step * k`` (a checkpoint then needs no keys segment), else None."""
        return None

    def key_range(self, part: int) -> Optional[Tuple[int, int]]:
        """``(start, stop)`` when shard ``part`` holds exactly the keys ``start <= key <
        stop`` as store keys ``key - start`` (a range partition), else None."""
        return None

    def inside(self, keys: np.ndarray) -> np.ndarray:
        """Bool mask: the keys inside the key space (all of them for any int64 key)."""
        keys = np.asarray(keys, np.int64)
        if self.num_keys is None:
            return np.ones(keys.shape, bool)
        return (keys >= 0) & (keys < self.num_keys)

    def owns(self, part: int, keys: np.ndarray) -> np.ndarray:
        """Bool mask: the keys shard ``part`` holds (keys outside the key space: False)."""
        keys = np.asarray(keys, np.int64)
        if self.num_keys is not None:
            inside = self.inside(keys)
            mask = np.zeros(keys.shape, bool)
            mask[inside] = self.part_of(keys[inside]) == part
            return mask
        return self.part_of(keys) == part

    def split(self, keys: np.ndarray) -> Split:
        """Group ``keys`` by shard: {shard: (positions in ``keys``, its keys)}; positions
        ascend within each (one shard touched: all of them, in order)."""
        keys = keys_array(keys)
        if not len(keys):
            return {}
        if self.num_parts == 1:
            self.check(keys)
            return {0: (np.arange(len(keys)), keys)}
        owner = self.part_of(keys)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(self.num_parts + 1))
        return {p: (order[lo:hi], keys[order[lo:hi]])
                for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo}


class KeyHashRouter(Router):
    """Any int64 key, on shard ``key_partition(key, num_parts)``; stores keep the keys.

    Example:
        >>> KeyHashRouter(2).part_of(np.array([0, 1, -1])).tolist()
        [1, 1, 0]
    """

    def __init__(self, num_parts: int):
        self.num_parts = int(num_parts)

    def part_of(self, keys):
        self.check(keys)
        return key_partition(keys, self.num_parts)

    def to_local(self, part, keys):
        return keys

    def to_global(self, part, local):
        return local

    def check(self, keys, what="keys"):
        """ValueError for a key the hash index reserves (every other int64 key goes)."""
        table_keys(keys, what)

    def __repr__(self):
        return f"KeyHashRouter({self.num_parts})"


class PolicyRouter(Router):
    """Keys 0..N-1 sharded by a partition policy; a shard's store keys are its local ids.

    With ``num_shards`` other than the policy's partition count, partition ``p`` goes to
    shard ``p % num_shards``, whose store keys run over its partitions in turn (those of
    partition ``p`` from the sizes of the partitions before it there): any policy on any
    number of shards, one store each.

    Args:
        policy: the :class:`~distemb.partition.PartitionPolicy` (range, hash or DGL's).
        num_shards: the number of shards (None: one per partition).

    Example:
        >>> PolicyRouter.ranges(10, 2).owns(1, np.array([4, 5, 10])).tolist()
        [False, True, False]
        >>> from distemb.partition import HashPartitionBook, NodePartitionPolicy
        >>> r = PolicyRouter(NodePartitionPolicy(HashPartitionBook(3, node_counts={"_N": 7})), 2)
        >>> r.part_of(np.arange(7)).tolist(), [r.part_size(s) for s in range(2)]
        ([0, 1, 0, 0, 1, 0, 0], [5, 2])
        >>> r.to_local(0, np.array([0, 2, 5])).tolist(), r.to_global(0, np.arange(5)).tolist()
        ([0, 3, 4], [0, 3, 6, 2, 5])
    """

    def __init__(self, policy: PartitionPolicy, num_shards: Optional[int] = None):
        self.policy = policy
        parts = policy.num_partitions
        self.num_parts = parts if num_shards is None else int(num_shards)
        if self.num_parts < 1:
            raise ValueError(f"num_shards: expected >= 1, got {num_shards!r}")
        self._folded = self.num_parts != parts
        if self._folded:
            sizes = np.array([policy.get_part_size(p) for p in range(parts)], np.int64)
            shard = np.arange(parts) % self.num_parts
            self._offset = np.zeros(parts, np.int64)  # partition p's first store key
            self._sizes = np.zeros(self.num_parts, np.int64)
            for p in range(parts):
                self._offset[p] = self._sizes[shard[p]]
                self._sizes[shard[p]] += sizes[p]
            progressions = [policy.id_progression(p) for p in range(parts)]
            self._start = np.array([a for a, _, _ in progressions], np.int64)
            self._step = np.array([b for _, b, _ in progressions], np.int64)

    @classmethod
    def ranges(cls, num_keys: int, num_parts: int) -> "PolicyRouter":
        """Keys 0..num_keys-1 in ``num_parts`` near-equal ranges."""
        return cls(range_policy(num_keys, num_parts))

    @property
    def num_keys(self):
        return self.policy.get_size()

    def part_size(self, part: int) -> int:
        """Keys shard ``part`` holds."""
        return int(self._sizes[part]) if self._folded else self.policy.get_part_size(part)

    def check(self, keys, what="keys"):
        self.policy.check_ids(np.asarray(keys, np.int64), what)

    def part_of(self, keys):
        self.check(keys)
        if self.num_parts == 1:  # every key is in the one shard: no search
            return np.zeros(len(keys), np.int64)
        owner = self.policy.to_partid(keys)
        return owner % self.num_parts if self._folded else owner

    def progression(self, part):
        if self._folded:
            return None
        try:
            start, step, _ = self.policy.id_progression(part)
        except NotImplementedError:
            return None
        return int(start), int(step)

    def key_range(self, part):
        progression = self.progression(part)
        if progression is None or progression[1] != 1:
            return None
        return progression[0], progression[0] + self.part_size(part)

    def to_local(self, part, keys):
        if self.policy.ids_are_local():  # one partition numbered as the keys: no search
            return np.asarray(keys, np.int64)
        local = self.policy.to_local(keys).astype(np.int64, copy=False)
        if self._folded:
            local = local + self._offset[self.policy.to_partid(keys)]
        return local

    def to_global(self, part, local):
        local = np.asarray(local, np.int64)
        if not self._folded:
            start, step, _ = self.policy.id_progression(part)
            return start + step * local
        mine = np.arange(part, self.policy.num_partitions, self.num_parts)
        p = mine[np.searchsorted(self._offset[mine], local, side="right") - 1]
        return self._start[p] + self._step[p] * (local - self._offset[p])

    def __repr__(self):
        shards = f", num_shards={self.num_parts}" if self._folded else ""
        return f"PolicyRouter({self.policy!r}{shards})"
