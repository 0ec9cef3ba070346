"""Partition books and policies: global (type-wise) id -> (partition, local id).

A *book* knows, for every node and edge type, how its ids are split across partitions:
:class:`RangePartitionBook` (contiguous ranges, as ``dgl.distributed.partition_graph``
writes them) or :class:`HashPartitionBook` (``id % P``). A *policy* is the view of one
type in one book, the object tables are sharded by.

Example:
    >>> book = RangePartitionBook(2, node_bounds={"_N": [0, 3, 10]})
    >>> pol = NodePartitionPolicy(book)
    >>> pol.to_partid(np.array([0, 5])).tolist(), pol.to_local(np.array([0, 5])).tolist()
    ([0, 1], [0, 2])
"""
import json
import os

import numpy as np

from distemb.config import load_partition_config, read_config_file
from distemb.enums import Book, PartitionKind
from distemb.errors import ConfigError, PartitionError

NODE, EDGE = PartitionKind.NODE, PartitionKind.EDGE


class PartitionBook:
    """Interface: how the ids of each (kind, type) are split over ``num_partitions``."""

    num_partitions: int

    def types(self, kind):
        """Type names of ``kind`` ('node' or 'edge') this book knows."""
        raise NotImplementedError

    def num_ids(self, kind, type_name):
        raise NotImplementedError

    def to_partid(self, kind, type_name, ids):
        raise NotImplementedError

    def to_local(self, kind, type_name, ids):
        raise NotImplementedError

    def part_size(self, kind, type_name, part):
        raise NotImplementedError

    def id_progression(self, kind, type_name, part):
        """(start, step): local id j of ``part`` is global id ``start + j * step``
        (checkpoints store rows by global id with it, so they load into any book)."""
        raise NotImplementedError

    def check_type(self, kind, type_name):
        if type_name not in self.types(kind):
            raise PartitionError(f"{kind} type: expected one of {self.types(kind)}, "
                                 f"got {type_name!r}")


class RangePartitionBook(PartitionBook):
    """Each partition holds one contiguous range of every type's ids.

    Args:
        num_partitions: number of partitions.
        node_bounds: ``{ntype: [0, b1, ..., n]}``, num_partitions+1 ascending type-wise ids.
        edge_bounds: the same for edge types.

    Example:
        >>> RangePartitionBook(2, node_bounds={"_N": [0, 5, 8]}).part_size("node", "_N", 1)
        3
    """

    def __init__(self, num_partitions, node_bounds=None, edge_bounds=None):
        self.num_partitions = int(num_partitions)
        self._bounds = {NODE: {}, EDGE: {}}
        for kind, given in ((NODE, node_bounds or {}), (EDGE, edge_bounds or {})):
            for name, b in given.items():
                b = np.asarray(b, dtype=np.int64)
                if b.shape != (self.num_partitions + 1,) or b[0] != 0 or np.any(np.diff(b) < 0):
                    raise PartitionError(f"{kind}_bounds[{name!r}]: expected "
                                         f"{self.num_partitions + 1} ascending ids from 0, "
                                         f"got {b.tolist()}")
                self._bounds[kind][name] = b

    def types(self, kind):
        return list(self._bounds[kind])

    def bounds(self, kind, type_name):
        """The num_partitions+1 type-wise bounds of ``type_name``."""
        self.check_type(kind, type_name)
        return self._bounds[kind][type_name]

    def num_ids(self, kind, type_name):
        return int(self.bounds(kind, type_name)[-1])

    def to_partid(self, kind, type_name, ids):
        return np.searchsorted(self.bounds(kind, type_name), ids, side="right") - 1

    def to_local(self, kind, type_name, ids):
        b = self.bounds(kind, type_name)
        return ids - b[np.searchsorted(b, ids, side="right") - 1]

    def part_size(self, kind, type_name, part):
        b = self.bounds(kind, type_name)
        return int(b[part + 1] - b[part])

    def id_progression(self, kind, type_name, part):
        """Local id j of ``part`` is global id ``start + j * step``: (start, step)."""
        return int(self.bounds(kind, type_name)[part]), 1


class HashPartitionBook(PartitionBook):
    """Id ``i`` lives in partition ``i % P`` at local id ``i // P``.

    Example:
        >>> HashPartitionBook(3, node_counts={"_N": 10}).part_size("node", "_N", 0)
        4
    """

    def __init__(self, num_partitions, node_counts=None, edge_counts=None):
        self.num_partitions = int(num_partitions)
        self._counts = {NODE: dict(node_counts or {}), EDGE: dict(edge_counts or {})}

    def types(self, kind):
        return list(self._counts[kind])

    def num_ids(self, kind, type_name):
        self.check_type(kind, type_name)
        return int(self._counts[kind][type_name])

    def to_partid(self, kind, type_name, ids):
        return ids % self.num_partitions

    def to_local(self, kind, type_name, ids):
        return ids // self.num_partitions

    def part_size(self, kind, type_name, part):
        n = self.num_ids(kind, type_name)
        return max(0, (n - part + self.num_partitions - 1) // self.num_partitions)

    def id_progression(self, kind, type_name, part):
        """Local id j of ``part`` is global id ``start + j * step``: (start, step)."""
        self.check_type(kind, type_name)
        return int(part), self.num_partitions


class PartitionPolicy:
    """How one node or edge type is sharded: the unit tables are partitioned by.

    Args:
        kind: a :class:`~distemb.enums.PartitionKind` or its value, 'node' or 'edge'.
        type_name: the node/edge type.
        partition_book: a :class:`PartitionBook` that knows the type.
        part_id: the partition local to this process (for :meth:`get_part_size`).

    Example:
        >>> pol = PartitionPolicy("node", "_N", HashPartitionBook(2, node_counts={"_N": 5}))
        >>> pol.policy_str, pol.get_size(), pol.get_part_size(1)
        ('node~_N', 5, 2)
    """

    def __init__(self, kind, type_name, partition_book, part_id=0):
        kind = PartitionKind.parse(kind, "kind", PartitionError)
        partition_book.check_type(kind, type_name)
        if not 0 <= part_id < partition_book.num_partitions:
            raise PartitionError(f"part_id: expected 0..{partition_book.num_partitions - 1}, "
                                 f"got {part_id}")
        self.kind, self.type_name, self.part_id = kind, type_name, part_id
        self.partition_book = partition_book

    @property
    def policy_str(self):
        return f"{self.kind}~{self.type_name}"

    @property
    def num_partitions(self):
        return self.partition_book.num_partitions

    def get_size(self):
        """Number of ids of this type, over all partitions."""
        return self.partition_book.num_ids(self.kind, self.type_name)

    def get_part_size(self, part_id=None):
        """Number of ids in ``part_id`` (default: this process's partition)."""
        part = self.part_id if part_id is None else part_id
        return self.partition_book.part_size(self.kind, self.type_name, part)

    def id_progression(self, part_id):
        """(start, step, count): the global ids of partition ``part_id`` are
        ``start + step * arange(count)``."""
        start, step = self.partition_book.id_progression(self.kind, self.type_name, part_id)
        return start, step, self.get_part_size(part_id)

    def check_ids(self, ids, what="ids"):
        """Raise PartitionError unless every id is in [0, get_size())."""
        # one pass: as unsigned, a negative id is above every size
        if ids.size and int(ids.view(np.uint64).max()) >= self.get_size():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.get_size():
                bad = lo if lo < 0 else hi
                raise PartitionError(f"{what}: id {bad} is out of range for {self.policy_str} "
                                     f"(expected 0 <= id < {self.get_size()})")

    def to_partid(self, ids):
        """Partition of each id (int64 array)."""
        return self.partition_book.to_partid(self.kind, self.type_name, np.asarray(ids))

    def to_local(self, ids):
        """Local id of each id inside its partition (int64 array)."""
        return self.partition_book.to_local(self.kind, self.type_name, np.asarray(ids))

    def split(self, ids):
        """Group ``ids`` by partition.

        Returns:
            list of (part, positions in ids, local ids), one per partition touched;
            positions ascend within each (one partition touched: all of them, in order).
        """
        if self.num_partitions == 1:  # every id is in it, in order: no sort, no search
            if not len(ids):
                return []
            local = np.asarray(ids, np.int64) if self.ids_are_local() else self.to_local(ids)
            return [(0, np.arange(len(ids)), local)]
        parts = self.to_partid(ids)
        local = self.to_local(ids)
        order = np.argsort(parts, kind="stable")
        counts = np.bincount(parts, minlength=self.num_partitions)
        out, start = [], 0
        for part, n in enumerate(counts.tolist()):
            if n:
                pos = order[start:start + n]
                out.append((part, pos, local[pos]))
                start += n
        return out

    def ids_are_local(self):
        """Whether this is one partition whose local ids are the ids themselves (start
        0, step 1; a book that does not say is asked per id)."""
        if self.num_partitions != 1:
            return False
        if getattr(self, "_identity", None) is None:
            try:
                self._identity = self.partition_book.id_progression(
                    self.kind, self.type_name, 0) == (0, 1)
            except NotImplementedError:
                self._identity = False
        return self._identity

    def __eq__(self, other):
        return (isinstance(other, PartitionPolicy) and other.policy_str == self.policy_str
                and other.partition_book is self.partition_book)

    def __hash__(self):
        return hash((self.policy_str, id(self.partition_book)))

    def __repr__(self):
        return (f"{type(self).__name__}({self.policy_str!r}, parts={self.num_partitions}, "
                f"size={self.get_size()})")


class NodePartitionPolicy(PartitionPolicy):
    """Policy of a node type (DGL's ``NodePartitionPolicy``)."""

    def __init__(self, partition_book, ntype="_N", part_id=0):
        super().__init__(NODE, ntype, partition_book, part_id)


class EdgePartitionPolicy(PartitionPolicy):
    """Policy of an edge type (DGL's ``EdgePartitionPolicy``)."""

    def __init__(self, partition_book, etype="_E", part_id=0):
        super().__init__(EDGE, etype, partition_book, part_id)


def range_policy(num_ids, num_partitions=1, name="_N", kind=NODE):
    """A policy splitting ``num_ids`` into ``num_partitions`` near-equal ranges."""
    bounds = np.linspace(0, num_ids, num_partitions + 1).round().astype(np.int64)
    book = RangePartitionBook(num_partitions, **{f"{kind}_bounds": {name: bounds}})
    return PartitionPolicy(kind, name, book)


def _dgl_bounds(raw, path):
    """Type-wise bounds from a DGL ``node_map``/``edge_map`` value of one type."""
    if isinstance(raw, list) and raw and all(isinstance(r, list) and len(r) == 2 for r in raw):
        sizes = [int(end) - int(start) for start, end in raw]
    elif isinstance(raw, list) and all(isinstance(r, int) for r in raw):
        sizes = list(np.diff([0] + raw))  # old homogeneous format: partition end offsets
    else:
        raise ConfigError(f"{path}: expected a list of [start, end] pairs, got {raw!r:.80}")
    if any(s < 0 for s in sizes):
        raise ConfigError(f"{path}: a range ends before it starts: {raw!r:.80}")
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def load_dgl_partition_config(path):
    """Read the JSON written by ``dgl.distributed.partition_graph`` (DGL is not imported).

    Returns:
        (RangePartitionBook, dict of policies keyed by policy_str).

    Raises:
        ConfigError: missing file or fields, or ranges that do not match num_parts.
    """
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such partition config")
    with open(path, encoding="utf-8") as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
    for key in ("num_parts", "node_map", "edge_map"):
        if key not in meta:
            raise ConfigError(f"{path}: {key}: missing (not a DGL partition config?)")
    num_parts = meta["num_parts"]
    maps = {}
    for kind in (NODE, EDGE):
        raw = meta[f"{kind}_map"]
        if isinstance(raw, str):
            raise ConfigError(f"{path}: {kind}_map: a .npy map (DGL < 0.8 format) is not "
                              "supported; re-partition with a newer DGL")
        if isinstance(raw, list):
            raw = {"_N" if kind == NODE else "_E": raw}
        maps[kind] = {}
        for name, value in raw.items():
            b = _dgl_bounds(value, f"{path}: {kind}_map[{name!r}]")
            if len(b) != num_parts + 1:
                raise ConfigError(f"{path}: {kind}_map[{name!r}]: {len(b) - 1} ranges, "
                                  f"but num_parts is {num_parts}")
            maps[kind][name] = b
    book = RangePartitionBook(num_parts, node_bounds=maps[NODE], edge_bounds=maps[EDGE])
    return book, policies_of(book)


def policies_of(book):
    """Every policy of ``book``, keyed by policy_str ('node~user', 'edge~follows')."""
    return {p.policy_str: p for kind in (NODE, EDGE) for t in book.types(kind)
            for p in [PartitionPolicy(kind, t, book)]}


def load_policy_config(path):
    """Read distemb's partition-policy file (schema in :mod:`distemb.config`).

    Returns:
        dict of policies keyed by policy_str.
    """
    cfg = load_partition_config(path)
    ranges = {NODE: {}, EDGE: {}}
    counts = {NODE: {}, EDGE: {}}
    for p in cfg.policies:
        if p.book == Book.RANGE:
            ranges[p.kind][p.type] = p.bounds
        else:
            counts[p.kind][p.type] = p.num_ids
    books = [RangePartitionBook(cfg.num_partitions, ranges[NODE], ranges[EDGE]),
             HashPartitionBook(cfg.num_partitions, counts[NODE], counts[EDGE])]
    policies = {}
    for book in books:
        policies.update(policies_of(book))
    return policies


def load_policies(path):
    """Policies from either a DGL partition config or a distemb policy file."""
    if path.endswith(".json"):
        raw = read_config_file(path)
        if isinstance(raw, dict) and "node_map" in raw:
            return load_dgl_partition_config(path)[1]
    return load_policy_config(path)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x):
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic): a bijection that
    mixes every input bit into every output bit."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def key_partition(keys, num_parts):
    """The partition of each int64 key of a dynamic table: ``splitmix64(key + G) % P``.

    ``G`` is 0x9E3779B97F4A7C15 and the sum wraps modulo 2**64 (the key's two's
    complement bits as uint64). A documented, stable function of the key alone: every
    trainer, every run and every checkpoint reader sends a key to the same one of ``P``
    servers, and sequential or strided keys spread evenly.

    Args:
        keys: (N,) int64 keys.
        num_parts: P >= 1.

    Returns:
        (N,) int64 partition ids in [0, P).

    Example:
        >>> key_partition(np.array([0, 1, -1, 2**62]), 2).tolist()
        [1, 1, 0, 1]
    """
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)) or \
            num_parts < 1:
        raise ValueError(f"num_parts: expected an int >= 1, got {num_parts!r}")
    k = np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)
    if num_parts == 1:
        return np.zeros(k.shape, np.int64)
    with np.errstate(over="ignore"):
        return (splitmix64(k + _GOLDEN) % np.uint64(num_parts)).astype(np.int64)
