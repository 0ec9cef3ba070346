"""Table specs: everything needed to make a table's stores, as plain data, by kind.

Each kind's spec lives beside its store (``HashTableSpec`` in :mod:`distemb.stores.hash`,
``FileTableSpec`` in :mod:`distemb.stores.file`); this module is their registry. A spec
is what a trainer sends a server (:meth:`fields`, checked again by
:func:`spec_from_fields` on the server), so each shard's store is made where it lives,
from validated data. The kinds (:data:`SPECS`, the store registry):

- :class:`HashTableSpec` (``"hash"``): a dynamic table, any int64 key, one
  :class:`~distemb.stores.hash.HashStore` per shard, keys routed by key hash. dim, row
  dtype, the per-key initialiser as a :class:`~distemb.stores.init.KeyInit` spec,
  capacity, eviction policy, low water and rounding. ``capacity`` is the whole table's:
  with ``S`` shards each holds at most ``ceil(capacity / S)`` keys and evicts on its own
  (per-server LRU/LFU order).
- :class:`FileTableSpec` (``"file"``): keys 0..N-1 on memory-mapped files (tables larger
  than RAM), one :class:`~distemb.stores.file.FileStore` per shard under
  ``path/part-<p>-of-<S>``, keys routed by ranges, or by a partition policy given as
  ``partition`` (range, hash or DGL's; partition q on shard q % S).

Each spec says how its keys are routed (:meth:`router`) and what its stores can do
(:attr:`fixed_keys`: no remove or evict; :attr:`persistent`).

Example:
    >>> from distemb.stores import key_normal
    >>> spec = HashTableSpec(4, init=key_normal(4, std=0.1), capacity=10, evict="lfu")
    >>> spec_from_fields(spec.fields()) == spec
    True
    >>> spec.make_store(0, 2).capacity
    5
"""
from distemb.routers import KeyHashRouter, PolicyRouter
from distemb.stores.dense import DenseSpec
from distemb.stores.file import FileTableSpec
from distemb.stores.hash import HashTableSpec

#: The store registry: a spec class per kind of table store.
SPECS = {"dense": DenseSpec, "hash": HashTableSpec, "file": FileTableSpec}


def spec_from_fields(fields):
    """The spec of the kind ``fields["kind"]`` names, from a server's request fields.

    Raises:
        ValueError: an unknown kind, or invalid fields for it.
    """
    kind = fields.get("kind")
    if kind not in SPECS:
        raise ValueError(f"kind: expected one of {sorted(SPECS)}, got {kind!r}")
    return SPECS[kind].from_fields(fields)


class GivenStore:
    """The spec of a table on a store object the user made (``StoreEmbedding(store)``):
    that store is the table's one shard. It lives in this process, so only an embedded
    client holds it (:attr:`portable` is False: a server or another rank cannot make it).

    Args:
        store: the :class:`~distemb.stores.types.RowStore` (the table owns it from then
            on, and closes it with itself).

    Example:
        >>> from distemb.stores import HashStore
        >>> spec = GivenStore(HashStore(4))
        >>> spec.kind, spec.dim, spec.num_keys, spec.router().num_parts
        ('HashStore', 4, None, 1)
    """

    portable = False
    init = None

    def __init__(self, store):
        self.store = store
        self.kind = type(store).__name__
        self.fixed_keys, self.persistent = store.fixed_keys, store.persistent
        self.dim, self.dtype = store.dim, store.dtype
        self.row_shape = tuple(getattr(store, "row_shape", (store.dim,)))
        self.num_keys = store.size() if store.fixed_keys else None
        self.capacity = store.capacity
        self.rounding = store.rounding.value

    def differences(self, other):
        """Never nothing: another table never attaches to a given store object by name."""
        return "a table on a given store object"

    def router(self, num_holders=1):
        """One shard holding every key (the store): keys 0..N-1 at their own index, or
        any key as it is."""
        if self.fixed_keys:
            return PolicyRouter.ranges(self.num_keys, 1)
        return KeyHashRouter(1)

    def make_store(self, part=0, num_holders=1, allocator=None):
        """The store itself (it is the table's one shard)."""
        return self.store

    def fields(self):
        """Refused: a store object cannot be sent to a server.

        Raises:
            TypeError: always, saying to pass a table spec.
        """
        raise TypeError(f"storage: a {self.kind} object lives in this process; a server "
                        "makes its shard's store from a table spec (HashTableSpec, "
                        "FileTableSpec)")
