"""DistTensor: a named, row-sharded tensor; ``t[ids]`` pulls, ``t[ids] = v`` pushes.

:class:`StoreTensor` is the same for a table on row stores (any int64 key for a hash
table): ``t[keys]`` looks up, ``t[keys] = rows`` upserts.

Where the rows live is the business of the tensor's KVClient (DESIGN.md, placement): the
tensor hands the caller's tensors to ``client.ids_in``/``values_in`` and the pulled rows
to ``client.rows_out``, on one path for every placement.
"""
from typing import Dict, Optional, Tuple

import numpy as np

from distemb.arrays import (DENSE_INIT, GlobalIds, Shape, Tensor, check_init_func,
                            check_table_shape)
from distemb.context import current_context
from distemb.errors import KVStoreError, StoreError
from distemb.kvstore import KVClient
from distemb.partition import PartitionPolicy, range_policy
from distemb.rules import check_name, check_table_name, state_name, state_owner

# DGL's optimizers name their state "<table>_sum" (Adagrad) and "<table>_mem",
# "<table>_power", "<table>_step" (Adam); code written for DGL attaches to those names.
DGL_STATE_SUFFIXES = {"_sum": "sum", "_mem": "exp_avg", "_power": "exp_avg_sq",
                      "_step": "row_step"}


def _resolve_name(client: KVClient, name: Optional[str]) -> Optional[str]:
    """``name``, or the optimizer state it means in DGL's naming when only that exists."""
    if name is None or client.data_meta(name) is not None:
        return name
    for suffix, state in DGL_STATE_SUFFIXES.items():
        if name.endswith(suffix):
            alias = state_name(name[:-len(suffix)], state)
            if client.data_meta(alias) is not None:
                return alias
    return name


class NamedRows:
    """What every tensor of rows has: a name in its client, a context, a storage dtype.

    Subclasses (:class:`DistTensor`, :class:`StoreTensor`) set ``_name``, ``_ctx``,
    ``_client`` and ``_dtype`` (a dtype name).

    Example:
        >>> import torch
        >>> t = DistTensor((4, 2), torch.bfloat16, name="doc-named-rows")
        >>> isinstance(t, NamedRows), t.name, t.dtype
        (True, 'doc-named-rows', torch.bfloat16)
    """

    _name: str
    _dtype: str

    @property
    def name(self):
        return self._name

    @property
    def dtype(self):
        """The dtype the rows are stored in (half rows are read and written as float32)."""
        return self._ctx.F.dtype(self._dtype)

    @property
    def context(self):
        return self._ctx

    @property
    def client(self):
        """The KVClient holding the rows (a device client for a GPU-resident tensor)."""
        return self._client


class DistTensor(NamedRows):
    """A tensor sharded by rows across the KVStore, addressed by global row ids.

    Args:
        shape: (rows, ...) of the whole tensor: ints (an int alone: one dimension).
        dtype: element type (torch, numpy or string dtype).
        name: KVStore name, a non-empty str; an existing tensor of that name (same shape
            and dtype) is attached instead of created. Anonymous when None. DGL's names
            of optimizer state (``"<table>_sum"``, ``"_mem"``, ``"_power"``, ``"_step"``)
            attach to that state when no tensor of the name itself exists (a
            compatibility alias).
        init_func: ``init_func(shape, dtype)`` returns the initial values of one shard.
        part_policy: how rows are sharded (default: even ranges over the servers).
        persistent: keep the data after the objects of it are garbage collected. A
            non-persistent tensor is deleted (with any optimizer state of it) when the
            last object of it in the process that created it is gone, so re-creating it
            by name starts again from ``init_func`` (DGL's rule); objects that attached
            to an existing tensor never delete it. With several trainers the deletion is
            collective, like the creation: each trainer drops its last object of the
            tensor at the same point of its program.
        context: the :class:`~distemb.context.DistContext` (default: the current one).
        device: where the rows live: None or 'cpu' (host memory, or the servers of a
            cluster), or a CUDA device ('cuda', 'cuda:N'; embedded contexts only): the
            whole tensor is then one torch tensor on that GPU, ``t[ids]`` returns rows
            there, and names are looked up among that device's tensors only.
        rounding_seed: for a bfloat16 tensor that an optimizer updates, round updates
            stochastically from this seed (None: to nearest-even). See DistEmbedding.

    A tensor of dtype bfloat16 or float16 stores (and sends between processes) its rows
    in 16 bits, but reads and writes them as float32: ``t[ids]`` returns float32 rows,
    ``t[ids] = v`` takes float32 (or the tensor's own dtype) and rounds to nearest-even.

    ``t[ids]`` takes integer ids of any shape or a ``slice`` of rows; ``t[ids] = v``
    takes ``v`` shaped as the ids + the row shape, or (number of ids,) + the row shape.

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device and the CUDA kernels cannot
            run here (not built, CPU-only torch or no GPU; the message says which).
        DistEmbError: ``device`` is a CUDA device in a trainer context of a cluster.
        TypeError: ``part_policy`` is not a distemb policy (DGL's: see distemb.dgl); a
            ``shape`` that is not ints (a float, a str, a bool); a ``name`` that is not
            a str.
        ValueError: an empty ``name`` (None makes an anonymous tensor).

    Example:
        >>> import torch
        >>> t = DistTensor((4, 2), torch.float32, name="doc-t")
        >>> t[torch.tensor([1, 3])] = torch.ones(2, 2)
        >>> t[torch.tensor([3])]
        tensor([[1., 1.]])
        >>> from distemb.kernels.cuda import CudaUnavailableError, cuda_available
        >>> try:
        ...     g = DistTensor((4, 2), torch.float32, name="doc-t-gpu", device="cuda")
        ... except CudaUnavailableError:  # no GPU (or no CUDA build) here: says which
        ...     assert not cuda_available()
    """

    def __init__(self, shape, dtype, name: Optional[str] = None, init_func=None,
                 part_policy: Optional[PartitionPolicy] = None, persistent: bool = False,
                 context=None, device=None, rounding_seed: Optional[int] = None):
        check_name(name)
        ctx = context or current_context()
        self._ctx, F = ctx, ctx.F
        self._client = ctx.client_for(device)
        self._shape = check_table_shape(shape)
        self._dtype = F.dtype_name(dtype)
        if part_policy is None:
            part_policy = range_policy(self._shape[0], ctx.num_servers)
        if not isinstance(part_policy, PartitionPolicy):
            raise TypeError(
                f"part_policy: expected a distemb PartitionPolicy, got "
                f"{type(part_policy).__module__}.{type(part_policy).__qualname__} "
                f"{getattr(part_policy, 'policy_str', part_policy)!r}; for DGL's policies use "
                "distemb.dgl (import distemb.dgl as dist), which converts them, or "
                "distemb.integrations.dgl.convert_policy()")
        if part_policy.get_size() != self._shape[0]:
            raise ValueError(f"part_policy: {part_policy.policy_str} has "
                             f"{part_policy.get_size()} ids, but shape[0] is {self._shape[0]}")
        self._policy = part_policy
        self._name = _resolve_name(self._client, name) or ctx.new_name("anonymous")
        self._persistent = persistent
        meta = self._client.data_meta(self._name)
        self._held = False
        if meta is None:
            check_table_name(self._name)  # a new table: not named like optimizer state
            # checked only when it will be called: DGL's own tests pass a policy in its
            # place when they attach to a tensor that exists
            check_init_func(init_func, DENSE_INIT)
            client = self._client
            wrapped = None if init_func is None else (
                lambda s, d: client.tensor_in(init_func(s, F.dtype(d)), F))
            # the seed only when asked for: clients written before it need not take it
            seed = {} if rounding_seed is None else {"rounding_seed": rounding_seed}
            client.init_data(self._name, self._shape, self._dtype, part_policy, wrapped,
                             **seed)
        elif meta.shape != self._shape or meta.dtype != self._dtype:
            raise KVStoreError(f"name {self._name!r} exists with shape {meta.shape} and dtype "
                               f"{meta.dtype}; got shape {self._shape} and dtype {self._dtype}")
        ctx.hold(self._client, self._name, delete_with_last=meta is None and not persistent)
        self._held = True

    def lookup(self, ids: Tensor, client: Optional[KVClient] = None
               ) -> Tuple[GlobalIds, Tensor]:
        """The validated flat ids and the rows ``ids`` (shaped as ``ids`` + row shape).

        Args:
            ids: integer ids, any shape.
            client: the client (or view of it) that places the rows; this tensor's own by
                default. :class:`~distemb.embedding.DistEmbedding` passes the view of the
                device its caller asked for.

        Raises:
            TypeError: ``ids`` is not an integer tensor.
            PartitionError: an id is out of range.
        """
        client = client or self._client
        flat, shape = self.lookup_ids(ids, client)
        rows = client.rows_out(client.pull(self._name, flat), self._ctx.F)
        return flat, self._ctx.F.reshape(rows, shape)

    def lookup_ids(self, ids: Tensor, client: Optional[KVClient] = None
                   ) -> Tuple[GlobalIds, Shape]:
        """The first half of :meth:`lookup`: the validated flat ids, and the shape of the
        rows they will give (a grouped lookup pulls several tables' ids at once)."""
        client = client or self._client
        flat, shape = client.ids_in(self._name, self._rows_of(ids), self._ctx.F)
        return flat, tuple(shape) + self._shape[1:]

    def _rows_of(self, ids):
        """A ``slice`` means the ids of the rows it selects (``t[0:n // 2]``, as DGL)."""
        if isinstance(ids, slice):
            return np.arange(*ids.indices(self._shape[0]), dtype=np.int64)
        return ids

    def __getitem__(self, ids: Tensor) -> Tensor:
        return self.lookup(ids)[1]

    def __setitem__(self, ids: Tensor, values: Tensor) -> None:
        """Write ``values`` to rows ``ids`` (a duplicate id: its last row wins).

        Raises:
            ValueError: ``values`` not shaped as ``ids`` + the row shape, nor as
                (number of ids,) + the row shape.
            TypeError: ``values`` of another dtype than the tensor's (or float32).
        """
        flat, shape = self._client.ids_in(self._name, self._rows_of(ids), self._ctx.F)
        self._client.push(self._name, flat,
                          self._client.values_in(self._name, values, self._ctx.F, shape))

    def __len__(self):
        return self._shape[0]

    def __del__(self):
        try:
            if not self._held or self._ctx.closed:
                return
            if self._ctx.release(self._client, self._name):
                # Collective, as creation is (and as DGL's): every trainer drops its last
                # object at the same point of the program, and nobody re-creates the name
                # before every trainer has stopped using the old rows.
                many = self._ctx.num_trainers > 1
                if many:
                    self._client.barrier()
                states = [n for n in self._client.names() if state_owner(n) == self._name]
                for name in [self._name] + states:
                    self._client.delete_data(name)
                if many:
                    self._client.barrier()
        except Exception:  # interpreter shutdown: the store may already be gone
            pass

    # -- keys: a dense tensor holds the fixed keys 0..N-1 (StoreTensor has the same) -----

    def size(self) -> int:
        """Keys held: all of 0..N-1."""
        return self._shape[0]

    @property
    def capacity(self) -> int:
        """Keys held at most: N."""
        return self._shape[0]

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Bool per key: in 0..N-1."""
        return (keys >= 0) & (keys < self._shape[0])

    def get(self, keys: np.ndarray) -> Tensor:
        """Rows of ``keys`` (as ``t[keys]``; a key outside 0..N-1 is an error)."""
        return self[keys]

    def remove(self, keys: np.ndarray) -> int:
        """Refused: a dense tensor's keys are fixed."""
        raise StoreError(f"remove: {self._name!r} is a dense table of the fixed keys "
                         f"0..{self._shape[0] - 1}; a table with removable keys is "
                         "DistEmbedding(None, dim) (a hash table)")

    def evict(self, target_size: int, policy=None) -> np.ndarray:
        """Refused: a dense tensor's keys are fixed."""
        raise StoreError(f"evict: {self._name!r} is a dense table of the fixed keys "
                         f"0..{self._shape[0] - 1}; only hash tables evict")

    def export(self, states: Dict[str, str]) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        """(keys 0..N-1, {"weight": every row as float32, state: every state row}) of the
        optimizer states ``states`` ({state: KVStore name})."""
        keys = np.arange(self._shape[0], dtype=np.int64)
        F = self._ctx.F
        rows = F.to_numpy(self[F.from_numpy(keys)])
        return keys, {"weight": np.asarray(rows, np.float32),
                      **self._client.table_state(self._name, states)}

    def import_(self, keys: np.ndarray, columns: Dict[str, np.ndarray],
                states: Dict[str, str]) -> None:
        """Write rows ``keys`` of every column of ``columns`` (what :meth:`export` gave).

        Raises:
            StoreError: a column that is neither the weight nor one of ``states``, or
                rows of the wrong count.
        """
        unknown = [c for c in columns if c != "weight" and c not in states]
        if unknown:
            raise StoreError(f"columns: {unknown} not in table {self._name!r} (has "
                             f"{['weight'] + sorted(states)}; create the optimizer first "
                             "to import its state)")
        for c, values in columns.items():
            if len(values) != len(keys):
                raise StoreError(f"columns[{c!r}]: expected {len(keys)} rows, got "
                                 f"{len(values)}")
        F, client = self._ctx.F, self._client
        for c, values in columns.items():
            if c == "weight":
                self[F.from_numpy(keys)] = F.from_numpy(np.ascontiguousarray(values))
            else:
                client.push(states[c], client.from_host(keys),
                            client.from_host(np.ascontiguousarray(values)))

    def flush(self) -> None:
        """Nothing to make durable: a dense tensor lives in memory."""

    def close(self) -> None:
        """Nothing to release alone: a dense tensor is released with its context."""

    @property
    def store(self):
        """Refused: a dense tensor is shards of its client, not one row store."""
        raise AttributeError(f"{self._name!r} is a dense table held by "
                             f"{type(self._client).__name__}: it has no row store")

    @property
    def shape(self):
        return self._shape

    @property
    def part_policy(self):
        return self._policy

    @property
    def fixed_rows(self) -> int:
        """N: the table's keys are 0..N-1."""
        return self._shape[0]

    @property
    def device(self):
        """The torch device of the rows, or None when they are numpy arrays on the host."""
        return self._client.device

    def __repr__(self):
        return f"DistTensor(name={self._name!r}, shape={self._shape}, dtype={self._dtype})"


class StoreTensor(NamedRows):
    """The rows of a store-backed table: ``t[keys]`` looks up, ``t[keys] = rows`` upserts.

    On a table of the fixed keys 0..N-1 (a file table, a dense store) ``t[a:b]`` is the
    rows a..b-1, as a DistTensor's; a hash table's keys are not a range, so it refuses a
    slice.

    Args:
        client: the table's client, one holding keyed tables (:mod:`distemb.kvstore.keyed`).
        name: the table's name in it.
        context: the :class:`~distemb.context.DistContext` (backend, threads).
        dtype: the rows' storage dtype name (they are read and written as float32).
        part_policy: the partition policy a file table was given (None: its store's own
            routing).
        num_rows: N for a table of the fixed keys 0..N-1 (a file table, a dense store),
            whose rows a ``slice`` selects as a DistTensor's; None for a hash table.

    Example:
        >>> import torch
        >>> from distemb.embedding import DistEmbedding
        >>> emb = DistEmbedding(None, 2, name="doc-store-tensor")  # any int64 key
        >>> emb.weight[torch.tensor([5])] = torch.ones(1, 2)
        >>> emb.weight[torch.tensor([5])]
        tensor([[1., 1.]])
    """

    def __init__(self, client, name, context, dtype="float32", part_policy=None,
                 num_rows=None):
        self._client, self._name, self._ctx = client, name, context
        self._dim = client.dim(name)
        self._dtype = dtype
        self._policy = part_policy
        self._num_rows = num_rows

    def _keys_of(self, idx):
        """A ``slice`` means the keys it selects of a table of the fixed keys 0..N-1
        (``t[0:n // 2]``, as a DistTensor's rows).

        Raises:
            TypeError: a slice of a hash table: its keys are not a range.
        """
        if not isinstance(idx, slice):
            return idx
        if self._num_rows is None:
            raise TypeError(f"ids: {self._name!r} is a hash table, whose keys are not a "
                            f"range: a slice selects nothing; pass the keys (an integer "
                            f"tensor), got {idx!r}")
        return np.arange(*idx.indices(self._num_rows), dtype=np.int64)

    def lookup(self, ids, client=None):
        """The flat int64 keys and their rows, shaped as ``ids`` + (dim,) (as DistTensor).

        Args:
            ids: integer keys, any shape, or a ``slice`` of a table of fixed keys.
            client: the client (or a view of it) placing the rows; the table's by default.
        """
        client = client or self._client
        flat, shape = self.lookup_ids(ids, client)
        rows = client.rows_out(client.pull(self._name, flat), self._ctx.F)
        return flat, self._ctx.F.reshape(rows, shape)

    def lookup_ids(self, ids, client=None):
        """The flat int64 keys and the shape of their rows (as DistTensor's)."""
        client = client or self._client
        flat, shape = client.ids_in(self._name, self._keys_of(ids), self._ctx.F)
        return flat, tuple(shape) + (self._dim,)

    def __getitem__(self, idx):
        return self.lookup(idx)[1]

    def __setitem__(self, idx, values):
        """Upsert ``values`` as the rows of keys ``idx`` (as :meth:`DistTensor.__setitem__`
        takes them)."""
        F = self._ctx.F
        flat, shape = self._client.ids_in(self._name, self._keys_of(idx), F)
        self._client.push(self._name, flat,
                          self._client.values_in(self._name, values, F, shape))

    @property
    def shape(self):
        """(keys held, dim): the row count changes as keys come and go."""
        return (self._client.size(self._name), self._dim)

    @property
    def part_policy(self):
        return self._policy

    @property
    def fixed_rows(self) -> Optional[int]:
        """N for a table of the fixed keys 0..N-1 (a file table), None for a hash table."""
        return self._num_rows

    @property
    def device(self):
        """The torch device of the rows (a GPU-resident hash table's), or None on the
        host."""
        return getattr(self._client, "device", None)

    def __len__(self):
        return self._client.size(self._name)

    # -- keys ----------------------------------------------------------------------------

    def size(self) -> int:
        """Keys held (over every server)."""
        return self._client.size(self._name)

    @property
    def capacity(self):
        """Keys held at most (None: unbounded)."""
        return self._client.capacity(self._name)

    def contains(self, keys):
        return self._client.contains(self._name, keys)

    def get(self, keys):
        return self._ctx.F.from_numpy(self._client.get(self._name, keys))

    def remove(self, keys):
        return self._client.remove(self._name, keys)

    def evict(self, target_size, policy=None):
        return self._client.evict(self._name, target_size, policy)

    def export(self, states=None):
        return self._client.export(self._name)

    def import_(self, keys, columns, states=None):
        self._client.import_(self._name, keys, columns)

    def flush(self):
        self._client.flush(self._name)

    def close(self):
        """Flush and release this table's store(s): the table is gone from its context
        (a file store is reopened by making the table again)."""
        self._client.delete_data(self._name)

    @property
    def store(self):
        """The RowStore holding this table (embedded tables only)."""
        if not hasattr(self._client, "store"):
            raise AttributeError(f"{self._name!r} is sharded over "
                                 f"{self._client.num_servers} servers: it has no one store "
                                 "in this process")
        return self._client.store(self._name)
