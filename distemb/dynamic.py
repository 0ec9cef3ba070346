"""Tables on row stores: DynamicEmbedding (any int64 key) and StoreEmbedding (any store).

Both are :class:`~distemb.embedding.DistEmbedding` s to the optimizers: lookups are
traced the same way, and ``step()`` sums duplicate gradients and hands them to the
table's client, a :class:`~distemb.kvstore.store_client.StoreClient`, which runs the
rule on the store's columns. Every optimizer works unchanged, with the same kernels: a
dynamic table whose keys are 0..N-1 gives bit-identical rows to a dense table.

Placement is the context's: embedded, the table is one store in this process
(:class:`~distemb.kvstore.store_client.StoreKVClient`); in a cluster (``distemb-launch``)
a DynamicEmbedding is one hash store per server, keys sharded by
:func:`~distemb.partition.key_partition`
(:class:`~distemb.kvstore.store_remote.RemoteStoreClient`), its initialiser sent to the
servers as a spec (``key_normal``/``key_uniform``). A StoreEmbedding over a given store
object is embedded only.

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
import json
import os
import zipfile

import numpy as np

from distemb.context import current_context
from distemb.embedding import DEFAULT_TRACE_LIMIT, DistEmbedding, _positive_int
from distemb.errors import StoreError
from distemb.kernels.hashtable import keys_array
from distemb.stores import RowStore
from distemb.stores.spec import SPECS, HashTableSpec


SAVE_FORMAT = "distemb-store-table"


class StoreTensor:
    """The rows of a store-backed table: ``t[keys]`` looks up, ``t[keys] = rows`` upserts.

    Args:
        client: the table's :class:`~distemb.kvstore.store_client.StoreClient`.
        name: the table's name in it.
        context: the :class:`~distemb.context.DistContext` (backend, threads).

    Example:
        >>> import torch
        >>> emb = DynamicEmbedding(2, name="doc-store-tensor")
        >>> emb.weight[torch.tensor([5])] = torch.ones(1, 2)
        >>> emb.weight[torch.tensor([5])]
        tensor([[1., 1.]])
    """

    def __init__(self, client, name, context):
        self._client, self._name, self._ctx = client, name, context
        self._dim = client.dim(name)

    def lookup(self, ids, client=None):
        """The flat int64 keys and their rows, shaped as ``ids`` + (dim,) (as DistTensor).

        Args:
            ids: integer keys, any shape.
            client: the client (or a view of it) placing the rows; the table's by default.
        """
        client = client or self._client
        F = self._ctx.F
        flat, shape = client.ids_in(self._name, ids, F)
        rows = client.rows_out(client.pull(self._name, flat), F)
        return flat, F.reshape(rows, tuple(shape) + (self._dim,))

    def __getitem__(self, idx):
        return self.lookup(idx)[1]

    def __setitem__(self, idx, values):
        F = self._ctx.F
        flat, _ = self._client.ids_in(self._name, idx, F)
        self._client.push(self._name, flat,
                          self._client.values_in(self._name, values, F, len(flat)))

    @property
    def shape(self):
        """(keys held, dim): the row count changes as keys come and go."""
        return (self._client.size(self._name), self._dim)

    @property
    def name(self):
        return self._name

    @property
    def part_policy(self):
        return None

    @property
    def context(self):
        return self._ctx

    @property
    def client(self):
        return self._client

    @property
    def device(self):
        return None

    def __len__(self):
        return self._client.size(self._name)


class StoreEmbedding(DistEmbedding):
    """A learnable table whose rows live in row stores: a given store, or stores made
    from a spec wherever the table's shards live.

    Use it for a file-backed table (``FileStore``: larger than RAM, persistent) or any
    store; :class:`DynamicEmbedding` is the hash-keyed one. Ids are the store's keys.
    A store object lives in this process (embedded only); a spec
    (:class:`~distemb.stores.spec.FileTableSpec`, :class:`~distemb.stores.spec.
    HashTableSpec`) also runs on a cluster's servers, each making its own shard's store
    (a file table's shards hold ranges of its keys, under ``path/part-<p>-of-<S>``).

    Args:
        store: the RowStore holding rows and optimizer state (the table owns it now),
            or a table spec.
        name: the table's name (fresh when None).
        context: the :class:`~distemb.context.DistContext` (default: the current one).
        trace_limit: as :class:`~distemb.embedding.DistEmbedding`.

    Raises:
        KVStoreError: a store object in a cluster's context (it lives in one process:
            pass a spec, or use :class:`DynamicEmbedding`, a hash store per server).
        TypeError: ``store`` is neither a RowStore nor a table spec.

    Example:
        >>> import tempfile, torch
        >>> from distemb.stores import FileStore
        >>> emb = StoreEmbedding(FileStore(tempfile.mkdtemp(), num_rows=10**6, dim=8))
        >>> emb(torch.tensor([999_999])).shape
        torch.Size([1, 8])
        >>> emb.close()  # flushes the files
    """

    def __init__(self, store, name=None, context=None, trace_limit=DEFAULT_TRACE_LIMIT):
        if isinstance(store, RowStore):
            make = lambda client, name: client.add_table(name, store)  # noqa: E731
        elif isinstance(store, tuple(SPECS.values())):
            make = lambda client, name: client.create_table(name, store)  # noqa: E731
        else:
            raise TypeError(f"store: expected a RowStore, or a table spec of "
                            f"{sorted(c.__name__ for c in SPECS.values())}, got "
                            f"{type(store).__name__}")
        self._setup(make, name, context, trace_limit)

    def _setup(self, make, name, context, trace_limit):
        """Make the table with ``make(client, name)`` in the context's store client."""
        self._trace_limit = _positive_int(trace_limit, "trace_limit")
        ctx = context or current_context()
        name = name or ctx.new_name(type(self).__name__.lower())
        client = ctx.client.store_client()
        make(client, name)
        self._tensor = StoreTensor(client, name, ctx)
        self._client = client
        self._F = ctx.F
        self._trace = []
        self._optm_state = None

    @property
    def store(self):
        """The RowStore holding this table (embedded tables only).

        Raises:
            AttributeError: the table is sharded over a cluster's servers.
        """
        if not hasattr(self._client, "store"):
            raise AttributeError(f"{self.name!r} is sharded over {self._client.num_servers} "
                                 "servers: it has no one store in this process")
        return self._client.store(self.name)

    def size(self):
        """Keys held (over every server)."""
        return self._client.size(self.name)

    @property
    def capacity(self):
        """Keys held at most (None: unbounded)."""
        return self._client.capacity(self.name)

    def export(self):
        """``{"keys": int64 ascending, "weight": rows, <state name>: state rows}`` (from
        every server; the weight as float32).

        Optimizer step counts live in the optimizer (``opt.state_dict()``), not here.
        """
        keys, cols = self._client.export(self.name)
        return {"keys": keys, **cols}

    def import_(self, data):
        """Upsert what :meth:`export` returned (the optimizer's state columns must exist
        here when the data has them: create the optimizer first).

        Raises:
            StoreError: ``data`` lacks ``"keys"``, or a column is unknown or misshapen.
        """
        if "keys" not in data:
            raise StoreError(f"data: expected a dict with 'keys' and columns, got keys "
                             f"{sorted(data)}")
        cols = {k: np.asarray(v) for k, v in data.items() if k != "keys"}
        self._client.import_(self.name, keys_array(np.asarray(data["keys"]), "keys"), cols)

    def save(self, path):
        """Write :meth:`export` (keys, rows as float32, optimizer state) to ``path`` (.npz),
        atomically: a failed save leaves an earlier file at ``path`` untouched.

        The optimizer's step counts and hyperparameters are in ``opt.state_dict()``.
        """
        data = self.export()
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **{f"c/{k}": v for k, v in data.items()},
                         meta=np.frombuffer(json.dumps(
                             {"format": SAVE_FORMAT, "dim": self.embedding_dim,
                              "columns": sorted(data)}).encode(), np.uint8))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load(self, path):
        """Upsert the rows and state saved by :meth:`save` (create the optimizer first when
        the file has optimizer state: its columns must exist here).

        Raises:
            StoreError: ``path`` is not such a file, or its dim or columns do not fit.
        """
        try:
            with np.load(path) as z:
                meta = json.loads(z["meta"].tobytes().decode())
                data = {k[2:]: z[k] for k in z.files if k.startswith("c/")}
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise StoreError(f"path: {path} is not a saved table ({e})") from None
        if meta.get("format") != SAVE_FORMAT or meta.get("dim") != self.embedding_dim:
            raise StoreError(f"path: {path} holds format {meta.get('format')!r} with dim "
                             f"{meta.get('dim')}, expected {SAVE_FORMAT!r} with dim "
                             f"{self.embedding_dim}")
        self.import_(data)

    def flush(self):
        """Make completed updates durable (file stores; no-op in memory)."""
        self._client.flush(self.name)

    def close(self):
        """Flush and release the store."""
        self.kvstore.close()

    def __repr__(self):
        return (f"{type(self).__name__}(name={self.name!r}, size={self.size()}, "
                f"embedding_dim={self.embedding_dim}, client={type(self._client).__name__})")


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

    Raises:
        ValueError: ``embedding_dim`` or ``capacity`` not a positive int, an unknown
            ``evict`` policy.
        TypeError: in a cluster, an ``init_func`` that is not a key initialiser spec.

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
                 context=None, trace_limit=DEFAULT_TRACE_LIMIT):
        spec = HashTableSpec(embedding_dim, dtype=dtype, init=init_func, capacity=capacity,
                             evict=evict, low_water=low_water, rounding=rounding)
        self._setup(lambda client, name: client.create_table(name, spec), name, context,
                    trace_limit)

    def _keys(self, keys):
        F = self._F
        return keys_array(F.to_numpy(keys) if F.is_tensor(keys) else keys)

    def upsert(self, keys, rows):
        """Insert or overwrite the rows of ``keys`` (their optimizer state is kept)."""
        self.weight[keys] = rows

    def remove(self, keys):
        """Remove ``keys`` with their optimizer state; returns how many were present."""
        return self._client.remove(self.name, self._keys(keys))

    def contains(self, keys):
        """Bool array: whether each key is held."""
        return self._client.contains(self.name, self._keys(keys))

    def get(self, keys):
        """Rows of ``keys`` without inserting (not traced, not counted for eviction).

        Raises:
            MissingKeyError: a key is not held (never looked up, removed or evicted).
        """
        return self._F.from_numpy(self._client.get(self.name, self._keys(keys)))

    def evict(self, target_size, policy=None):
        """Evict keys by ``policy`` (default: the table's) down to ``target_size``
        (in a cluster, each server down to its even share, by its own order).

        Returns:
            The evicted keys (int64 numpy array).
        """
        return self._client.evict(self.name, target_size, policy)
