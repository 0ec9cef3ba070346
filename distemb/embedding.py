"""DistEmbedding: a sharded embedding table that records a trace while autograd records.

One table class for every storage: dense rows 0..N-1 (the default), any int64 key
(``num_embeddings=None``: a hash table that grows and evicts) or any row store
(``storage=``: a store object, or a spec such as a file-backed table). The rows are one
:class:`~distemb.tensor.DistTensor`, which answers the key-management calls (``size``,
``contains``, ``get``, ``remove``, ``evict``, ``export``, ...) for every table: what a
table's store cannot do is refused naming it.
"""
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from distemb import table_file
from distemb.arrays import GlobalIds, Rows, Tensor, UniqueIds
from distemb.bags import Bags
from distemb.enums import Rounding
from distemb.errors import StoreError, TraceOverflowError
from distemb.kernels.hashtable import keys_array
from distemb.kvstore import KVClient
from distemb.partition import PartitionPolicy
from distemb.storage import store_tensor
from distemb.tensor import DistTensor

DEFAULT_TRACE_LIMIT = 1024
#: Dtypes a table's rows may be stored in.
ROW_DTYPES = ("float32", "bfloat16", "float16")
SAVE_FORMAT = table_file.SAVE_FORMAT


class Lookup(NamedTuple):
    """One traced lookup: the ids, the rows handed out, and the client that placed them.

    Example:
        >>> import torch
        >>> emb = DistEmbedding(4, 2, name="doc-lookup")
        >>> _ = emb(torch.tensor([3, 3]))
        >>> emb.trace[0].ids.tolist(), emb.trace[0].client is emb.kvstore
        ([3, 3], True)
    """

    ids: GlobalIds      # flat ids in ``client``'s arrays
    rows: Tensor        # the rows returned to the caller (their ``.grad`` after backward)
    client: KVClient    # the table's client, or its view on the lookup's device


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what}: expected a positive int, got {value!r}")
    return value


def _check_no_seed(rounding_seed):
    """ValueError unless ``rounding_seed`` is the default 0, for a table on row stores:
    its stores round stochastically from seed 0, and a table spec (what a server makes
    its stores from) carries no seed; one would be ignored."""
    if rounding_seed != 0:
        raise ValueError(f"rounding_seed: a table on row stores takes no seed (its stores "
                         f"round stochastically from seed 0, and the table spec servers "
                         f"make them from carries none); leave it at 0, or use a dense "
                         f"table, got rounding_seed={rounding_seed!r}")


class DistEmbedding:
    """A learnable table of ``num_embeddings`` rows, sparsely updated by distemb optimizers.

    A drop-in for ``dgl.distributed.DistEmbedding``: ``emb(ids)`` returns the rows; while
    autograd records it also appends ``(ids, rows)`` to a trace. The optimizer's
    ``step()`` applies and removes the lookups whose backward has run; ``zero_grad()``
    drops those (gradients of earlier backward passes) and keeps lookups still waiting
    for their backward. Lookups under ``torch.no_grad()`` record nothing.

    Args:
        num_embeddings: number of rows (the table is not tied to a graph's node count), or
            None for a table of any int64 key (a hash table: rows made on first lookup by
            ``init_func(keys)``, removable, evictable).
        embedding_dim: length of each row.
        name: KVStore name, a non-empty str (None: a fresh anonymous name); tables of
            the same name share storage.
        init_func: ``init_func(shape, dtype)`` initialises each shard (zeros when None,
            as in DGL).
        part_policy: sharding of the rows (default: even ranges over the servers; a
            file table's too, with ``storage=FileTableSpec(...)``).
        persistent: keep the table when the objects of it are gone (default: distemb's
            rule: a table lives until its context closes, so a name always means the same
            rows). With False, DGL's rule (:mod:`distemb.dgl`'s default): the table and
            its optimizer state are deleted with the last object of it in the process
            that created it, and re-creating the name starts again from ``init_func``.
        context: the :class:`~distemb.context.DistContext` (default: the current one).
        trace_limit: lookups recorded before a missing ``step()``/``zero_grad()`` raises
            :class:`~distemb.errors.TraceOverflowError` (a warning is issued at half).
        device: where the table lives: None or 'cpu' (host memory or the servers), or a
            CUDA device (embedded contexts only): the table is then one tensor on that GPU,
            looked up and updated there with the CUDA kernels; a hash table (any int64
            key) keeps its rows and state there and its key index on the host.
        dtype: how the rows are stored: float32 (default), or ``torch.bfloat16`` /
            ``torch.float16`` for half the bytes per row, in memory and on the wire
            between trainers and servers. Optimizer state and all maths stay float32;
            each update rounds the new row into 16 bits. Lookups return **float32** rows
            (the exact value of the stored rows), so gradients, the optimizer and the
            user's model stay in float32 (as FBGEMM's ``output_dtype`` beside its
            ``weights_precision``); ``weight[ids] = v`` rounds ``v`` to nearest-even.
            ``init_func`` is called with the table's dtype.
        rounding: a :class:`~distemb.enums.Rounding` or its value: 'nearest' (ties to
            even, deterministic) or 'stochastic' (bfloat16 only: rounds up or down with
            probability by distance, so updates under half a bfloat16 ulp survive in
            expectation). With a ``storage``, the storage's rounding: the default means
            it, another value must be it.
        rounding_seed: the stochastic rounding's seed (dense tables). The random bits
            are a hash of (seed, partition, update call, local row, column): a run is
            reproducible for the same seed, partitioning and sequence of steps, whatever
            the thread count and whether the table is embedded or on servers. A table on
            row stores rounds from seed 0 and refuses another (its spec carries none).
        storage: where the rows live when not in dense shards: a
            :class:`~distemb.stores.RowStore` object (embedded only), or a table spec of
            :data:`~distemb.stores.spec.SPECS` (``HashTableSpec``, ``FileTableSpec``: each
            shard's store made where it lives, embedded or on servers). Its own
            initialiser, dim and dtype are the table's; ``num_embeddings`` must be None or
            the spec's key count.

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device and the CUDA kernels cannot
            run here (not built, CPU-only torch or no GPU; the message says which).
        DistEmbError: ``device`` is a CUDA device in a trainer context of a cluster.
        ValueError: ``dtype`` is not a row dtype, or stochastic rounding of rows other
            than bfloat16; an argument that a table on row stores does not take
            (``part_policy`` but on a file table's spec, a GPU ``device`` but for a
            hash table) or that contradicts its ``storage``.
        TypeError: ``init_func`` of the wrong signature (``(shape, dtype)`` for dense
            rows, ``(keys)`` for a keyed table), a ``storage`` of another type, or a
            ``name`` that is not a str (an empty one is a ValueError).

    Example:
        >>> import torch
        >>> emb = DistEmbedding(10, 4, name="doc-emb",
        ...                     init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
        >>> rows = emb(torch.tensor([1, 1, 7]))
        >>> rows.shape, len(emb.trace)
        (torch.Size([3, 4]), 1)
        >>> from distemb.kernels.cuda import CudaUnavailableError, cuda_available
        >>> try:  # rows on a GPU, gradients summed there by the optimizer
        ...     rows = emb(torch.tensor([1, 1, 7]), device="cuda")
        ... except CudaUnavailableError as e:  # raised before any copy, with the reason
        ...     assert not cuda_available()
    """

    def __init__(self, num_embeddings: Optional[int], embedding_dim: int,
                 name: Optional[str] = None, init_func=None,
                 part_policy: Optional[PartitionPolicy] = None, persistent: bool = True,
                 context=None,
                 trace_limit: int = DEFAULT_TRACE_LIMIT, device=None, dtype="float32",
                 rounding=Rounding.NEAREST, rounding_seed: int = 0, storage=None):
        _positive_int(embedding_dim, "embedding_dim")
        dtype_name = str(dtype).replace("torch.", "")
        if dtype_name not in ROW_DTYPES:
            raise ValueError(f"dtype: expected one of {list(ROW_DTYPES)} (or torch's), got "
                             f"{dtype!r}")
        rounding = Rounding.parse(rounding, "rounding", ValueError)
        # a given storage's rows are of its dtype: its rounding is checked against it
        if rounding is Rounding.STOCHASTIC and dtype_name != "bfloat16" and storage is None:
            raise ValueError(f"rounding: 'stochastic' is for bfloat16 rows, got dtype "
                             f"{dtype_name!r}")
        self._trace_limit = _positive_int(trace_limit, "trace_limit")
        if num_embeddings is None or storage is not None:
            if not persistent:
                raise ValueError("persistent: a table on row stores lives until its context "
                                 "closes or close() is called; persistent=False (DGL's "
                                 "lifetime) is for dense tables")
            _check_no_seed(rounding_seed)
            self._tensor = store_tensor(num_embeddings, embedding_dim, name, init_func,
                                        part_policy, context, device, dtype_name, rounding,
                                        storage)
        else:
            _positive_int(num_embeddings, "num_embeddings")
            seed = rounding_seed if rounding is Rounding.STOCHASTIC else None
            self._tensor = DistTensor((num_embeddings, embedding_dim), dtype_name, name=name,
                                      init_func=init_func, part_policy=part_policy,
                                      persistent=persistent, context=context, device=device,
                                      rounding_seed=seed)
        self._F = self._tensor.context.F
        self._trace: List[Lookup] = []
        self._optm_state: Optional[Dict[str, str]] = None

    def __call__(self, idx: Tensor, device: Any = None) -> Tensor:
        """Rows ``idx`` (int32/int64, any shape) on ``device``; traced while recording.

        Args:
            idx: ids, any shape.
            device: where the rows go (default: where the table lives, 'cpu' for host
                tables). With a CUDA device, the optimizer sums their gradients there.

        Raises:
            CudaUnavailableError: ``device`` is a CUDA device that cannot be used here.
        """
        client = self.kvstore.view_on(device)  # the reason a device is unusable, before a copy
        ids, rows = self._tensor.lookup(idx, client)
        return self._record(ids, rows, client)

    def prefetch(self, idx: Tensor) -> None:
        """Start reading rows ``idx`` (a coming lookup's ids, any shape) while the current
        batch computes; the next lookups of this table take them, exactly as they are
        then (:meth:`KVClient.prefetch <distemb.kvstore.types.KVClient.prefetch>`;
        :class:`~distemb.pipeline.Prefetcher` does it for a dataloader).

        Raises:
            KVStoreError: the table's store evicts keys on its own on servers (a
                prefetched key could be evicted before its lookup).
        """
        flat, _ = self._tensor.lookup_ids(idx)
        self.kvstore.prefetch(self.name, flat)

    def bag(self, ids: Tensor, offsets: Optional[Tensor] = None, mode: str = "sum",
            per_sample_weights: Optional[Tensor] = None, include_last_offset: bool = False,
            padding_idx: Optional[int] = None, device: Any = None) -> Tensor:
        """Pooled rows: one per bag of ids, as ``torch.nn.functional.embedding_bag``
        (:mod:`distemb.bags`: one dedup, one gather-and-reduce pass over the unique rows).

        Traced as one lookup of the bags' unique ids, whose gradients backward sums.

        Args:
            ids: 2-D (B, L), one bag per row; or 1-D, cut into bags at ``offsets``.
            offsets: 1-D ids' bag starts, (B,), or (B + 1,) with ``include_last_offset``.
            mode: 'sum', 'mean' or 'max' (:class:`~distemb.enums.BagMode`).
            per_sample_weights: a weight per id, shaped as ``ids`` (mode 'sum').
            include_last_offset: the last offset ends the last bag.
            padding_idx: an id left out of every bag (its row neither read nor updated).
            device: where the pooled rows go (as :meth:`__call__`'s).

        Returns:
            (B, D) float32 rows (an empty bag's are zeros).

        Raises:
            ValueError, TypeError: see :meth:`distemb.bags.Bags.of`.
            CudaUnavailableError: ``device`` is a CUDA device that cannot be used here.
        """
        client = self.kvstore.view_on(device)
        bags = Bags.of(ids, offsets, mode, per_sample_weights, include_last_offset,
                       padding_idx, self._tensor.fixed_rows)
        flat, rows = self._tensor.lookup(bags.unique, client)
        return bags.pool(self._record(flat, rows, client))

    def _record(self, ids: GlobalIds, rows: Tensor, client: KVClient) -> Tensor:
        """``rows``, traced (with ``ids`` and the client that placed them) while autograd
        records."""
        F = self._F
        if F.is_recording():
            n = len(self._trace)
            if n >= self._trace_limit:
                raise TraceOverflowError(
                    f"DistEmbedding {self.name!r}: {n} lookups recorded without an "
                    "optimizer step() or zero_grad(); call one every iteration, or wrap "
                    "inference in torch.no_grad() (raise trace_limit if this is intended)")
            if n == self._trace_limit // 2:
                warnings.warn(f"DistEmbedding {self.name!r}: {n} lookups recorded since the "
                              "last step()/zero_grad()", ResourceWarning, stacklevel=3)
            rows = F.attach_grad(rows)
            self._trace.append(Lookup(ids, rows, client))
        return rows

    def reset_trace(self) -> None:
        """Forget every recorded lookup, including those still waiting for backward."""
        self._trace = []

    def drop_gradients(self) -> None:
        """Forget the lookups whose backward has run (``zero_grad()``); keep the rest.

        Why not clear everything: ``out = model(x); opt.zero_grad(); loss.backward();
        opt.step()`` (torch's idiom, DGL's examples) calls ``zero_grad()`` between the
        lookup and its backward; that lookup's gradient is the one to apply.
        """
        self._trace = [e for e in self._trace if self._F.grad(e.rows) is None]

    def take_gradients(self) -> Tuple[KVClient, List[GlobalIds], List[Tensor]]:
        """Take the traced gradients whose backward has run, not yet summed.

        Lookups whose backward has not run stay traced (torch semantics: a gradient that
        arrives after step() is applied by the next one); the trace stays bounded.

        Returns:
            ``(client, ids, grads)``: the view of the first such lookup (all lookups of a
            step sum together there, whatever their device; the table's own client when
            there are none), and one flat id array and one gradient per lookup (empty
            lists when there is nothing to apply).
        """
        done = [(e, g) for e in self._trace for g in (self._F.grad(e.rows),) if g is not None]
        self._trace = [e for e in self._trace if self._F.grad(e.rows) is None]
        client = done[0][0].client if done else self.kvstore
        return client, [e.ids for e, _ in done], [g for _, g in done]

    def coalesced_gradients(self) -> Optional[Tuple[KVClient, UniqueIds, Rows]]:
        """Take the traced gradients (:meth:`take_gradients`), summed per id by the client
        that placed the rows.

        Returns:
            ``(client, unique ids, summed gradients)`` for ``client.push_update``, or None
            when there is nothing to push.
        """
        client, ids, grads = self.take_gradients()
        summed = client.coalesce(self.name, ids, grads, self._F)
        return None if summed is None else (client,) + tuple(summed)

    @property
    def trace(self) -> List[Lookup]:
        """Recorded lookups not yet consumed by step() or dropped by zero_grad():
        ``(ids, rows, client)``."""
        return list(self._trace)

    @property
    def name(self):
        return self._tensor.name

    @property
    def num_embeddings(self):
        return self._tensor.shape[0]

    @property
    def embedding_dim(self):
        return self._tensor.shape[1]

    @property
    def part_policy(self):
        return self._tensor.part_policy

    @property
    def weight(self):
        """The :class:`DistTensor` of the rows."""
        return self._tensor

    @property
    def kvstore(self):
        """The KVStore client holding the rows (a device client for a GPU table)."""
        return self._tensor.client

    @property
    def dtype(self):
        """The dtype the rows are stored in (lookups return float32 whatever it is)."""
        return self._tensor.dtype

    @property
    def device(self):
        """The torch device of the table, or None for a host table (numpy rows)."""
        return self._tensor.device

    # -- keys: every kind answers; what a kind cannot do is refused naming it ------------

    def _keys(self, keys):
        F = self._F
        return keys_array(F.to_numpy(keys) if F.is_tensor(keys) else keys)

    def size(self) -> int:
        """Keys held (over every server): N for a dense table."""
        return self._tensor.size()

    @property
    def capacity(self) -> Optional[int]:
        """Keys held at most (None: unbounded)."""
        return self._tensor.capacity

    @property
    def store(self):
        """The RowStore holding this table (embedded tables on a row store only).

        Raises:
            AttributeError: a dense table, or one sharded over a cluster's servers.
        """
        return self._tensor.store

    def upsert(self, keys, rows) -> None:
        """Insert or overwrite the rows of ``keys`` (their optimizer state is kept).

        Raises:
            ValueError: ``rows`` not shaped as ``keys`` + (dim,), nor as one row per key.
        """
        self.weight[keys] = rows

    def remove(self, keys) -> int:
        """Remove ``keys`` with their optimizer state; how many were present.

        Raises:
            StoreError: the table's keys are fixed (dense or file-backed).
        """
        return self._tensor.remove(self._keys(keys))

    def contains(self, keys) -> np.ndarray:
        """Bool array: whether each key is held."""
        return self._tensor.contains(self._keys(keys))

    def get(self, keys) -> Tensor:
        """Rows of ``keys`` without inserting (not traced, not counted for eviction).

        Raises:
            MissingKeyError: a key is not held (never looked up, removed or evicted).
            PartitionError: a key outside a dense table's 0..N-1.
        """
        return self._tensor.get(self._keys(keys))

    def evict(self, target_size: int, policy=None) -> np.ndarray:
        """Evict keys by ``policy`` (default: the table's) down to ``target_size``
        (in a cluster, each server down to its even share, by its own order).

        Returns:
            The evicted keys (int64 numpy array).

        Raises:
            StoreError: the table's keys are fixed (dense or file-backed).
        """
        return self._tensor.evict(target_size, policy)

    def export(self) -> Dict[str, np.ndarray]:
        """``{"keys": int64 ascending, "weight": rows, <state name>: state rows}`` of every
        key held (from every server; the weight as float32).

        Optimizer step counts live in the optimizer (``opt.state_dict()``), not here.
        """
        keys, cols = self._tensor.export(self._optm_state or {})
        return {"keys": keys, **cols}

    def import_(self, data: Dict[str, np.ndarray]) -> None:
        """Upsert what :meth:`export` returned (the optimizer's state columns must exist
        here when the data has them: create the optimizer first).

        Raises:
            StoreError: ``data`` lacks ``"keys"``, or a column is unknown or misshapen.
        """
        if "keys" not in data:
            raise StoreError(f"data: expected a dict with 'keys' and columns, got keys "
                             f"{sorted(data)}")
        cols = {k: np.asarray(v) for k, v in data.items() if k != "keys"}
        self._tensor.import_(keys_array(np.asarray(data["keys"]), "keys"), cols,
                             self._optm_state or {})

    def save(self, path) -> None:
        """Write :meth:`export` (keys, rows as float32, optimizer state) to ``path`` (.npz),
        atomically: a failed save leaves an earlier file at ``path`` untouched.

        The optimizer's step counts and hyperparameters are in ``opt.state_dict()``.
        """
        table_file.write(path, self.export(), self.embedding_dim)

    def load(self, path) -> None:
        """Upsert the rows and state saved by :meth:`save` (create the optimizer first when
        the file has optimizer state: its columns must exist here).

        Raises:
            StoreError: ``path`` is not such a file, or its dim or columns do not fit.
        """
        self.import_(table_file.read(path, self.embedding_dim))

    def flush(self) -> None:
        """Make completed updates durable (file stores; no-op in memory)."""
        self._tensor.flush()

    def close(self) -> None:
        """Flush and release a table on row stores (it leaves its context; a file table
        reopens when made again); nothing for a dense table (released with its context)."""
        self._tensor.close()

    @property
    def optm_state(self) -> Optional[Dict[str, str]]:
        """KVStore names of the optimizer state ({state: name}), set by the optimizer."""
        return self._optm_state

    @optm_state.setter
    def optm_state(self, names: Dict[str, str]) -> None:
        self._optm_state = dict(names)

    def __repr__(self):
        return (f"{type(self).__name__}(name={self.name!r}, num_embeddings="
                f"{self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"dtype={self._tensor.dtype})")
