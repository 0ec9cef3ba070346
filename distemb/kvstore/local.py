"""LocalKVClient: the embedded default, a KVClient driving an in-process KVServer."""
import numpy as np

from distemb.errors import KVStoreError, StoreError
from distemb.kernels import half
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.checkpoint import snapshot
from distemb.kvstore.keyed import KeyedTables
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.types import (DataMeta, KVClient, check_entry_rows, check_new_name,
                                   check_rounding, unknown_name)


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


class LocalKVClient(KeyedTables, KVClient):
    """Embedded KVClient: every partition of every table lives in this process.

    Array tables (``init_data``: rows 0..N-1 of a partition policy, one shard per
    partition) and keyed tables (``create_table``/``add_table``: one
    :class:`~distemb.kvstore.server.shard.ShardTable` over the table's row store, see
    :mod:`distemb.kvstore.keyed`) live side by side in one
    :class:`~distemb.kvstore.server.KVServer`, one namespace, and are read, written and
    updated through its shards alike (a keyed table's state by its name too).

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

    PART = 0  # a keyed table's one shard holds every key

    def __init__(self, server=None, num_threads=1):
        self.server = server or KVServer(num_threads=num_threads)
        self.num_threads = self.server.num_threads
        self._meta = {}
        self._keyed = []  # names of keyed tables, in creation order
        self._init_keyed()

    # -- every table: reads, writes and updates through the server's shards ------------

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        if self.is_keyed(name):
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        check_new_name(self._meta, name)
        check_rounding(dtype, rounding_seed)
        for part in range(policy.num_partitions):
            sshape = (policy.get_part_size(part),) + tuple(shape[1:])
            self.server.create(name, part, init_shard(init_func, sshape, dtype, name),
                               rounding_seed=rounding_seed)
        self._meta[name] = DataMeta(tuple(shape), dtype, policy)

    def delete_data(self, name):
        if name in self._keyed:
            self._keyed.remove(name)
        self._forget(name)
        self._meta.pop(name, None)
        self.server.drop(name)  # a keyed table's store is closed (a file flushes)

    def _split(self, table, ids):
        """[(shard, positions or None for all, ids in it)] of ``ids`` of ``table``: an
        array table's partitions by its policy, the ids checked against it (the shards'
        kernels index without bounds checks; a server checks its requests the same way),
        or a keyed table's one shard (it holds every key).

        Raises:
            PartitionError: an id outside an array table's 0..N-1, named.
        """
        if self.is_keyed(table):
            return [(self.PART, None, ids)]
        policy = self._meta_of(table).policy
        policy.check_ids(np.asarray(ids), f"ids of {table!r}")
        return policy.split(ids)

    def pull(self, name, ids):
        table, shape, dtype = self._rows(name)
        # an array table's half rows come as float32, decoded in the gather (one pass); a
        # keyed table's lookup makes its rows
        out = None if self.is_keyed(table) else \
            np.empty((len(ids),) + shape, dtype=half.row_dtype(dtype))
        for part, pos, local in self._split(table, ids):
            if pos is None or len(pos) == len(ids):  # one shard, in order: in place
                return self.server.pull(name, part, local, out=out)
            out[pos] = self.server.pull(name, part, local,
                                        out=np.empty((len(local),) + shape, out.dtype))
        return out

    def push(self, name, ids, values):
        for part, pos, local in self._split(self._rows(name)[0], ids):
            self.server.push(name, part, local, values if pos is None or
                             len(pos) == len(ids) else values[pos])

    def init_optimizer(self, name, rule, options):
        """Optimizer state of table ``name``: state arrays sharded like an array table,
        state columns in a keyed table's store (see
        :meth:`~distemb.kvstore.server.shard.ShardTable.init_states`)."""
        if not self.is_keyed(name):
            return super().init_optimizer(name, rule, options)
        self.server.attach_states(name, self.PART,
                                  self._table(name).init_states(rule, options))
        return self._state_names(name, rule)

    def push_update(self, name, ids, grads, rule, hyper):
        for part, pos, local in self._split(name, ids):
            self.server.update(name, part, local, grads if pos is None or
                               len(pos) == len(ids) else grads[pos], rule, hyper)

    def _held(self, name):
        """``[(part, start, step)]`` of the shards of ``name`` (see
        :meth:`KVServer.save <distemb.kvstore.server.KVServer.save>`)."""
        if self.is_keyed(name):
            return [(self.PART, 0, 1)]
        policy = self._meta_of(name).policy
        return [(p, *policy.id_progression(p)[:2]) for p in range(policy.num_partitions)]

    def save_table(self, name, directory, save_id, columns):
        """Each shard writes its own record (a keyed table's one shard, with its keys)."""
        recs = self.server.save(name, self._held(name), directory, save_id, columns)
        if self.is_keyed(name):
            store = self.store(name)
            rows = store.size() if store.fixed_keys else None
            return snapshot.new_entry((rows, store.dim), store.dtype, recs)
        meta = self._meta_of(name)
        return snapshot.new_entry(meta.shape, meta.dtype, recs, meta.policy)

    def load_table(self, name, directory, entry, columns):
        """Each shard reads the saved keys it holds; every shard is checked before any is
        written. A keyed table's keys are replaced by the checkpoint's (saved by any
        number of shards)."""
        if not self.is_keyed(name):
            check_entry_rows(entry, self._meta_of(name).shape[0], name, directory)
        self.server.load(name, self._held(name), directory, entry, columns)

    def close(self):
        """Drop every table; keyed tables' stores are flushed and closed."""
        for name in list(self._meta) + list(self._keyed):
            self.delete_data(name)
        self.closed = True

    # -- keyed tables (see distemb.kvstore.keyed) ---------------------------------------

    def keyed_names(self):
        return list(self._keyed)

    def is_keyed(self, name):
        return name in self._keyed

    def create_table(self, name, spec):
        if self._exists(name, spec):
            return
        self._add(name, self._make_store(spec), spec)
        self._specs[name] = spec

    def _make_store(self, spec):
        """The store of a table made from ``spec`` (its one shard, in host memory)."""
        return spec.make_store()

    def add_table(self, name, store):
        """Hold ``store`` as keyed table ``name`` (closed when the table is deleted).

        Raises:
            KVStoreError: ``name`` exists (a table of any kind).
            StoreError: ``store`` is closed, or already backs a table (named).
        """
        self._add(name, store, None)

    def _add(self, name, store, spec):
        if name in self._keyed or name in self._meta or self.server.has(name, self.PART):
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        store.claim(name)
        self.server.add_table(name, self.PART, store, spec)
        self._keyed.append(name)

    def _table(self, name):
        if name not in self._keyed:
            raise unknown_name(self, name, "a table on a row store in the KVStore",
                               self._keyed)
        return self.server.table(name, self.PART)

    def store(self, name):
        """The RowStore of keyed table ``name``.

        Raises:
            KVStoreError: no such keyed table.
        """
        return self._table(name).store

    def dim(self, name):
        return self.store(name).dim

    def storage_dtype(self, name):
        return self.store(name).dtype

    def size(self, name):
        return self.store(name).size()

    def capacity(self, name):
        return self.store(name).capacity

    def remove(self, name, keys):
        return self._table(name).remove(keys_array(keys), name)

    def contains(self, name, keys):
        return self._table(name).contains(keys_array(keys))

    def get(self, name, keys):
        return self._table(name).get(keys_array(keys), name=name)

    def evict(self, name, target_size, policy=None):
        return self._table(name).evict(target_size, policy, name)

    def export(self, name, columns=None):
        try:
            return self._table(name).export(columns=columns, name=name)
        except StoreError as e:
            raise KVStoreError(str(e)) from None

    def import_(self, name, keys, columns):
        t = self._table(name)
        with t.write():
            t.store.import_(keys, columns)
        t.bump_all()  # cached copies of these rows are void

    def flush(self, name):
        t = self._table(name)
        with t.read():
            t.store.flush()
