"""Clients of tables on row stores: the StoreClient interface and StoreKVClient (embedded).

A :class:`StoreClient` is a KVClient whose tables are keyed by the keys of row stores
(any int64 for a hash store): pulls are lookups (a hash store inserts absent keys and
counts the access for eviction), pushes upsert, and ``push_update`` runs the rule on the
store's columns, so optimizer state moves, persists and is evicted with its row. On top
of the KVClient methods it manages keys (``remove``, ``contains``, ``get``, ``evict``,
``size``), moves whole tables (``export``/``import_``) and checkpoints them.

Implementations: :class:`StoreKVClient` (one process owns the stores) and
:class:`~distemb.kvstore.store_remote.RemoteStoreClient` (a hash store per server, keys
sharded by :func:`~distemb.partition.key_partition`). Both run one shared test suite
(tests/test_store_client_suite.py).

Example:
    >>> import numpy as np
    >>> from distemb.stores import HashStore
    >>> kv = StoreKVClient()
    >>> kv.add_table("t", HashStore(2))
    >>> kv.pull("t", np.array([10**15, -7])).shape, kv.size("t")
    ((2, 2), 2)
"""
import abc
from typing import Dict, List, Optional, Tuple

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels.hashtable import keys_array
from distemb.kvstore import store_snapshot
from distemb.kvstore.server import KVServer
from distemb.kvstore.types import DataMeta, KVClient
from distemb.rules import rule_of, state_name
from distemb.stores.types import WEIGHT

#: (N,) int64 keys of a store table.
Keys = np.ndarray


def init_state_columns(store, rule, options):
    """(Re)create ``rule``'s state columns in ``store``, at their initial values.

    A new optimizer starts from fresh state, except on a persistent store (a file store
    reopened to resume), which keeps state columns of the same shape.

    Returns:
        the state names of the rule, in order.
    """
    specs = rule_of(rule).states
    for spec in specs:
        fill = options.get(spec.init_option, 0) if spec.init_option else 0
        store.add_column(spec.name, spec.shape(store.dim), spec.dtype, fill,
                         keep=store.persistent)
    return [s.name for s in specs]


class StoreClient(KVClient):
    """Interface of a client of store tables (see the module docstring).

    Tables are made with :meth:`create_table` (a hash store from a spec, anywhere) or
    :meth:`add_table` (a given store object: embedded only). Keys cross this interface
    as int64 numpy arrays, rows as float32 (whatever the stores keep).
    """

    def __init__(self):
        self._states = {}  # KVStore name of an optimizer state -> its table
        self._specs = {}  # name -> the HashTableSpec of a table made by create_table

    def _exists(self, name: str, spec) -> bool:
        """Whether table ``name`` exists already, made from a spec like ``spec`` (then a
        second ``DynamicEmbedding(name=...)`` attaches to it, as a DistTensor does).

        Raises:
            KVStoreError: ``name`` exists with another spec, or as a given store object.
        """
        if name not in self.names():
            return False
        have = self._specs.get(name)
        if have is None:
            raise KVStoreError(f"name {name!r} already exists in the KVStore (a table on a "
                               "given store object); pick another name")
        diff = have.differences(spec)
        if diff:
            raise KVStoreError(f"table {name!r} exists with {diff}; use another name, or "
                               "the same arguments to attach to it")
        return True

    @abc.abstractmethod
    def create_table(self, name: str, spec) -> None:
        """Make dynamic table ``name`` from a :class:`~distemb.stores.spec.HashTableSpec`
        (collective in a cluster: every trainer calls it, with the same spec)."""

    @abc.abstractmethod
    def add_table(self, name: str, store) -> None:
        """Hold the RowStore ``store`` as table ``name`` (embedded only)."""

    @abc.abstractmethod
    def dim(self, name: str) -> int:
        """Row length of table ``name``."""

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Keys held by table ``name`` (over every shard)."""

    @abc.abstractmethod
    def capacity(self, name: str) -> Optional[int]:
        """Keys table ``name`` holds at most (None: unbounded)."""

    @abc.abstractmethod
    def remove(self, name: str, keys: Keys) -> int:
        """Remove ``keys`` with their state; how many were present."""

    @abc.abstractmethod
    def contains(self, name: str, keys: Keys) -> np.ndarray:
        """Bool per key: held or not (nothing inserted, no access counted)."""

    @abc.abstractmethod
    def get(self, name: str, keys: Keys) -> np.ndarray:
        """Rows of ``keys`` without inserting or counting them.

        Raises:
            MissingKeyError: a key is not held (never inserted, removed or evicted).
        """

    @abc.abstractmethod
    def evict(self, name: str, target_size: int, policy=None) -> Keys:
        """Evict keys by ``policy`` (default: the table's) down to ``target_size``
        (split evenly over the shards); returns the evicted keys."""

    @abc.abstractmethod
    def export(self, name: str, columns: Optional[List[str]] = None
               ) -> Tuple[Keys, Dict[str, np.ndarray]]:
        """(keys ascending, {column: rows}) of every key held (every column when None;
        the weight as float32)."""

    @abc.abstractmethod
    def import_(self, name: str, keys: Keys, columns: Dict[str, np.ndarray]) -> None:
        """Upsert ``keys`` with rows of each of ``columns`` (what :meth:`export` gave).

        Raises:
            StoreError: an unknown column, or rows of the wrong shape.
        """

    def flush(self, name: str) -> None:
        """Make completed writes of ``name`` durable (file stores; no-op otherwise)."""

    # -- KVClient, written once for every store client ----------------------------------

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        raise KVStoreError(f"init_data({name!r}): a store client holds tables made with "
                           "create_table/add_table; DistTensor data needs another client")

    def data_meta(self, name):
        if name in self._states:
            raise KVStoreError(f"{name!r} is optimizer state kept beside the rows of table "
                               f"{self._states[name]!r}; read it with that table's export()")
        if name not in self.names():
            return None
        # rows cross this interface as float32 whatever the store keeps (half rows too)
        return DataMeta((self.size(name), self.dim(name)), "float32", None)

    def row_dim(self, name):
        return self.dim(name)

    def ids_in(self, name, ids, F):
        """Keys of any shape as flat int64 keys (a dense store range-checks them itself).

        Raises:
            TypeError: ``ids`` are not integers.
        """
        self.dim(name)  # the error for an unknown table
        arr = self.tensor_in(ids, F)
        return keys_array(arr, "ids"), tuple(arr.shape)

    def values_in(self, name, values, F, num_ids):
        arr = self.tensor_in(values, F)
        got = F.dtype_of(arr) if F.is_tensor(arr) else arr.dtype.name
        if got != "float32":
            raise TypeError(f"values: expected dtype float32 for {name!r}, got {got}")
        want = (num_ids, self.dim(name))
        if int(np.prod(arr.shape)) != int(np.prod(want)):
            raise ValueError(f"values: expected shape {want} for {num_ids} ids, "
                             f"got {tuple(arr.shape)}")
        return arr.reshape(want)

    def _state_names(self, name, rule):
        names = {}
        for sname in (s.name for s in rule_of(rule).states):
            names[sname] = state_name(name, sname)
            self._states[names[sname]] = name
        return names

    # -- optimizer state and checkpoints: state columns travel with their rows ----------

    def checkpoint_names(self, name, state_names):
        return [name]  # the table's entry holds its state columns

    def table_state(self, name, state_names):
        """{"keys": keys, state: rows} of every key held (``opt.state_dict()``)."""
        keys, cols = self.export(name, [s for s in state_names])
        return {"keys": keys, **cols}

    def load_table_state(self, name, state_names, entry):
        """Upsert what :meth:`table_state` gave (keys absent here are inserted).

        Raises:
            KVStoreError: ``entry`` lacks the keys or a state.
        """
        missing = [k for k in ["keys"] + list(state_names) if k not in entry]
        if missing:
            raise KVStoreError(f"state_dict: table {name!r} lacks {missing} (a store "
                               f"table's state is keyed: 'keys' and one array per state)")
        self.import_(name, keys_array(np.asarray(entry["keys"]), "keys"),
                     {s: np.ascontiguousarray(np.asarray(entry[s])) for s in state_names})


class StoreKVClient(StoreClient):
    """Embedded store client; see the module docstring.

    Each table is one :class:`~distemb.kvstore.shard.ShardTable` (its store, lock and row
    versions) in a :class:`~distemb.kvstore.server.KVServer`: the embedded context's own,
    beside its array tables (one registry, one namespace), or a new one.

    Args:
        num_threads: OpenMP threads of the kernels run on the stores.
        server: the KVServer holding the tables (a new one when None).
    """

    PART = 0  # embedded, one shard holds every key

    def __init__(self, num_threads=1, server=None):
        super().__init__()
        self.num_threads = num_threads
        self.server = server if server is not None else KVServer(num_threads=num_threads)
        self._names = []

    def create_table(self, name, spec):
        if self._exists(name, spec):
            return
        self._add(name, spec.make_store(), spec)
        self._specs[name] = spec

    def add_table(self, name, store):
        """Hold ``store`` as table ``name`` (closed when the table is deleted).

        Raises:
            KVStoreError: ``name`` exists (a table of any kind).
        """
        self._add(name, store, None)

    def _add(self, name, store, spec):
        if name in self._names or self.server.has(name, self.PART):
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        self.server.add_table(name, self.PART, store, spec)
        self._names.append(name)

    def _table(self, name):
        if name not in self._names:
            raise KVStoreError(f"name {name!r} is not in the KVStore "
                               f"(known: {sorted(self._names)[:10]})")
        return self.server.table(name, self.PART)

    def store(self, name):
        """The RowStore of table ``name``.

        Raises:
            KVStoreError: no such table.
        """
        return self._table(name).store

    def names(self):
        return list(self._names)

    def dim(self, name):
        return self.store(name).dim

    def size(self, name):
        return self.store(name).size()

    def capacity(self, name):
        return self.store(name).capacity

    def remove(self, name, keys):
        t = self._table(name)
        with t.write():
            return t.store.remove(keys_array(keys))

    def contains(self, name, keys):
        t = self._table(name)
        with t.read():
            return t.store.find(keys_array(keys)) >= 0

    def get(self, name, keys):
        t = self._table(name)
        with t.read():
            return t.store.gather(keys_array(keys), insert=False)

    def evict(self, name, target_size, policy=None):
        t = self._table(name)
        with t.write():
            return t.store.evict(target_size, policy)

    def export(self, name, columns=None):
        t = self._table(name)
        with t.read():
            keys, cols = t.store.export()
        cols = {c: a for c, a in cols.items() if c in t.columns()}
        if columns is not None:
            missing = [c for c in columns if c not in cols]
            if missing:
                raise KVStoreError(f"columns: {missing} not in table {name!r} "
                                   f"(has {sorted(cols)})")
            cols = {c: cols[c] for c in columns}
        return keys, cols

    def import_(self, name, keys, columns):
        t = self._table(name)
        with t.write():
            t.store.import_(keys, columns)
        t.bump_all()  # cached copies of these rows are void

    def flush(self, name):
        t = self._table(name)
        with t.read():
            t.store.flush()

    def delete_data(self, name):
        if name in self._names:
            self._names.remove(name)
            self.server.drop_shard(name, self.PART)  # closes the store
        self._specs.pop(name, None)
        self._states = {s: t for s, t in self._states.items() if t != name}

    def pull(self, name, ids):
        return self._table(name).pull(ids)

    def push(self, name, ids, values):
        self._table(name).push(ids, values)

    def init_optimizer(self, name, rule, options):
        """State columns for ``rule`` in table ``name``'s store (see
        :func:`init_state_columns`)."""
        t = self._table(name)
        with t.write():
            init_state_columns(t.store, rule, options)
        t.bump_all()
        return self._state_names(name, rule)

    def push_update(self, name, ids, grads, rule, hyper):
        impl = rule_of(rule)
        self._table(name).update(impl, ids, grads, impl.check_hyper(hyper), self.num_threads)

    def checkpoint_entry(self, name, directory, save_id):
        t = self._table(name)
        with t.read():
            rec = store_snapshot.save_store(directory, save_id, name, 0, t.store,
                                            columns=t.columns())
        return store_snapshot.store_entry(t.store.dim, t.store.dtype, [rec])

    def restore_entry(self, name, directory, entry):
        """Replace table ``name``'s keys with those of a checkpoint (any server count)."""
        t = self._table(name)
        store_snapshot.check_entry(entry, name, t.store.dim, directory)
        with t.write():
            if not t.store.fixed_keys:  # a fixed key set: the checkpoint overwrites each key
                t.store.remove(t.store.keys())
            store_snapshot.load_store(directory, entry, t.store,
                                      lambda keys: np.ones(len(keys), bool))
        t.bump_all()

    def close(self):
        """Flush and close every store."""
        for name in list(self._names):
            self.delete_data(name)


__all__ = ["StoreClient", "StoreKVClient", "init_state_columns", "WEIGHT"]
