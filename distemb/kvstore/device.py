"""Device placements: tables on a GPU, and host tables looked up onto a GPU.

:class:`DeviceKVClient` is an embedded KVClient whose tables live in torch tensors on one
device. :class:`HostTableOnDevice` is a view of a host client (embedded or remote) whose
looked-up rows go to a GPU and whose gradients are summed there, so only the unique rows'
sums cross back; :class:`RowsOnDevice` is a view of a device client whose rows are copied
to another device; :class:`CacheOnDevice` is the lookup view of a device cache
(:mod:`distemb.kvstore.caches.device`). Views wrap a client and change only the placement
half of the interface (see :mod:`distemb.kvstore.types`): storage goes to the wrapped
client.

A GPU-resident dense table is one whole tensor on its device (the partition policy is
kept as metadata, its size checked, and ``init_func`` still fills one shard at a time, so
a table starts as it would on the host): lookups gather with the CUDA kernels and updates
run the rules of :mod:`distemb.rules` with :mod:`distemb.kernels.cuda`, so rows, ids and
gradients never leave the GPU. A hash table keeps its columns there and its key index on
the host (:mod:`distemb.kvstore.device_keyed`). Arrays crossing this client are torch
tensors on its device (ids int64), where host clients use numpy. Embedded only: a server
process holds numpy shards and never imports torch.

No step of a dense table waits for the device. Ids are validated there without stopping
the stream: a lookup's gather reads zeros for an out-of-range id and records it in the
table's flags (:class:`~distemb.kvstore.id_check.IdCheck`), reported as a
:class:`~distemb.errors.PartitionError` by the next lookup or ``push_update`` of the
table that finds them landed (that call then does nothing). Until then a bad id is
harmless: the dedup sums it apart, and the update kernels skip rows outside the table
(gradients arrive from ``dedup_sum_padded``: all N slots, unused ones holding an id
outside the table). Writes (``t[ids] = v``) are rare and check their ids at once.

This module imports torch; :mod:`distemb.kvstore` does not import it, so servers never
load it (the context imports it when a table asks for a device).

"""
from typing import Sequence, Tuple

import numpy as np
import torch

from distemb.arrays import Array, Rows, Tensor, UniqueIds, check_values_shape
from distemb.errors import KVStoreError, PartitionError
from distemb.kernels import cuda, half
from distemb.kernels.cuda import cuda_device
from distemb.kernels.cuda_half import CudaHalfOps
from distemb.kvstore.device_keyed import DeviceKeyedTables
from distemb.kvstore.id_check import IdCheck
from distemb.kvstore.placement import PlacedAsInner
from distemb.kvstore.types import (DataMeta, KVClient, check_new_name, check_rounding,
                                   unknown_name)
from distemb.rules import rule_of, state_name


class DeviceKVClient(DeviceKeyedTables, KVClient):
    """Embedded KVClient holding each table as one torch tensor on ``device``, and hash
    tables as stores with their columns there (:mod:`distemb.kvstore.device_keyed`).

    Pulls gather with ``ops.gather_rows``; ``push_update`` runs the update rule with
    ``ops`` on the rows in place. Ids, rows and gradients passed in and returned are torch
    tensors on ``device`` (ids int64, in range: the caller validates them, as for host
    clients). One process, one writer: updates are enqueued on the device's current
    stream in call order, so a row and its state have one writer (DESIGN.md).

    Args:
        device: the ``torch.device`` of the tables (:func:`cuda_device` resolves one).
        ops: the kernel module (default :mod:`distemb.kernels.cuda`); anything with its
            functions and keywords works, e.g. a test's CPU twin on a CPU device.
        half_ops: ``half_ops(rounding_seed)`` -> the kernels of one bfloat16/float16
            table (default :class:`~distemb.kernels.cuda_half.CudaHalfOps`): half tables
            are bfloat16/float16 tensors, looked up as float32 rows, float32 state.

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device but the kernels cannot run here.

    Example:
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.partition import range_policy
        >>> try:
        ...     kv = DeviceKVClient(cuda_device("cuda"))
        ... except CudaUnavailableError as e:  # says why: no library, CPU-only torch, no GPU
        ...     kv = None
        >>> if kv is not None:
        ...     kv.init_data("t", (5, 2), "float32", range_policy(5))
        ...     assert kv.pull("t", torch.tensor([4], device=kv.device)).is_cuda
    """

    ops = cuda
    half_ops = CudaHalfOps

    def __init__(self, device, ops=None, half_ops=None):
        self.device = torch.device(device)
        if ops is not None:
            self.ops = ops
        if half_ops is not None:
            self.half_ops = half_ops
        self._table_ops = {}  # name -> the half_ops of a half-precision table
        if self.device.type == "cuda":
            cuda.require_cuda()
        self._tables = {}
        self._meta = {}
        self._checks = {}
        self._init_device_keyed()

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        """Create ``name``; ``init_func(shard_shape, dtype_name)`` fills each shard.

        Zeros when ``init_func`` is None. It may return numpy arrays or torch tensors; each
        shard's rows land at their global ids, as a host client would place them.

        A bfloat16/float16 table runs on ``half_ops`` (its stochastic rounding seeded as
        partition 0 of a host table: one GPU tensor is one shard, so its rows round as an
        embedded one-part host table's do).
        """
        check_new_name(self._meta, name)
        if self.is_keyed(name):
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        check_rounding(dtype, rounding_seed)
        shape = tuple(shape)
        if policy.get_size() != shape[0]:
            raise KVStoreError(f"policy of {name!r}: {policy.policy_str} has "
                               f"{policy.get_size()} ids, but shape[0] is {shape[0]}")
        self._tables[name] = self._initial(name, shape, dtype, policy, init_func)
        self._meta[name] = DataMeta(shape, dtype, policy)
        if half.is_half(dtype):
            self._table_ops[name] = self.half_ops(
                None if rounding_seed is None else half.shard_seed(rounding_seed, 0))
        self._checks[name] = IdCheck(self.device, shape[0],
                                     f"ids of {name!r} ({policy.policy_str})")

    def _initial(self, name, shape, dtype, policy, init_func):
        tdtype = getattr(torch, dtype)
        if init_func is None:
            return torch.zeros(shape, dtype=tdtype, device=self.device)
        shards = []
        for part in range(policy.num_partitions):
            sshape = (policy.get_part_size(part),) + shape[1:]
            # copy=True: a tensor the caller keeps (already on this device, in this
            # dtype) must not become the table, which every step updates in place
            shard = torch.as_tensor(init_func(sshape, dtype)).to(self.device, tdtype,
                                                                 copy=True)
            if tuple(shard.shape) != sshape:
                raise KVStoreError(f"init_func of {name!r}: returned shape "
                                   f"{tuple(shard.shape)}, expected {sshape}")
            shards.append(shard)
        if policy.ids_are_local():
            return shards[0].contiguous()
        table = torch.empty(shape, dtype=tdtype, device=self.device)
        for part, pos, local in policy.split(np.arange(shape[0], dtype=np.int64)):
            table[torch.from_numpy(pos).to(self.device)] = \
                shards[part][torch.from_numpy(local).to(self.device)]
        return table

    def delete_data(self, name):
        if self.is_keyed(name):
            return self._keyed.delete_data(name)
        self._meta.pop(name, None)
        self._tables.pop(name, None)
        self._checks.pop(name, None)
        self._table_ops.pop(name, None)

    def _meta_of(self, name):
        self._table(name)  # raises the unknown-name error
        return self._meta[name]

    def _table(self, name):
        try:
            return self._tables[name]
        except KeyError:
            raise unknown_name(self, name, "in the KVStore", self._meta) from None

    def pull(self, name, ids):
        """Rows ``ids`` (int64 tensor on the device) of ``name``, a new tensor there.

        Ids are validated on the device (see the module docstring): an out-of-range id
        reads zeros and is reported by a later call, never by a wait here.

        Raises:
            PartitionError: an earlier lookup of ``name`` had ids out of range.
        """
        if self._is_keyed_name(name):
            return self._keyed.pull(name, self._host_keys(ids))
        table, check = self._table(name), self._checks[name]
        check.raise_seen(wait=False)
        if table.dim() == 2 and (table.dtype == torch.float32 or name in self._table_ops):
            ops = self._table_ops.get(name, self.ops)  # half rows: gathered as float32
            rows = ops.gather_rows_checked(table, ids, check.flags)
            check.recorded()
            return rows
        self._check_now(name, ids)  # other tables: index_select would fault on a bad id
        return table.index_select(0, ids)

    def _check_now(self, name, ids):
        """Range-check ``ids`` of ``name`` here and now (one wait for the device)."""
        bad = (ids < 0) | (ids >= self._meta[name].shape[0])
        if bool(bad.any()):
            raise PartitionError(f"ids of {name!r}: id {int(ids[bad][0])} is out of range for "
                                 f"{self._meta[name].policy.policy_str} (expected 0 <= id < "
                                 f"{self._meta[name].shape[0]})")

    def push(self, name, ids, values):
        """Write ``values`` into rows ``ids``; for a duplicate id the last write wins.

        Raises:
            PartitionError: an id is out of range (checked at once: writes are rare).
        """
        if self._is_keyed_name(name):
            return self._keyed.push(name, self._host_keys(ids), values)
        table = self._table(name)
        self._check_now(name, ids)
        # index_copy_ leaves the winner of duplicate ids unspecified on a GPU: keep the
        # last position of each id, as host clients do.
        uniq, inverse = torch.unique(ids, return_inverse=True)
        positions = torch.arange(ids.shape[0], device=ids.device)
        last = torch.zeros_like(uniq).scatter_reduce_(0, inverse, positions, "amax")
        table.index_copy_(0, uniq, values.to(table.dtype)[last])

    def push_update(self, name, ids, grads, rule, hyper):
        if self.is_keyed(name):
            return self._keyed.push_update(name, self._host_keys(ids), grads, rule, hyper)
        impl = rule_of(rule)
        states = {s.name: self._table(state_name(name, s.name)) for s in impl.states}
        # Bad ids seen by earlier lookups, if their flags have landed (never waits: the
        # update kernels skip rows outside the table anyway).
        self._checks[name].raise_seen(wait=False)
        impl.apply(self._table_ops.get(name, self.ops), self._table(name), states, ids, grads,
                   impl.check_hyper(hyper))

    def from_host(self, array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_host(self, array):
        return array.cpu().numpy()

    def close(self):
        for name in list(self._meta):
            self.delete_data(name)
        self._keyed.close()
        self.closed = True

    # -- placement: arrays are torch tensors on self.device -----------------------------

    def tensor_in(self, x, F):
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        return t.to(self.device)

    def ids_in(self, name, ids, F):
        """Ids as a contiguous int64 tensor on the device.

        Not range-checked here (that would wait for the device): ``pull`` checks them on
        the device and reports later, ``push`` checks them at once (module docstring).
        """
        if self.is_keyed(name):
            return self._keyed_ids_in(name, ids)
        self._meta_of(name)  # raises the unknown-name error
        t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"ids: expected an integer tensor (int32 or int64), got {t.dtype}")
        flat = t.reshape(-1).to(self.device, torch.int64).contiguous()
        return flat, tuple(t.shape)

    def values_in(self, name, values, F, ids_shape):
        if self.is_keyed(name):
            return self._keyed_values_in(name, values, ids_shape)
        meta = self._meta_of(name)
        t = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
        got = str(t.dtype).replace("torch.", "")
        if got != meta.dtype and got != half.row_dtype(meta.dtype):  # float32: rounded
            raise TypeError(f"values: expected dtype {meta.dtype} for {name!r}, got {got}")
        want = check_values_shape(name, t.shape, ids_shape, meta.shape[1:])
        return t.to(self.device).reshape(want)

    def rows_out(self, rows, F):
        return rows

    def coalesce(self, name, ids, grads, F):
        """Sum duplicate ids' gradients here with ``ops.dedup_sum_padded``: no wait.

        Returns all N slots, unused ones holding an id outside the table, which this
        client's ``push_update`` (the update kernels) skips.
        """
        if not ids:
            return None
        if self.is_keyed(name):  # summed by key here, the unique keys to the host index
            uniq, summed = dedup_on(self.ops, self.device, self.data_meta(name), ids, grads)
            return uniq.cpu().numpy(), summed
        return dedup_on(self.ops, self.device, self._meta_of(name), ids, grads, padded=True)

    def view_on(self, device):
        """Itself for None or its own device; otherwise a view copying rows to ``device``."""
        if device is None:
            return self
        dev = cuda_device(device) if str(device).startswith("cuda") else torch.device(device)
        return self if dev == self.device else RowsOnDevice(self, dev)


def dedup_on(ops, device, meta: DataMeta, ids: Sequence[Array], grads: Sequence[Tensor],
              padded: bool = False) -> Tuple[UniqueIds, Rows]:
    """Concatenate traced ids and gradients on ``device`` and sum duplicates there.

    ``padded``: with ``ops.dedup_sum_padded`` (no wait for the device; unused slots hold
    the id ``meta.shape[0]``, outside the table), for updates on the device itself.
    """
    ids = [torch.as_tensor(i).to(device) for i in ids]  # host ids: numpy int64
    grads = [g.reshape(-1, meta.shape[1]).to(device) for g in grads]
    flat = ids[0] if len(ids) == 1 else torch.cat(ids)
    g = (grads[0] if len(grads) == 1 else torch.cat(grads)).to(torch.float32).contiguous()
    if padded:
        return ops.dedup_sum_padded(flat, g, num_rows=meta.shape[0])
    # A keyed table (no partition policy: any int64 key) has no row count to sort
    # against: its shape[0] is the live key count, and keys past it are valid keys.
    return ops.dedup_sum(flat, g, num_rows=meta.shape[0] if meta.policy is not None else None)


class ClientView(PlacedAsInner, KVClient):
    """A client that hands everything to ``inner``; subclasses change the placement half.

    Args:
        inner: the client holding the rows.

    Example:
        >>> from distemb.kvstore import LocalKVClient
        >>> from distemb.partition import range_policy
        >>> inner = LocalKVClient()
        >>> view = ClientView(inner)
        >>> view.init_data("t", (3, 2), "float32", range_policy(3))
        >>> inner.names(), view.pull("t", np.array([2])).shape
        (['t'], (1, 2))
    """

    def __init__(self, inner: KVClient):
        self.inner = inner
        self.num_servers = inner.num_servers
        self.num_threads = inner.num_threads

    @property
    def ops(self):
        return self.inner.ops

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        self.inner.init_data(name, shape, dtype, policy, init_func, rounding_seed)

    def data_meta(self, name):
        return self.inner.data_meta(name)

    def names(self):
        return self.inner.names()

    def delete_data(self, name):
        self.inner.delete_data(name)

    def pull(self, name, ids):
        return self.inner.pull(name, ids)

    def push(self, name, ids, values):
        self.inner.push(name, ids, values)

    def init_optimizer(self, name, rule, options):
        return self.inner.init_optimizer(name, rule, options)

    def push_update(self, name, ids, grads, rule, hyper):
        self.inner.push_update(name, ids, grads, rule, hyper)

    def barrier(self):
        self.inner.barrier()

    def close(self):
        """Nothing: the wrapped client belongs to whoever made it."""

    def view_on(self, device):
        return self.inner.view_on(device)


class HostTableOnDevice(ClientView):
    """A host table looked up onto a GPU: rows go there, gradients are summed there.

    Only the unique ids and their summed gradients come back to the host, where the host
    client pushes the update as usual (to its own shards or to the servers).

    Args:
        inner: the host client holding the table.
        device: the CUDA device (resolved by :func:`cuda_device`).

    Example:
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.kvstore import LocalKVClient
        >>> try:
        ...     view = LocalKVClient().view_on("cuda")
        ... except CudaUnavailableError:  # says why: no library, CPU-only torch, no GPU
        ...     view = None
    """

    #: The kernels that sum on the device (a test may swap in a CPU stand-in).
    ops = cuda

    def __init__(self, inner: KVClient, device: torch.device):
        super().__init__(inner)
        self.device = device

    @classmethod
    def of(cls, inner: KVClient, device) -> "HostTableOnDevice":
        """The view of ``inner`` on ``device``, checked before any copy."""
        return cls(inner, cuda_device(device))

    def rows_out(self, rows, F):
        return F.copy_to(self.inner.rows_out(rows, F), self.device)

    def coalesce(self, name, ids, grads, F):
        if not ids:  # nothing summed here; the host client says what an empty step sends
            return self.inner.coalesce(name, ids, grads, F)
        uniq, summed = dedup_on(self.ops, self.device, self.inner.data_meta(name), ids, grads)
        return uniq.cpu().numpy(), summed.cpu().numpy()


class RowsOnDevice(ClientView):
    """A device table looked up onto another device: rows are copied there.

    Gradients come back to the table's device, where its client sums and applies them.

    Example:
        >>> from distemb.backend import load_backend
        >>> from distemb.partition import range_policy
        >>> table = DeviceKVClient("cpu")  # a GPU in real use; 'cpu' shows the wiring
        >>> table.init_data("t", (3, 2), "float32", range_policy(3))
        >>> view = RowsOnDevice(table, torch.device("meta"))
        >>> view.rows_out(torch.zeros(1, 2), load_backend("pytorch")).device
        device(type='meta')
    """

    def __init__(self, inner: KVClient, device: torch.device):
        super().__init__(inner)
        self.device = device

    def rows_out(self, rows, F):
        return F.copy_to(rows, self.device)


class CacheOnDevice(ClientView):
    """Lookups onto the device through a device cache
    (:class:`~distemb.kvstore.caches.device.DeviceCachedKVClient`).

    Rows come from the cache (misses fetched and admitted), gradients are summed on the
    device and handed back to the cache client's ``push_update`` as device tensors. The
    cache is any client with ``lookup``, ``device_ops`` and ``cache_device`` (this
    module sits below :mod:`distemb.kvstore.caches.device`, which makes this view).

    Args:
        cache: the cache client.

    Example:
        >>> from distemb.config import parse_cache_config
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.kvstore import LocalKVClient
        >>> from distemb.kvstore.caches.device import DeviceCachedKVClient
        >>> try:
        ...     kv = DeviceCachedKVClient(LocalKVClient(), parse_cache_config({"rows": 8}))
        ...     assert isinstance(kv.view_on("cuda"), CacheOnDevice)
        ... except CudaUnavailableError:  # no GPU here: says why
        ...     pass
    """

    def __init__(self, cache: KVClient):
        super().__init__(cache)
        self.device = cache.cache_device

    @property
    def ops(self):
        """The device kernels (the gradients of a step are summed with them)."""
        return self.inner.device_ops

    def pull(self, name, ids):
        return self.inner.lookup(name, ids)

    def rows_out(self, rows, F):
        return rows

    def coalesce(self, name, ids, grads, F):
        if not ids:  # nothing summed here; the host client says what an empty step sends
            return self.inner.coalesce(name, ids, grads, F)
        return dedup_on(self.ops, self.device, self.inner.data_meta(name), ids, grads)

    def close(self):
        """Nothing: the cache client belongs to the context."""
