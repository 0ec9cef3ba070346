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
from distemb.errors import PartitionError, StoreError
from distemb.kernels.half import storage_dtype
from distemb.kernels.hashtable import keys_array
from distemb.stores.hash import HashStore
from distemb.stores.id_check import IdCheck
from distemb.stores.types import WEIGHT, RowStore

#: Columns whose name starts with this are the holder's bookkeeping (a cache's row
#: versions): they stay on the host with the index.
HIDDEN = "~"


def as_tensor(values):
    """Rows as a torch tensor: numpy rows as they are (bfloat16 bits as torch bfloat16,
    float16 as float16), a tensor itself."""
    if isinstance(values, torch.Tensor):
        return values
    values = np.ascontiguousarray(values)
    if values.dtype == storage_dtype("bfloat16"):
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


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

    #: The key index is on the host: keys cross there.
    keys_on_host = True

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
            values = as_tensor(values) if isinstance(values, np.ndarray) else \
                torch.tensor(values)
        if arr.is_floating_point():
            values = values.to(self.device, torch.float32)  # 16-bit rows: rounded below
        arr[self._on_device(slots)] = values.to(self.device, arr.dtype)

    def gather_slots(self, slots, column=WEIGHT, out=None, num_threads=1, stored=False):
        arr = self.column(column)
        if isinstance(arr, np.ndarray):
            return super().gather_slots(slots, column, out, num_threads, stored)
        idx = self._on_device(slots)
        rows = self.ops.gather_rows(arr, idx) if column == WEIGHT and not stored else \
            arr.index_select(0, idx)
        if out is None:
            return rows
        out[...] = rows
        return out

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

    def read_rows(self, column, slots, stored=False):
        arr = self.column(column)
        if isinstance(arr, np.ndarray):
            return super().read_rows(column, slots, stored)
        rows = arr.index_select(0, self._on_device(slots))
        if stored and arr.dtype in (torch.bfloat16, torch.float16):  # the bits, as a host
            return rows.view(torch.int16).cpu().numpy().view(storage_dtype(self.dtype))
        return (rows.to(torch.float32) if arr.is_floating_point() else rows).cpu().numpy()

    def nbytes(self):
        """Host bytes: the index and the slot bookkeeping (the columns are on the device)."""
        host = [a for a in self._cols.values() if isinstance(a, np.ndarray)]
        return int(sum(a.nbytes for a in host) + self._slot_key.nbytes + self._last.nbytes
                   + self._count.nbytes + self._index.nbytes())

    def device_nbytes(self):
        """Bytes of the columns on the device."""
        return int(sum(a.nbytes for a in self._cols.values() if isinstance(a, torch.Tensor)))


class DeviceDenseStore(RowStore):
    """Rows 0..N-1 and their optimizer state as torch tensors on ``device``: a dense
    table on a GPU (:class:`~distemb.kvstore.device.DeviceKVClient`).

    No lookup or update waits for the device. A training lookup's gather validates its
    ids there (:func:`~distemb.kernels.cuda.gather_rows_checked`: an out-of-range id
    reads zeros and is recorded in :attr:`check`'s flags, reported by a later lookup or
    update that finds them landed); an update skips rows outside the table (its ids come
    padded with N from the device's dedup). Writes of rows (rare) check their ids at
    once. Keys of host-side calls (exports, checkpoints, key queries) may be numpy.

    Args:
        num_rows: N.
        row_shape: the rows' shape (a tuple) or length.
        dtype: any dtype torch has (float32/bfloat16/float16 rows are updated; 16-bit
            rows are looked up as float32).
        device: the torch device.
        ops: the device kernels of float32 rows; half_ops: ``half_ops(seed)`` -> those of
            16-bit rows (seeded for stochastic rounding, None: nearest-even).
        rounding_seed: the stochastic rounding's seed of bfloat16 rows, or None.
        what: how errors name the ids (``"ids of 'emb'"``).
    """

    fixed_keys = True
    #: Ids stay on the device (keys of a hash store's index cross to the host).
    keys_on_host = False

    def __init__(self, num_rows, row_shape, dtype, device, ops, half_ops,
                 rounding_seed=None, what="ids"):
        self.num_rows = int(num_rows)
        self.row_shape = (row_shape,) if isinstance(row_shape, int) else tuple(row_shape)
        self.dim = int(np.prod(self.row_shape, dtype=np.int64))
        self.dtype = str(dtype)
        self.device = torch.device(device)
        self._ops = half_ops(rounding_seed) if self.dtype in ("bfloat16", "float16") \
            else ops
        self._cols = {WEIGHT: torch.zeros((self.num_rows,) + self.row_shape,
                                          dtype=getattr(torch, self.dtype),
                                          device=self.device)}
        self.check = IdCheck(self.device, self.num_rows, what)

    @property
    def ops(self):
        return self._ops

    def _ids(self, keys):
        if isinstance(keys, torch.Tensor):
            return keys.to(self.device, torch.int64)
        return torch.from_numpy(keys_array(keys)).to(self.device)

    def _check_now(self, ids):
        """Range-check ``ids`` here and now (one wait for the device)."""
        bad = (ids < 0) | (ids >= self.num_rows)
        if bool(bad.any()):
            raise PartitionError(f"{self.check.what}: id {int(ids[bad][0])} is out of range "
                                 f"(expected 0 <= id < {self.num_rows})")

    def slots(self, keys, insert=False):
        ids = self._ids(keys)
        self._check_now(ids)
        return ids

    def find(self, keys):
        keys = keys_array(keys)
        return np.where((keys >= 0) & (keys < self.num_rows), keys, -1)

    def read(self, keys, column=WEIGHT, out=None, num_threads=1, access=True):
        """Rows of ``keys`` (a tensor on the device): the weight's gathered with the ids
        checked on the device (no wait), other columns' checked now."""
        arr = self.column(column)
        ids = self._ids(keys)
        if column == WEIGHT and arr.dim() == 2 and (arr.dtype == torch.float32 or
                                                   self.dtype in ("bfloat16", "float16")):
            self.check.raise_seen(wait=False)
            rows = self.ops.gather_rows_checked(arr, ids, self.check.flags)
            self.check.recorded()
            return rows
        self._check_now(ids)
        return arr.index_select(0, ids)

    def gather_slots(self, slots, column=WEIGHT, out=None, num_threads=1, stored=False):
        arr = self.column(column)
        ids = self._ids(slots)
        if column == WEIGHT and not stored and arr.dtype in (torch.bfloat16, torch.float16):
            return arr.index_select(0, ids).to(torch.float32)
        return arr.index_select(0, ids)

    def scatter(self, keys, values, column=WEIGHT):
        """Write rows ``keys`` of ``column`` (ids checked now); for a duplicate id the
        last write wins (``index_copy_`` leaves it unspecified on a GPU)."""
        arr = self.column(column)
        ids = self._ids(keys)
        self._check_now(ids)
        values = as_tensor(values).to(self.device)
        want = (ids.shape[0],) + tuple(arr.shape[1:])
        if tuple(values.shape) != want:
            raise StoreError(f"values: expected shape {want} for column {column!r}, got "
                             f"{tuple(values.shape)}")
        uniq, inverse = torch.unique(ids, return_inverse=True)
        positions = torch.arange(ids.shape[0], device=ids.device)
        last = torch.zeros_like(uniq).scatter_reduce_(0, inverse, positions, "amax")
        arr.index_copy_(0, uniq, values.to(arr.dtype)[last])

    def update(self, rule, keys, grads, hyper, num_threads=1):
        """Apply ``rule`` to unique ``keys`` on the device (rows outside the table are
        skipped by the kernels); bad ids seen by earlier lookups are reported first, if
        their flags have landed."""
        self.check.raise_seen(wait=False)
        states = {s.name: self.column(s.name) for s in rule.states}
        rule.apply(self.ops, self.column(WEIGHT), states, self._ids(keys),
                   grads.to(self.device, torch.float32).contiguous()
                   if isinstance(grads, torch.Tensor) else
                   torch.from_numpy(np.ascontiguousarray(grads, np.float32)).to(self.device),
                   hyper)
        return None

    def column(self, name):
        try:
            return self._cols[name]
        except KeyError:
            raise StoreError(f"column: no column {name!r} (has {list(self._cols)})") from None

    def add_column(self, name, row_shape, dtype, fill=0.0, keep=False):
        if name == WEIGHT:
            raise StoreError("column: 'weight' is the rows; it cannot be re-added")
        self._cols[name] = torch.full((self.num_rows,) + tuple(row_shape), fill,
                                      dtype=getattr(torch, np.dtype(dtype).name),
                                      device=self.device)

    def drop_column(self, name):
        if name != WEIGHT:
            self._cols.pop(name, None)

    def columns(self):
        return {n: (tuple(a.shape[1:]), str(a.dtype).replace("torch.", ""))
                for n, a in self._cols.items()}

    def keys(self):
        return np.arange(self.num_rows, dtype=np.int64)

    def size(self):
        return self.num_rows

    @property
    def capacity(self):
        return self.num_rows

    def remove(self, keys):
        raise StoreError(f"remove: a {type(self).__name__} holds the fixed keys "
                         f"0..{self.num_rows - 1}")

    def evict(self, target_size, policy=None, protect=None):
        raise StoreError(f"evict: a {type(self).__name__} holds the fixed keys "
                         f"0..{self.num_rows - 1}")

    def read_rows(self, column, slots, stored=False):
        arr = self.column(column)
        rows = arr.index_select(0, self._ids(slots))
        if stored and arr.dtype in (torch.bfloat16, torch.float16):  # the bits, on the host
            return rows.view(torch.int16).cpu().numpy().view(storage_dtype(self.dtype))
        return (rows.to(torch.float32) if rows.dtype in (torch.bfloat16, torch.float16)
                else rows).cpu().numpy()

    def nbytes(self):
        return 0

    def device_nbytes(self):
        """Bytes of the columns on the device."""
        return int(sum(a.numel() * a.element_size() for a in self._cols.values()))

    def close(self):
        self._cols = {}
        self.closed = True
