"""DistTensor: a named, sharded table of rows; ``t[ids]`` pulls, ``t[ids] = v`` pushes.

One tensor type for every table (DESIGN.md): DGL's dense ``DistTensor`` (rows 0..N-1 of
any row shape and dtype under a partition policy) and a table on row stores (a hash
table of any int64 key, a file table, a store object: :meth:`DistTensor.of_spec`), where
``t[keys]`` looks up (a hash table inserts absent keys) and ``t[keys] = rows`` upserts.
Every one answers the key-management calls (``size``, ``contains``, ``get``, ``remove``,
``evict``, ``export``, ...); what its store cannot do is refused, naming both.

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
from distemb.rules import check_name, check_table_name, state_name
from distemb.stores.dense import DenseSpec

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


class DistTensor:
    """A table of rows sharded across the KVStore, addressed by its keys (DGL's
    ``DistTensor``: global row ids 0..N-1).

    Args:
        shape: (rows, ...) of the whole tensor: ints (an int alone: one dimension).
        dtype: element type (torch, numpy or string dtype).
        name: KVStore name, a non-empty str; an existing tensor of that name (same shape
            and dtype) is attached instead of created. Anonymous when None. DGL's names
            of optimizer state (``"<table>_sum"``, ``"_mem"``, ``"_power"``, ``"_step"``)
            attach to that state when no tensor of the name itself exists (a
            compatibility alias).
        init_func: ``init_func(shape, dtype)`` returns the initial values of one
            partition (it runs in this process: its rows are written where they live).
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
            whole tensor is then one shard on that GPU, ``t[ids]`` returns rows there,
            and names are looked up among that device's tensors only.
        rounding_seed: for a bfloat16 tensor that an optimizer updates, round updates
            stochastically from this seed (None: to nearest-even). See DistEmbedding.

    A tensor of dtype bfloat16 or float16 stores (and sends between processes) its rows
    in 16 bits, but reads and writes them as float32: ``t[ids]`` returns float32 rows,
    ``t[ids] = v`` takes float32 (or the tensor's own dtype) and rounds to nearest-even.

    ``t[ids]`` takes integer ids of any shape, or a ``slice`` of the rows of a table of
    fixed keys; ``t[ids] = v`` takes ``v`` shaped as the ids + the row shape, or (number
    of ids,) + the row shape.

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
        >>> from distemb.stores.hash import HashTableSpec
        >>> h = DistTensor.of_spec(HashTableSpec(2), name="doc-t-hash")  # any int64 key
        >>> h[torch.tensor([2**40])].shape, h.size()
        (torch.Size([1, 2]), 1)
        >>> from distemb.kernels.cuda import CudaUnavailableError, cuda_available
        >>> try:
        ...     g = DistTensor((4, 2), torch.float32, name="doc-t-gpu", device="cuda")
        ... except CudaUnavailableError:  # no GPU (or no CUDA build) here: says which
        ...     assert not cuda_available()
    """

    def __init__(self, shape, dtype, name: Optional[str] = None, init_func=None,
                 part_policy: Optional[PartitionPolicy] = None, persistent: bool = False,
                 context=None, device=None, rounding_seed: Optional[int] = None):
        self._held = False
        check_name(name)
        ctx = context or current_context()
        F = ctx.F
        client = ctx.client_for(device)
        shape = check_table_shape(shape)
        dtype = F.dtype_name(dtype)
        if part_policy is None:
            part_policy = range_policy(shape[0], ctx.num_servers)
        if not isinstance(part_policy, PartitionPolicy):
            raise TypeError(
                f"part_policy: expected a distemb PartitionPolicy, got "
                f"{type(part_policy).__module__}.{type(part_policy).__qualname__} "
                f"{getattr(part_policy, 'policy_str', part_policy)!r}; for DGL's policies use "
                "distemb.dgl (import distemb.dgl as dist), which converts them, or "
                "distemb.integrations.dgl.convert_policy()")
        if part_policy.get_size() != shape[0]:
            raise ValueError(f"part_policy: {part_policy.policy_str} has "
                             f"{part_policy.get_size()} ids, but shape[0] is {shape[0]}")
        name = _resolve_name(client, name) or ctx.new_name("anonymous")
        meta = client.data_meta(name)
        if meta is None:
            check_table_name(name)  # a new table: not named like optimizer state
            # checked only when it will be called: DGL's own tests pass a policy in its
            # place when they attach to a tensor that exists
            check_init_func(init_func, DENSE_INIT)
            wrapped = None if init_func is None else (
                lambda s, d: client.tensor_in(init_func(s, F.dtype(d)), F))
            client.create_table(name, DenseSpec(shape, dtype, part_policy, wrapped,
                                                rounding_seed))
        elif meta.shape != shape or meta.dtype != dtype:
            raise KVStoreError(f"name {name!r} exists with shape {meta.shape} and dtype "
                               f"{meta.dtype}; got shape {shape} and dtype {dtype}")
        self._bind(ctx, client, name, part_policy, persistent, created=meta is None)

    @classmethod
    def of_spec(cls, spec, name: Optional[str] = None, context=None, device=None,
                part_policy: Optional[PartitionPolicy] = None) -> "DistTensor":
        """The tensor of a table made from table spec ``spec``
        (:mod:`distemb.stores.spec`: a hash or file table, a store object), made in the
        context's client for ``device`` or attached to the table of that name made from
        the same spec. It lives until its context closes or :meth:`close` is called.

        Raises:
            KVStoreError: ``name`` exists with another spec, or the placement cannot hold
                the spec's store (naming both).
            DistEmbError: the context is closed.
        """
        check_name(name)
        ctx = context or current_context()
        client = ctx.client_for(device)  # a closed context: refused before a store is made
        name = check_table_name(name or ctx.new_name(spec.kind))
        client.create_table(name, spec)
        tensor = cls.__new__(cls)
        tensor._held = False
        tensor._bind(ctx, client, name, part_policy, persistent=True, created=False)
        return tensor

    @classmethod
    def attach(cls, name: str, context=None, device=None) -> "DistTensor":
        """The tensor of the existing table (or optimizer state) ``name``.

        Raises:
            KVStoreError: no such table or state.
        """
        ctx = context or current_context()
        client = ctx.client_for(device)
        client.tables.rows(name)  # the unknown-name error
        tensor = cls.__new__(cls)
        tensor._held = False
        policy = getattr(client.tables.rows(name)[0].router, "policy", None)
        tensor._bind(ctx, client, name, policy, persistent=True, created=False)
        return tensor

    def _bind(self, ctx, client, name, policy, persistent, created):
        self._ctx, self._client, self._name = ctx, client, name
        self._policy, self._persistent = policy, persistent
        table, _ = client.tables.rows(name)
        self._table = table
        self._column_shape, self._dtype = table.columns()[_column(table, name)]
        ctx.hold(client, name, delete_with_last=created and not persistent)
        self._held = True

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

    @property
    def spec(self):
        """The spec of the table (:mod:`distemb.stores.spec`)."""
        return self._table.spec

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
        # rows of flat ids are shaped already: the tensor itself, not a view of it (a
        # view leaf costs autograd more in the user's loss and backward)
        return flat, rows if tuple(rows.shape) == shape else self._ctx.F.reshape(rows, shape)

    def lookup_ids(self, ids: Tensor, client: Optional[KVClient] = None
                   ) -> Tuple[GlobalIds, Shape]:
        """The first half of :meth:`lookup`: the validated flat ids, and the shape of the
        rows they will give (a grouped lookup pulls several tables' ids at once)."""
        client = client or self._client
        flat, shape = client.ids_in(self._name, self._rows_of(ids), self._ctx.F)
        return flat, tuple(shape) + tuple(self._column_shape)

    def _rows_of(self, ids):
        """A ``slice`` means the keys of the rows it selects (``t[0:n // 2]``, as DGL) of a
        table of the fixed keys 0..N-1.

        Raises:
            TypeError: a slice of a hash table: its keys are not a range.
        """
        if not isinstance(ids, slice):
            return ids
        if self._table.num_keys is None:
            raise TypeError(f"ids: {self._name!r} is a hash table, whose keys are not a "
                            f"range: a slice selects nothing; pass the keys (an integer "
                            f"tensor), got {ids!r}")
        return np.arange(*ids.indices(self._table.num_keys), dtype=np.int64)

    def __getitem__(self, ids: Tensor) -> Tensor:
        return self.lookup(ids)[1]

    def __setitem__(self, ids: Tensor, values: Tensor) -> None:
        """Write ``values`` to rows ``ids`` (a duplicate id: its last row wins; a hash
        table inserts absent keys).

        Raises:
            ValueError: ``values`` not shaped as ``ids`` + the row shape, nor as
                (number of ids,) + the row shape.
            TypeError: ``values`` of another dtype than the tensor's (or float32).
        """
        flat, shape = self._client.ids_in(self._name, self._rows_of(ids), self._ctx.F)
        self._client.push(self._name, flat,
                          self._client.values_in(self._name, values, self._ctx.F, shape))

    def __len__(self):
        return self.shape[0]

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
                self._client.delete_data(self._name)  # its optimizer state with it
                if many:
                    self._client.barrier()
        except Exception:  # interpreter shutdown: the store may already be gone
            pass

    # -- keys: every table answers; what its store cannot do is refused, named ---------

    def size(self) -> int:
        """Keys held (over every shard): N of a table of the fixed keys 0..N-1."""
        return self._client.size(self._name)

    @property
    def capacity(self) -> Optional[int]:
        """Keys held at most (None: unbounded)."""
        return self._client.capacity(self._name)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Bool per key: held (nothing inserted, no access counted)."""
        return self._client.contains(self._name, keys)

    def get(self, keys: np.ndarray) -> Tensor:
        """Rows of ``keys`` without inserting or counting them.

        Raises:
            MissingKeyError: a key not held. PartitionError: a key outside 0..N-1.
        """
        return self._ctx.F.from_numpy(np.ascontiguousarray(self._client.get(self._name, keys)))

    def remove(self, keys: np.ndarray) -> int:
        """Remove ``keys`` with their optimizer state; how many were present.

        Raises:
            StoreError: the table holds fixed keys (a dense or file table).
        """
        return self._client.remove(self._name, keys)

    def evict(self, target_size: int, policy=None) -> np.ndarray:
        """Evict keys down to ``target_size``; the evicted keys.

        Raises:
            StoreError: the table holds fixed keys (a dense or file table).
        """
        return self._client.evict(self._name, target_size, policy)

    def export(self, states: Optional[Dict[str, str]] = None
               ) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        """(keys ascending, {"weight": rows as float32, state: rows}) of every key held,
        with the optimizer states ``states`` ({state: KVStore name}; none when None)."""
        return self._client.export(self._name, ["weight"] + list(states or {}))

    def import_(self, keys: np.ndarray, columns: Dict[str, np.ndarray],
                states: Optional[Dict[str, str]] = None) -> None:
        """Upsert rows ``keys`` of every column of ``columns`` (what :meth:`export` gave).

        Raises:
            StoreError: a column that is neither the weight nor one of ``states``, or rows
                of the wrong count.
        """
        unknown = [c for c in columns if c != "weight" and c not in (states or {})]
        if unknown:
            raise StoreError(f"columns: {unknown} not in table {self._name!r} (has "
                             f"{['weight'] + sorted(states or {})}; create the optimizer "
                             "first to import its state)")
        self._client.import_(self._name, keys, columns)

    def flush(self) -> None:
        """Make completed writes durable (a file table's; no-op in memory)."""
        self._client.flush(self._name)

    def close(self) -> None:
        """Flush and release this table: it leaves its context (a file table's store is
        reopened by making the table again)."""
        self._client.delete_data(self._name)

    @property
    def store(self):
        """The RowStore holding this table, when one store in this process holds it.

        Raises:
            AttributeError: its rows are in several shards or on servers.
        """
        if not hasattr(self._client, "store"):
            raise AttributeError(f"{self._name!r} is sharded over "
                                 f"{self._client.num_servers} servers: it has no one store "
                                 "in this process")
        return self._client.store(self._name)

    @property
    def shape(self):
        """(rows, ...): a table of any key's row count changes as keys come and go."""
        n = self._table.num_keys
        return (n if n is not None else self._client.size(self._name),) + \
            tuple(self._column_shape)

    @property
    def part_policy(self):
        return self._policy

    @property
    def fixed_rows(self) -> Optional[int]:
        """N for a table of the fixed keys 0..N-1 (dense, file), None for a hash table."""
        return self._table.num_keys

    @property
    def device(self):
        """The torch device of the rows, or None when they are numpy arrays on the host."""
        return self._client.device

    def __repr__(self):
        return f"DistTensor(name={self._name!r}, shape={self.shape}, dtype={self._dtype})"


def _column(table, name):
    """The column of ``table`` that KVStore name ``name`` is (its weight, or a state)."""
    return "weight" if name == table.name else name[len(state_name(table.name, "")):]
