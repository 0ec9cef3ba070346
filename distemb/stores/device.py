"""DeviceHashStore: a hash store whose rows and optimizer state live on a GPU.

The key index, the slot bookkeeping and the eviction counters are a
:class:`~distemb.stores.hash.HashStore`'s, on the host, so a key gets the slot, the
initial row and the eviction rank it would get there. Only the float columns (the weight
and the optimizer state) differ: torch tensors on the device, grown by doubling,
gathered and updated there by the device kernels (:mod:`distemb.kernels.cuda`, or the
per-table :class:`~distemb.kernels.cuda_half.CudaHalfOps` of 16-bit rows). Keys cross to
the host, where the index is; rows, gradients and state stay on the device, except what
an export or a checkpoint reads (:meth:`DeviceHashStore.read_rows`, host arrays).

This is the store of a GPU-resident dynamic table
(``DynamicEmbedding(dim, device="cuda")``, held by
:class:`~distemb.kvstore.device.DeviceKVClient`). It imports torch: the stores package
does not import this module, so server processes never load torch.

Example:
    >>> from distemb.kernels.cuda import CudaUnavailableError, require_cuda
    >>> from distemb.kernels import cuda
    >>> from distemb.kernels.cuda_half import CudaHalfOps
    >>> try:
    ...     require_cuda()
    ...     s = DeviceHashStore(4, "cuda", cuda, CudaHalfOps)
    ...     assert s.lookup(np.array([2**40, -3])).is_cuda
    ... except CudaUnavailableError:  # says why: no library, CPU-only torch, no GPU
    ...     pass
"""
import numpy as np
import torch

from distemb.enums import Rounding
from distemb.errors import StoreError
from distemb.kernels.hashtable import keys_array
from distemb.stores.hash import HashStore
from distemb.stores.types import WEIGHT

#: Columns whose name starts with this are the holder's bookkeeping (a cache's row
#: versions): they stay on the host with the index.
HIDDEN = "~"


class DeviceHashStore(HashStore):
    """A :class:`~distemb.stores.hash.HashStore` with its float columns on ``device``.

    Args:
        dim, dtype, init, capacity, evict, low_water, rounding: as HashStore's.
        device: the torch device of the columns.
        ops: the kernels of float32 columns on that device (:mod:`distemb.kernels.cuda`,
            or a test's CPU stand-in).
        half_ops: ``half_ops(rounding_seed)`` -> the kernels of 16-bit rows there
            (:class:`~distemb.kernels.cuda_half.CudaHalfOps`); seeded 0 for stochastic
            rounding, as a host HashStore's :class:`~distemb.kernels.half.StochasticRounding`
            (the same bits: the CUDA kernels equal the CPU ones).
    """

    def __init__(self, dim, device, ops, half_ops, dtype="float32", init=None,
                 capacity=None, evict="lru", low_water=1.0, rounding="nearest"):
        self.device = torch.device(device)  # before the columns are made
        super().__init__(dim, dtype=dtype, init=init, capacity=capacity, evict=evict,
                         low_water=low_water, rounding=rounding)
        self._ops = ops if self.dtype == "float32" else \
            half_ops(0 if self.rounding is Rounding.STOCHASTIC else None)

    @classmethod
    def of_spec(cls, spec, device, ops, half_ops):
        """The store of a :class:`~distemb.stores.hash.HashTableSpec` on ``device``."""
        return cls(spec.dim, device, ops, half_ops, dtype=spec.dtype, init=spec.init,
                   capacity=spec.capacity, evict=spec.evict, low_water=spec.low_water,
                   rounding=spec.rounding)

    @property
    def ops(self):
        """The device kernels of the weight column's dtype."""
        return self._ops

    def _on_device(self, slots):
        return torch.from_numpy(np.ascontiguousarray(slots, np.int64)).to(self.device)

    def _new_column(self, name, rows, row_shape, dtype, fill):
        if name.startswith(HIDDEN):
            return super()._new_column(name, rows, row_shape, dtype, fill)
        return torch.full((rows,) + tuple(row_shape), fill, dtype=getattr(torch, dtype),
                          device=self.device)

    def _write_slots(self, column, slots, values):
        """Write ``values`` (float32 rows, any device, or a scalar) into unique
        ``slots``; 16-bit weight rows round to nearest-even."""
        arr = self.column(column)
        if isinstance(arr, np.ndarray):
            return super()._write_slots(column, slots, values)
        if not isinstance(values, torch.Tensor):
            values = torch.from_numpy(np.ascontiguousarray(values)) \
                if isinstance(values, np.ndarray) else torch.tensor(values)
        if arr.is_floating_point():
            values = values.to(self.device, torch.float32)  # 16-bit rows: rounded below
        arr[self._on_device(slots)] = values.to(self.device, arr.dtype)

    def _gather_slots(self, slots, column=WEIGHT, stored=False):
        arr = self.column(column)
        if isinstance(arr, np.ndarray):
            return super()._gather_slots(slots, column, stored)
        idx = self._on_device(slots)
        if column == WEIGHT and not stored:
            return self.ops.gather_rows(arr, idx)
        return arr.index_select(0, idx)

    def scatter(self, keys, values, column=WEIGHT):
        """Write ``values`` (float32 rows, on any device) into rows ``keys`` of ``column``
        (upsert); for a duplicate key the last write wins."""
        keys = keys_array(keys)
        if not isinstance(values, torch.Tensor):
            values = np.asarray(values)
        want = (len(keys),) + tuple(self.column(column).shape[1:])
        if tuple(values.shape) != want:
            raise StoreError(f"values: expected shape {want} for column {column!r}, "
                             f"got {tuple(values.shape)}")
        # one write per key (a device's index_put leaves duplicates' winner unspecified)
        uniq, first = np.unique(keys[::-1], return_index=True)
        if len(uniq) < len(keys):
            last = len(keys) - 1 - first  # each key's last write, in uniq's order
            values = values[torch.from_numpy(last) if isinstance(values, torch.Tensor)
                            else last]
            keys = uniq
        self._write_slots(column, self._slots_to_write(keys, column), values)

    def update(self, rule, keys, grads, hyper, num_threads=1):
        """Apply ``rule`` to unique ``keys`` on the device, skipping keys not held (as
        :meth:`RowStore.update <distemb.stores.types.RowStore.update>`, whose return value
        this is); ``grads`` are float32 rows on any device."""
        slots, at = self._held_slots(keys)
        if not isinstance(grads, torch.Tensor):
            grads = torch.from_numpy(np.ascontiguousarray(grads))
        if at is not None:
            grads = grads[torch.from_numpy(at).to(grads.device)]
        grads = grads.to(self.device, torch.float32).contiguous()
        states = {s.name: self.column(s.name) for s in rule.states}
        rule.apply(self.ops, self.column(WEIGHT), states, self._on_device(slots), grads, hyper)
        return at

    def read_rows(self, column, slots):
        arr = self.column(column)
        if isinstance(arr, np.ndarray):
            return super().read_rows(column, slots)
        rows = arr.index_select(0, self._on_device(slots))
        return (rows.to(torch.float32) if arr.is_floating_point() else rows).cpu().numpy()

    def nbytes(self):
        """Host bytes: the index and the slot bookkeeping (the columns are on the device)."""
        host = [a for a in self._cols.values() if isinstance(a, np.ndarray)]
        return int(sum(a.nbytes for a in host) + self._slot_key.nbytes + self._last.nbytes
                   + self._count.nbytes + self._index.nbytes())

    def device_nbytes(self):
        """Bytes of the columns on the device."""
        return int(sum(a.nbytes for a in self._cols.values() if isinstance(a, torch.Tensor)))
