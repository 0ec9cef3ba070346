"""LocalKVClient: the embedded default, a KVClient driving an in-process KVServer."""
import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kvstore import snapshot
from distemb.kvstore.server import KVServer
from distemb.kvstore.store_client import StoreKVClient
from distemb.kvstore.types import DataMeta, KVClient, check_new_name, check_rounding


def init_shard(init_func, shape, dtype, name):
    """One shard's initial array: zeros, or ``init_func(shape, dtype)`` checked.

    Half-precision shards (``dtype`` 'bfloat16' or 'float16') hold the values rounded to
    nearest-even, in their storage dtype (:func:`distemb.kernels.half.storage_dtype`).

    The shard is always a numpy allocation, never the array ``init_func`` returned:
    numpy asks the kernel for transparent huge pages on large arrays (torch's allocator
    does not), and random-row gathers and updates on a table far larger than the TLB
    reach run ~30% faster on 2 MB pages. The copy is paid once, at creation.
    """
    store = half.storage_dtype(dtype)
    if init_func is None:
        return np.zeros(shape, dtype=store)  # all-zero bits are 0.0 in every float format
    arr = np.asarray(init_func(shape, dtype))
    if arr.shape != shape:
        raise KVStoreError(f"init_func of {name!r}: returned shape {arr.shape}, "
                           f"expected {shape}")
    if half.is_half(dtype) and arr.dtype != store:
        return half.encode(arr, dtype)
    shard = np.empty(shape, dtype=store)
    np.copyto(shard, arr, casting="unsafe")  # the conversion ascontiguousarray made
    return shard


class LocalKVClient(KVClient):
    """Embedded KVClient: every partition of every table lives in this process.

    Args:
        server: the in-process :class:`KVServer` (a new one when None).
        num_threads: OpenMP threads of that server's kernels.

    Example:
        >>> from distemb.partition import range_policy
        >>> kv = LocalKVClient()
        >>> kv.init_data("t", (5, 2), "float32", range_policy(5))
        >>> kv.pull("t", np.array([4])).shape
        (1, 2)
    """

    def __init__(self, server=None, num_threads=1):
        self.server = server or KVServer(num_threads=num_threads)
        self.num_threads = self.server.num_threads
        self._meta = {}
        self._stores = None  # the StoreKVClient of row-store tables, made on first use

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        check_new_name(self._meta, name)
        check_rounding(dtype, rounding_seed)
        for part in range(policy.num_partitions):
            sshape = (policy.get_part_size(part),) + tuple(shape[1:])
            self.server.create(name, part, init_shard(init_func, sshape, dtype, name),
                               rounding_seed=rounding_seed)
        self._meta[name] = DataMeta(tuple(shape), dtype, policy)

    def delete_data(self, name):
        self._meta.pop(name, None)
        self.server.drop(name)

    def pull(self, name, ids):
        meta = self._meta_of(name)
        # rows as float32 for half tables: decoded in the gather (one pass)
        out = np.empty((len(ids),) + meta.shape[1:], dtype=half.row_dtype(meta.dtype))
        if meta.policy.num_partitions == 1:  # local ids are global ids
            return self.server.pull(name, 0, ids, out=out)
        for part, pos, local in meta.policy.split(ids):
            out[pos] = self.server.pull(name, part, local,
                                        out=np.empty((len(local),) + meta.shape[1:], out.dtype))
        return out

    def push(self, name, ids, values):
        meta = self._meta_of(name)
        if meta.policy.num_partitions == 1:
            self.server.push(name, 0, ids, values)
            return
        for part, pos, local in meta.policy.split(ids):
            self.server.push(name, part, local, values[pos])

    def push_update(self, name, ids, grads, rule, hyper):
        meta = self._meta_of(name)
        if meta.policy.num_partitions == 1:
            self.server.update(name, 0, ids, grads, rule, hyper)
            return
        for part, pos, local in meta.policy.split(ids):
            self.server.update(name, part, local, grads[pos], rule, hyper)

    def save_tensor(self, name, directory, save_id):
        meta = self._meta_of(name)
        return [self.server.save_shard(name, part, directory, save_id,
                                       *meta.policy.id_progression(part)[:2])
                for part in range(meta.policy.num_partitions)]

    def load_tensor(self, name, directory):
        meta = self._meta_of(name)
        entry = snapshot.tensor_entry(snapshot.read_manifest(directory), name, directory)
        for part in range(meta.policy.num_partitions):
            start, step, _ = meta.policy.id_progression(part)
            self.server.load_shard(name, part, directory, entry, start, step)

    def store_client(self):
        """The :class:`~distemb.kvstore.store_client.StoreKVClient` of this client's
        context (stores in this process): one per client, closed (flushed) with it."""
        if self._stores is None:
            self._stores = StoreKVClient(self.server.num_threads, self.server)
        return self._stores

    def close(self):
        for name in list(self._meta):
            self.delete_data(name)
        if self._stores is not None:
            self._stores.close()
