"""A partition policy as plain data, and back: how a table's partitioning travels to the
servers in its spec (:func:`policy_layout`, :func:`layout_policy`) and through JSON.

A layout is ``("range", bounds)`` for a book of ranges (DGL partition configs load as
one), ``("hash", P)`` for ``id % P``, or ``("progressions", ((start, step, count), ...))``
for any other book, from its partitions' id progressions (:class:`ProgressionBook`
rebuilds it).

Example:
    >>> layout = policy_layout(range_policy(10, 2))
    >>> layout, layout_policy(json_layout(layout_json(layout)), 10).to_partid([0, 7]).tolist()
    (('range', (0, 5, 10)), [0, 1])
"""
import json

import numpy as np

from distemb.enums import PartitionKind
from distemb.errors import PartitionError
from distemb.partition import (NODE, HashPartitionBook, PartitionBook, PartitionPolicy,
                               RangePartitionBook, range_policy)  # noqa: F401 (the example)


class ProgressionBook(PartitionBook):
    """One type whose partition ``p`` holds the ids ``start_p + step_p * arange(count_p)``:
    the shape every book's :meth:`~PartitionBook.id_progression` gives, so a policy of any
    book (one a graph partitioner numbers backwards, say) travels to servers as one.

    Example:
        >>> book = ProgressionBook([(9, -1, 10)])
        >>> book.to_local("node", "_N", np.array([0, 9])).tolist()
        [9, 0]
    """

    def __init__(self, progressions, kind=NODE, type_name="_N"):
        self._parts = [tuple(int(v) for v in p) for p in progressions]
        self.num_partitions = len(self._parts)
        self._type = (PartitionKind.parse(kind, "kind", PartitionError), type_name)
        self._count = sum(c for _, _, c in self._parts)

    def types(self, kind):
        return [self._type[1]] if kind == self._type[0] else []

    def num_ids(self, kind, type_name):
        self.check_type(kind, type_name)
        return self._count

    def _place(self, ids):
        ids = np.asarray(ids, np.int64)
        part, local = np.full(ids.shape, -1, np.int64), np.zeros(ids.shape, np.int64)
        for p, (start, step, count) in enumerate(self._parts):
            q = (ids - start) // step
            hit = (q * step == ids - start) & (q >= 0) & (q < count)
            part[hit], local[hit] = p, q[hit]
        return part, local

    def to_partid(self, kind, type_name, ids):
        return self._place(ids)[0]

    def to_local(self, kind, type_name, ids):
        return self._place(ids)[1]

    def part_size(self, kind, type_name, part):
        return self._parts[part][2]

    def id_progression(self, kind, type_name, part):
        self.check_type(kind, type_name)
        return self._parts[part][:2]


def policy_layout(policy):
    """Policy ``policy`` as plain data a server can rebuild it from (:func:`layout_policy`):
    ``("range", bounds)`` for a book of ranges (DGL partition configs included),
    ``("hash", P)`` for ``id % P``, or ``("progressions", ((start, step, count), ...))``
    for any other book, from its partitions' id progressions.

    Raises:
        ValueError: a policy of a book that does not give its id progressions, named.

    Example:
        >>> policy_layout(range_policy(10, 2))
        ('range', (0, 5, 10))
    """
    book = getattr(policy, "partition_book", None)
    if type(book) is RangePartitionBook:
        return ("range", tuple(int(b) for b in book.bounds(policy.kind, policy.type_name)))
    if type(book) is HashPartitionBook:
        return ("hash", int(book.num_partitions))
    try:
        return ("progressions", tuple(tuple(int(v) for v in policy.id_progression(p))
                                      for p in range(policy.num_partitions)))
    except (NotImplementedError, AttributeError):
        raise ValueError(f"part_policy: expected a policy whose book gives its partitions' "
                         f"id progressions (PartitionBook.id_progression; a "
                         f"RangePartitionBook and a HashPartitionBook do), got {policy!r} "
                         f"of a {type(book).__name__}") from None


def layout_json(layout):
    """Layout ``layout`` (:func:`policy_layout`) as JSON has it: lists."""
    return None if layout is None else json.loads(json.dumps(layout))


def json_layout(raw):
    """The layout :func:`layout_json` made (tuples again, so layouts compare equal)."""
    if isinstance(raw, list) and len(raw) == 2 and isinstance(raw[1], list):
        return (raw[0], tuple(tuple(v) if isinstance(v, list) else v for v in raw[1]))
    return tuple(raw) if isinstance(raw, list) else raw


def layout_policy(layout, num_ids):
    """The policy over ids 0..num_ids-1 that :func:`policy_layout` described as
    ``layout`` (a list or a tuple; JSON makes lists).

    Raises:
        ValueError: a malformed layout, or one of another number of ids.
    """
    kind, arg = layout if isinstance(layout, (list, tuple)) and len(layout) == 2 else \
        (None, None)
    if kind == "range" and isinstance(arg, (list, tuple)) and len(arg) >= 2 and \
            all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in arg):
        if arg[-1] != num_ids:
            raise ValueError(f"partition: its ranges cover ids 0..{int(arg[-1]) - 1}, the "
                             f"table has {num_ids} rows")
        try:
            book = RangePartitionBook(len(arg) - 1, node_bounds={"_N": list(arg)})
        except PartitionError as e:
            raise ValueError(f"partition: {e}") from None
        return PartitionPolicy(NODE, "_N", book)
    if kind == "hash" and isinstance(arg, (int, np.integer)) and not isinstance(arg, bool) \
            and arg >= 1:
        return PartitionPolicy(NODE, "_N", HashPartitionBook(int(arg), node_counts={"_N": num_ids}))
    if kind == "progressions" and isinstance(arg, (list, tuple)) and arg and all(
            isinstance(p, (list, tuple)) and len(p) == 3 and p[1] != 0 and p[2] >= 0
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in p)
            for p in arg):
        if sum(int(p[2]) for p in arg) != num_ids:
            raise ValueError(f"partition: its progressions hold {sum(int(p[2]) for p in arg)} "
                             f"ids, the table has {num_ids} rows")
        return PartitionPolicy(NODE, "_N", ProgressionBook(arg))
    raise ValueError(f"partition: expected ('range', ascending bounds from 0), ('hash', "
                     f"P >= 1) or ('progressions', [[start, step != 0, count >= 0], ...]), "
                     f"got {layout!r:.80}")
