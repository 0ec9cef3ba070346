"""DynamicEmbedding and StoreEmbedding: the DistEmbedding of a hash table and of a store.

Both are thin: ``DynamicEmbedding(dim, ...)`` is ``DistEmbedding(None, dim,
storage=HashTableSpec(dim, ...))`` and ``StoreEmbedding(store)`` is ``DistEmbedding(None,
store.dim, storage=store)``; the table, its lookups, key management and checkpoints are
:class:`~distemb.embedding.DistEmbedding`'s. ``step()`` sums duplicate gradients and
hands them to the table's client (:mod:`distemb.kvstore.tables`: one path for every
table), which runs the rule on the store's columns. Every optimizer works unchanged, with the
same kernels: a dynamic table whose keys are 0..N-1 gives bit-identical rows to a dense
table.

Placement is the context's: embedded, the table is one store in this process
(:class:`~distemb.kvstore.local.LocalKVClient`); in a cluster (``distemb-launch``)
a DynamicEmbedding is one hash store per server, keys sharded by
:func:`~distemb.partition.key_partition`
(:class:`~distemb.kvstore.remote.RemoteKVClient`), its initialiser sent to the
servers as a spec (``key_normal``/``key_uniform``). A StoreEmbedding over a given store
object is embedded only; over a spec it runs anywhere.

Example:
    >>> import torch
    >>> from distemb import SparseAdagrad
    >>> from distemb.stores import key_normal
    >>> emb = DynamicEmbedding(4, name="doc-dyn", init_func=key_normal(4, std=0.1))
    >>> opt = SparseAdagrad([emb], lr=0.1)
    >>> emb(torch.tensor([10**12, -3, 10**12])).sum().backward(); opt.step()
    >>> emb.size(), sorted(emb.export())
    (2, ['keys', 'sum', 'weight'])
"""
from distemb.embedding import DEFAULT_TRACE_LIMIT, SAVE_FORMAT, DistEmbedding  # noqa: F401
from distemb.stores import RowStore
from distemb.stores.spec import SPECS, HashTableSpec


class StoreEmbedding(DistEmbedding):
    """A learnable table whose rows live in row stores: a given store, or stores made
    from a spec wherever the table's shards live.

    Use it for a file-backed table (``FileStore``: larger than RAM, persistent) or any
    store; :class:`DynamicEmbedding` is the hash-keyed one. Ids are the store's keys.
    A store object lives in this process (embedded only); a spec
    (:class:`~distemb.stores.file.FileTableSpec`,
    :class:`~distemb.stores.hash.HashTableSpec`) also runs on a cluster's servers, each making its own shard's store
    (a file table's shards hold ranges of its keys, under ``path/part-<p>-of-<S>``).

    Args:
        store: the RowStore holding rows and optimizer state (the table owns it now: it
            backs no other table, and is closed with this one), or a table spec.
        name: the table's name (fresh when None).
        context: the :class:`~distemb.context.DistContext` (default: the current one).
        trace_limit: as :class:`~distemb.embedding.DistEmbedding`.

    Raises:
        KVStoreError: a store object in a cluster's context (it lives in one process:
            pass a spec, or use :class:`DynamicEmbedding`, a hash store per server).
        TypeError: ``store`` is neither a RowStore nor a table spec.
        StoreError: a closed store, or one that already backs a table (named).

    Example:
        >>> import tempfile, torch
        >>> from distemb.stores import FileStore
        >>> emb = StoreEmbedding(FileStore(tempfile.mkdtemp(), num_rows=10**6, dim=8))
        >>> emb(torch.tensor([999_999])).shape
        torch.Size([1, 8])
        >>> emb.close()  # flushes the files
    """

    def __init__(self, store, name=None, context=None, trace_limit=DEFAULT_TRACE_LIMIT):
        if not isinstance(store, (RowStore,) + tuple(SPECS.values())):
            raise TypeError(f"store: expected a RowStore, or a table spec of "
                            f"{sorted(c.__name__ for c in SPECS.values())}, got "
                            f"{type(store).__name__}")
        super().__init__(None, store.dim, name=name, context=context,
                         trace_limit=trace_limit, storage=store)


class DynamicEmbedding(StoreEmbedding):
    """A table keyed by arbitrary int64 ids, rows created on first lookup.

    ``emb(ids)`` finds or inserts each key (a new key gets ``init_func(keys)``, a pure
    function of the key: use :func:`~distemb.stores.key_normal` / ``key_uniform`` so that
    every run gives a key the same initial row); ``upsert``, ``remove``, ``export`` /
    ``import_``, ``size()``, ``capacity`` and ``evict`` manage it. Past ``capacity``, a
    lookup evicts down to ``low_water * capacity`` keys by ``evict`` (``"lru"``: least
    recently looked up; ``"lfu"``: looked up in the fewest batches), sparing the keys of
    that lookup; their rows and optimizer state go with them. Every sparse optimizer
    works on it.

    In a cluster (a context made by ``distemb-launch``) the table is sharded over the
    servers by key hash: each key lives on server ``key_partition(key, num_servers)``
    (:func:`~distemb.partition.key_partition`), which inserts it on first lookup with
    the initialiser rebuilt from its spec, so a key's rows are the same whatever the
    server count. Creation is collective (every trainer makes the table, same
    arguments); updates follow the job's consistency (sync, async, sync_exact).

    Args:
        embedding_dim: row length.
        name: table name (fresh when None).
        init_func: ``init_func(keys: int64 (N,)) -> (N, embedding_dim) float32``,
            deterministic per key (zeros when None). In a cluster it must be a
            :func:`~distemb.stores.key_normal` / ``key_uniform`` initialiser (servers
            rebuild it from its spec; a Python function cannot be sent).
        capacity: keys held at most (None: unbounded); in a cluster each of S servers
            holds at most ``ceil(capacity / S)`` and evicts by its own LRU/LFU order.
        evict: ``"lru"`` or ``"lfu"``.
        low_water: fraction of ``capacity`` an automatic eviction goes down to.
        dtype: storage of the rows: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (also
            as torch dtypes); optimizer state and maths stay float32, lookups return
            float32, updates round to nearest-even.
        rounding: ``"nearest"`` or ``"stochastic"`` (bfloat16 rows: unbiased rounding,
            reproducible for any thread count).
        context: the :class:`~distemb.context.DistContext` (embedded).
        trace_limit: as :class:`~distemb.embedding.DistEmbedding`.
        device: where the rows live: None or 'cpu' (host memory, or the servers), or a
            CUDA device (embedded contexts only): rows and optimizer state are then
            tensors on that GPU, updated there, and the key index stays on the host
            (:class:`~distemb.stores.device.DeviceHashStore`).

    Raises:
        ValueError: ``embedding_dim`` or ``capacity`` not a positive int, an unknown
            ``evict`` policy.
        TypeError: in a cluster, an ``init_func`` that is not a key initialiser spec.
        CudaUnavailableError: ``device`` is a CUDA device and the CUDA kernels cannot
            run here (it says why).
        DistEmbError: ``device`` is a CUDA device in a trainer context of a cluster.

    Example:
        >>> import torch
        >>> emb = DynamicEmbedding(3, name="doc-dynamic", capacity=1000, evict="lfu")
        >>> emb(torch.tensor([2**40, 7])).shape, emb.size()
        (torch.Size([2, 3]), 2)
        >>> emb.remove(torch.tensor([7])), emb.size()
        (1, 1)
    """

    def __init__(self, embedding_dim, name=None, init_func=None, capacity=None,
                 evict="lru", low_water=1.0, dtype="float32", rounding="nearest",
                 context=None, trace_limit=DEFAULT_TRACE_LIMIT, device=None):
        spec = HashTableSpec(embedding_dim, dtype=dtype, init=init_func, capacity=capacity,
                             evict=evict, low_water=low_water, rounding=rounding)
        DistEmbedding.__init__(self, None, spec.dim, name=name, context=context,
                               trace_limit=trace_limit, storage=spec, device=device)
