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
from distemb.stores.file import FileTableSpec
from distemb.stores.hash import HashTableSpec

#: The store registry: a spec class per kind of table store.
SPECS = {"hash": HashTableSpec, "file": FileTableSpec}


def spec_from_fields(fields):
    """The spec of the kind ``fields["kind"]`` names, from a server's request fields.

    Raises:
        ValueError: an unknown kind, or invalid fields for it.
    """
    kind = fields.get("kind")
    if kind not in SPECS:
        raise ValueError(f"kind: expected one of {sorted(SPECS)}, got {kind!r}")
    return SPECS[kind].from_fields(fields)
