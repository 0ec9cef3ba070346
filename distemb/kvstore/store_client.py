"""StoreKVClient: an embedded KVClient whose tables each live in one RowStore.

The placement is a row store chosen by the caller (a hash store for dynamic keys, a
file store for tables beyond RAM, a dense store): pulls are the store's lookups (a hash
store inserts absent keys and counts the access for eviction), pushes upsert, and
``push_update`` hands the rule to the store, which maps keys to slots and runs the same
fused kernels on its columns. Optimizer state is a column of the table's store, so it
moves, persists and is evicted with its row. Ids are keys: any int64 for a hash store,
0..N-1 for dense stores (checked by the store).

Embedded only: one process owns the stores. Sharding dynamic tables over servers (by
key hash) is not implemented yet.

Example:
    >>> import numpy as np
    >>> from distemb.stores import HashStore
    >>> kv = StoreKVClient()
    >>> kv.add_table("t", HashStore(2))
    >>> kv.pull("t", np.array([10**15, -7])).shape, kv.store("t").size()
    ((2, 2), 2)
"""
from distemb.errors import KVStoreError
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.types import DataMeta, KVClient
from distemb.rules import rule_of, state_name


class StoreKVClient(KVClient):
    """Embedded KVClient over named row stores; see the module docstring.

    Args:
        num_threads: OpenMP threads of the kernels run on the stores.
    """

    def __init__(self, num_threads=1):
        self.num_threads = num_threads
        self._stores = {}
        self._states = {}  # KVStore name of an optimizer state -> its table

    def add_table(self, name, store):
        """Hold ``store`` as table ``name``.

        Raises:
            KVStoreError: ``name`` exists.
        """
        if name in self._stores:
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        self._stores[name] = store

    def store(self, name):
        """The RowStore of table ``name``.

        Raises:
            KVStoreError: no such table.
        """
        try:
            return self._stores[name]
        except KeyError:
            raise KVStoreError(f"name {name!r} is not in the KVStore "
                               f"(known: {sorted(self._stores)[:10]})") from None

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        raise KVStoreError(f"init_data({name!r}): a StoreKVClient holds tables added with "
                           "add_table(name, store); use LocalKVClient for DistTensor data")

    def data_meta(self, name):
        if name in self._states:
            raise KVStoreError(f"{name!r} is optimizer state kept beside the rows of table "
                               f"{self._states[name]!r}; read it with that table's export()")
        store = self._stores.get(name)
        if store is None:
            return None
        # rows cross this interface as float32 whatever the store keeps (half rows too)
        return DataMeta((store.size(), store.dim), "float32", None)

    def names(self):
        return list(self._stores)

    def delete_data(self, name):
        store = self._stores.pop(name, None)
        if store is not None:
            store.close()
        self._states = {s: t for s, t in self._states.items() if t != name}

    def pull(self, name, ids):
        return self.store(name).lookup(ids)

    def push(self, name, ids, values):
        self.store(name).scatter(ids, values)

    def init_optimizer(self, name, rule, options):
        """State columns for ``rule`` in table ``name``'s store.

        A new optimizer starts from fresh state, except on a persistent store (a file
        store reopened to resume), which keeps state columns of the same shape.
        """
        store = self.store(name)
        names = {}
        for spec in rule_of(rule).states:
            fill = options.get(spec.init_option, 0) if spec.init_option else 0
            store.add_column(spec.name, spec.shape(store.dim), spec.dtype, fill,
                             keep=store.persistent)
            names[spec.name] = state_name(name, spec.name)
            self._states[names[spec.name]] = name
        return names

    def push_update(self, name, ids, grads, rule, hyper):
        impl = rule_of(rule)
        self.store(name).update(impl, ids, grads, impl.check_hyper(hyper), self.num_threads)

    def ids_in(self, name, ids, F):
        """Keys of any shape as flat int64 keys: any int64 for a hash store (a dense store
        range-checks them itself)."""
        self.store(name)
        arr = self.tensor_in(ids, F)
        return keys_array(arr, "ids"), tuple(arr.shape)

    def close(self):
        """Flush and close every store."""
        for name in list(self._stores):
            self.delete_data(name)
