"""DistTensor: a named, row-sharded tensor; ``t[ids]`` pulls, ``t[ids] = v`` pushes.

Where the rows live is the business of the tensor's KVClient (DESIGN.md, placement): the
tensor hands the caller's tensors to ``client.ids_in``/``values_in`` and the pulled rows
to ``client.rows_out``, on one path for every placement.
"""
from typing import Optional, Tuple

import numpy as np

from distemb.arrays import DENSE_INIT, GlobalIds, Shape, Tensor, check_init_func
from distemb.context import current_context
from distemb.errors import KVStoreError
from distemb.kvstore import KVClient
from distemb.partition import PartitionPolicy, range_policy
from distemb.rules import state_name

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


def _check_shape(shape) -> Shape:
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape: expected a tuple of ints, got {shape!r}") from None
    if not shape or shape[0] <= 0 or any(s < 0 for s in shape[1:]):
        raise ValueError(f"shape: expected a non-empty tuple with shape[0] > 0, got {shape}")
    return shape


class DistTensor:
    """A tensor sharded by rows across the KVStore, addressed by global row ids.

    Args:
        shape: (rows, ...) of the whole tensor.
        dtype: element type (torch, numpy or string dtype).
        name: KVStore name; an existing tensor of that name (same shape and dtype) is
            attached instead of created. Anonymous when None. DGL's names of optimizer
            state (``"<table>_sum"``, ``"_mem"``, ``"_power"``, ``"_step"``) attach to that
            state when no tensor of the name itself exists (a compatibility alias).
        init_func: ``init_func(shape, dtype)`` returns the initial values of one shard.
        part_policy: how rows are sharded (default: even ranges over the servers).
        persistent: keep the data after this object is garbage collected.
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

    ``t[ids]`` takes integer ids of any shape or a ``slice`` of rows.

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device and the CUDA kernels cannot
            run here (not built, CPU-only torch or no GPU; the message says which).
        DistEmbError: ``device`` is a CUDA device in a trainer context of a cluster.
        TypeError: ``part_policy`` is not a distemb policy (DGL's: see distemb.dgl).

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
        ctx = context or current_context()
        self._ctx, F = ctx, ctx.F
        self._client = ctx.client_for(device)
        self._shape = _check_shape(shape)
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
        check_init_func(init_func, DENSE_INIT)
        self._policy = part_policy
        self._name = _resolve_name(self._client, name) or ctx.new_name("anonymous")
        self._persistent = persistent
        meta = self._client.data_meta(self._name)
        self._owner = meta is None
        if meta is None:
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
        flat, shape = client.ids_in(self._name, self._rows_of(ids), self._ctx.F)
        rows = client.rows_out(client.pull(self._name, flat), self._ctx.F)
        return flat, self._ctx.F.reshape(rows, tuple(shape) + self._shape[1:])

    def _rows_of(self, ids):
        """A ``slice`` means the ids of the rows it selects (``t[0:n // 2]``, as DGL)."""
        if isinstance(ids, slice):
            return np.arange(*ids.indices(self._shape[0]), dtype=np.int64)
        return ids

    def __getitem__(self, ids: Tensor) -> Tensor:
        return self.lookup(ids)[1]

    def __setitem__(self, ids: Tensor, values: Tensor) -> None:
        flat, _ = self._client.ids_in(self._name, self._rows_of(ids), self._ctx.F)
        self._client.push(self._name, flat,
                          self._client.values_in(self._name, values, self._ctx.F, len(flat)))

    def __len__(self):
        return self._shape[0]

    def __del__(self):
        try:
            if self._owner and not self._persistent and not self._ctx.closed:
                self._client.delete_data(self._name)
        except Exception:  # interpreter shutdown: the store may already be gone
            pass

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._ctx.F.dtype(self._dtype)

    @property
    def name(self):
        return self._name

    @property
    def part_policy(self):
        return self._policy

    @property
    def context(self):
        return self._ctx

    @property
    def client(self):
        """The KVClient holding the rows (a device client for a GPU-resident tensor)."""
        return self._client

    @property
    def device(self):
        """The torch device of the rows, or None when they are numpy arrays on the host."""
        return self._client.device

    def __repr__(self):
        return f"DistTensor(name={self._name!r}, shape={self._shape}, dtype={self._dtype})"
