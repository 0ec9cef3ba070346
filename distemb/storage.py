"""What a table's ``storage=`` makes: the :class:`~distemb.tensor.DistTensor` of a
table on row stores (a hash table by default, a file table's spec, a spec of any
registered store, or a store object), checked against the table's other arguments.

Example:
    >>> from distemb.context import DistContext
    >>> from distemb.enums import Rounding
    >>> t = store_tensor(None, 4, "users", None, None, DistContext.embedded(), None,
    ...                  "float32", Rounding.NEAREST, None)
    >>> t.name
    'users'
"""
from distemb.enums import Rounding
from distemb.rules import check_name
from distemb.stores import RowStore
from distemb.stores.spec import SPECS, FileTableSpec, GivenStore, HashTableSpec
from distemb.tensor import DistTensor


def store_tensor(num_embeddings, dim, name, init_func, part_policy, context, device,
                 dtype, rounding, storage):
    """The DistTensor of a table on row stores, made (or attached) in the context's
    client; the arguments are :class:`~distemb.embedding.DistEmbedding`'s.

    Raises:
        ValueError: an empty ``name``; an argument the storage contradicts (its dim,
            dtype, rounding, key count), a partition policy on a store that cannot take one, a GPU
            device for a store other than a hash table, or an ``init_func`` beside a
            storage with its own.
        TypeError: ``storage`` is neither a RowStore nor a table spec; a ``name`` that
            is not a str.
        DistEmbError: the context is closed.
    """
    check_name(name)
    if part_policy is not None:
        if not isinstance(storage, FileTableSpec):
            kind = "hash" if storage is None else getattr(storage, "kind",
                                                          type(storage).__name__)
            raise ValueError(f"part_policy: a {kind} store takes no partition policy (a hash "
                             f"table is routed by its keys' hash; a store object is one "
                             f"shard: pass a FileTableSpec), got {part_policy!r}")
        storage = storage.partitioned_by(part_policy)
    on_device = device is not None and str(device) != "cpu"
    if on_device and storage is not None and not isinstance(storage, HashTableSpec):
        kind = getattr(storage, "kind", type(storage).__name__)
        raise ValueError(f"device: a GPU holds dense and hash tables; a {kind} table's rows "
                         f"live in host memory or on the servers: look them up onto a GPU "
                         f"with emb(ids, device=...), got device={device!r}")
    if storage is None:
        storage = HashTableSpec(dim, dtype=dtype, init=init_func, rounding=rounding.value)
    elif init_func is not None:
        raise ValueError("init_func: a table on a given storage uses the storage's own "
                         "initialiser; pass it to the spec (or store) instead")
    if isinstance(storage, RowStore):
        storage = GivenStore(storage)
    elif not isinstance(storage, tuple(SPECS.values())):
        raise TypeError(f"storage: expected a RowStore, or a table spec of "
                        f"{sorted(c.__name__ for c in SPECS.values())}, got "
                        f"{type(storage).__name__}")
    fixed = storage.num_keys
    if storage.dim != dim:
        raise ValueError(f"storage: holds rows of dim {storage.dim}, embedding_dim is {dim}")
    if dtype != "float32" and dtype != storage.dtype:
        raise ValueError(f"dtype: the storage holds {storage.dtype} rows, got dtype {dtype!r}")
    # as dtype: the default ('nearest') means the storage's own rounding
    stored = Rounding.parse(storage.rounding, "rounding", ValueError)
    if rounding is not Rounding.NEAREST and rounding is not stored:
        raise ValueError(f"rounding: the storage rounds {stored.value!r}, got rounding "
                         f"{rounding.value!r}")
    if num_embeddings is not None and num_embeddings != fixed:
        what = f"the keys 0..{fixed - 1}" if fixed else "any int64 key"
        raise ValueError(f"num_embeddings: the storage holds {what}; expected "
                         f"{fixed if fixed else None}, got {num_embeddings!r}")
    # a GPU's client holds hash tables with their rows there (the index on the host); a
    # closed context has no client: refused before a store is made
    return DistTensor.of_spec(storage, name, context, device, part_policy)
