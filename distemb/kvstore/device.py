"""DeviceKVClient: tables on a GPU, held by an embedded client whose stores are there.

A GPU-resident table is one shard on its device, under the same
:class:`~distemb.kvstore.server.shard.ShardTable` as every other: a dense table a
:class:`~distemb.stores.device.DeviceDenseStore` (the whole table as one torch tensor;
its partition policy is kept by its spec, and a DGL ``init_func`` still fills one
partition at a time, so a table starts as it would on the host), a hash table a
:class:`~distemb.stores.device.DeviceHashStore` (columns on the device, the key index on
the host). Lookups gather with the CUDA kernels and updates run the rules of
:mod:`distemb.rules` with :mod:`distemb.kernels.cuda`, so rows and gradients never leave
the GPU. Arrays crossing this client are torch tensors on its device; keys of a store
whose index is on the host (``keys_on_host``) cross to the host, one wait for the device
per lookup and per step, the index's price. Embedded only: a server process holds numpy
shards and never imports torch.

No step of a dense table waits for the device: its store validates ids there
(:class:`~distemb.stores.device.DeviceDenseStore`), reporting a bad id at a later call
as a :class:`~distemb.errors.PartitionError`; gradients arrive from
``dedup_sum_padded`` (all N slots, unused ones holding an id outside the table, which the
update kernels skip). Writes (``t[ids] = v``) are rare and check their ids at once.

Refused by name: a file table (its rows are files on the host) and a store object (it
lives in host memory); look their rows up onto a GPU with ``emb(ids, device=...)``.

This module imports torch; :mod:`distemb.kvstore` does not import it, so servers never
load it (the context imports it when a table asks for a device).

Example:
    >>> from distemb.partition import range_policy
    >>> from distemb.stores.hash import HashTableSpec
    >>> kv = DeviceKVClient("cpu")  # a GPU in real use; 'cpu' shows the wiring
    >>> kv.init_data("t", (5, 2), "float32", range_policy(5))
    >>> kv.create_table("users", HashTableSpec(4))
    >>> kv.store("t").column("weight").device, kv.contains("users", [7]).tolist()
    (device(type='cpu'), [False])
"""
import numpy as np
import torch

from distemb.errors import KVStoreError
from distemb.kernels import cuda, half
from distemb.kernels.cuda import cuda_device
from distemb.kernels.cuda_half import CudaHalfOps
from distemb.kernels.hashtable import keys_array
from distemb.arrays import check_values_shape
from distemb.kvstore.local import LocalKVClient, column_name
from distemb.kvstore.types import refuse_store
from distemb.kvstore.views import RowsOnDevice, dedup_on
from distemb.routers import PolicyRouter
from distemb.stores.device import DeviceDenseStore, DeviceHashStore, as_tensor
from distemb.stores.hash import HashTableSpec

#: What a refused table can do instead.
LOOK_UP_ONTO = "create it on the host and look its rows up onto the GPU with " \
               "emb(ids, device=...)"


class DeviceKVClient(LocalKVClient):
    """Embedded KVClient holding each table as one shard on ``device``: dense tables and
    hash tables (see the module docstring).

    Args:
        device: the ``torch.device`` of the tables (:func:`cuda_device` resolves one).
        ops: the kernel module (default :mod:`distemb.kernels.cuda`); anything with its
            functions and keywords works, e.g. a test's CPU twin on a CPU device.
        half_ops: ``half_ops(rounding_seed)`` -> the kernels of one bfloat16/float16
            table (default :class:`~distemb.kernels.cuda_half.CudaHalfOps`).

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device but the kernels cannot run here.
    """

    ops = cuda
    half_ops = CudaHalfOps

    def __init__(self, device, ops=None, half_ops=None):
        self.device = torch.device(device)
        if ops is not None:
            self.ops = ops
        if half_ops is not None:
            self.half_ops = half_ops
        if self.device.type == "cuda":
            cuda.require_cuda()
        super().__init__(num_threads=1)

    # -- tables: one shard each, made on the device -------------------------------------

    def check_spec(self, name, spec):
        """Refuse what a GPU does not hold: a file table (its rows are files on the host)
        and a store object (it lives in host memory).

        Raises:
            KVStoreError: naming this client and the store.
        """
        if not spec.portable:
            raise refuse_store(self, name, f"a {spec.kind}",
                               f"a store object lives in host memory; pass a HashTableSpec "
                               f"(DynamicEmbedding(..., device={str(self.device)!r})) to "
                               f"hold its rows on {self.device}, or {LOOK_UP_ONTO}")
        if spec.kind not in ("dense", "hash"):
            raise refuse_store(self, name, f"a {spec.kind} store ({type(spec).__name__})",
                               f"it holds dense and hash tables on {self.device}, and a "
                               f"{spec.kind} table's rows stay in host memory; "
                               f"{LOOK_UP_ONTO}")

    def router_of(self, spec):
        """One shard holding every key: a dense table whole on the device, a hash table's
        keys as they are."""
        if spec.num_keys is not None:
            return PolicyRouter.ranges(spec.num_keys, 1)
        return spec.router(1)

    def _make(self, name, spec, router):
        policy = getattr(spec, "policy", None)
        what = f"ids of {name!r}" + (f" ({policy.policy_str})" if policy is not None else "")

        def make(part):
            if isinstance(spec, HashTableSpec):
                return DeviceHashStore.of_spec(spec, self.device, self.ops, self.half_ops)
            seed = None if spec.rounding_seed is None else \
                half.shard_seed(spec.rounding_seed, 0)  # one shard: partition 0's seed
            return DeviceDenseStore(spec.num_keys, spec.row_shape, spec.dtype, self.device,
                                    self.ops, self.half_ops, seed, what)
        self.server.create_table(name, spec, router, [0], make=make)
        return {0}

    def _store(self, table):
        return self.server.table(table.name, 0).store

    def _keys(self, table, ids):
        """Keys as the table's store takes them: host int64 keys for an index on the
        host, a tensor on the device otherwise."""
        if self._store(table).keys_on_host:
            if isinstance(ids, torch.Tensor):
                ids = ids.detach().to("cpu").numpy()
            return keys_array(np.asarray(ids), "keys")
        return ids if isinstance(ids, torch.Tensor) else self.from_host(keys_array(ids))

    # -- rows: one shard, no split --------------------------------------------------------

    def _read(self, table, column, ids):
        return self.server.pull(column_name(table, column), 0, self._keys(table, ids))

    def _write(self, table, column, ids, rows):
        self.server.push(column_name(table, column), 0, self._keys(table, ids), rows)

    def push_update(self, name, ids, grads, rule, hyper):
        table = self.tables.table(name)
        self.server.update(name, 0, self._keys(table, ids), grads, rule, hyper)

    def stored_rows(self, table, column, values, n):
        """``values`` as a tensor on the device (its store rounds 16-bit rows)."""
        return as_tensor(values).to(self.device).reshape(
            (n,) + tuple(table.columns()[column][0]))

    def contains(self, name, keys):
        return super().contains(name, self._host(keys))

    def get(self, name, keys):
        """Rows of held ``keys`` as a host float32 array (nothing inserted or counted)."""
        table = self.tables.table(name)
        keys = self._host(keys)
        table.router.check(keys, "keys")
        rows = self.server.table(name, 0).get(keys, name=name)
        return rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows

    def _remove(self, table, keys):
        return super()._remove(table, self._host(keys))

    def import_(self, name, keys, columns):
        super().import_(name, self._host(keys), columns)

    @staticmethod
    def _host(keys):
        if isinstance(keys, torch.Tensor):
            keys = keys.detach().to("cpu").numpy()
        return keys_array(np.asarray(keys), "keys")

    # -- placement: arrays are torch tensors on self.device -----------------------------

    def from_host(self, array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_host(self, array):
        return array.cpu().numpy() if isinstance(array, torch.Tensor) else array

    def tensor_in(self, x, F):
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        return t.to(self.device)

    def ids_in(self, name, ids, F):
        """Ids as a contiguous int64 tensor on the device, or host keys of a store whose
        index is on the host (checked there).

        Ids on the device are not range-checked here (that would wait for the device):
        a lookup checks them on the device and reports later, a write at once.
        """
        table = self.tables.rows(name)[0]
        t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"ids: expected an integer tensor (int32 or int64), got {t.dtype}")
        if self._store(table).keys_on_host:
            keys = self._host(t.reshape(-1).to(torch.int64))
            table.router.check(keys, f"ids of {name!r}")
            return keys, tuple(t.shape)
        return t.reshape(-1).to(self.device, torch.int64).contiguous(), tuple(t.shape)

    def values_in(self, name, values, F, ids_shape):
        table, column = self.tables.rows(name)
        row_shape, dtype = table.columns()[column]
        t = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
        got = str(t.dtype).replace("torch.", "")
        rows = half.row_dtype(dtype)
        if got != dtype and got != rows:  # float32 into 16-bit rows: rounded on store
            also = f" (or {rows})" if rows != dtype else ""
            raise TypeError(f"values: expected dtype {dtype}{also} for {name!r}, got {got}")
        want = check_values_shape(name, t.shape, ids_shape, row_shape)
        return t.to(self.device, getattr(torch, rows)).reshape(want)  # 16-bit: exact

    def rows_out(self, rows, F):
        return rows

    def coalesce(self, name, ids, grads, F):
        """Sum duplicate ids' gradients here, with the device kernels: a dense table's with
        ``ops.dedup_sum_padded`` (no wait: all N slots, unused ones holding an id outside
        the table, which the update kernels skip), a hash table's by key (the unique keys
        go to the host index)."""
        if not ids:
            return None
        table = self.tables.table(name)
        if self._store(table).keys_on_host:
            uniq, summed = dedup_on(self.ops, self.device, None, table.dim, ids, grads)
            return uniq.cpu().numpy(), summed
        return dedup_on(self.ops, self.device, table.num_keys, table.dim, ids, grads,
                        padded=True)

    def view_on(self, device):
        """Itself for None or its own device; otherwise a view copying rows to ``device``."""
        if device is None:
            return self
        dev = cuda_device(device) if str(device).startswith("cuda") else torch.device(device)
        return self if dev == self.device else RowsOnDevice(self, dev)


__all__ = ["DeviceKVClient", "KVStoreError"]
