"""Keyed tables: the part of a KVClient that serves tables on row stores.

A keyed table (``DynamicEmbedding``, ``StoreEmbedding``, ``DistEmbedding(storage=...)``)
is addressed by the keys of its stores (any int64 for a hash store) instead of rows
0..N-1 of a partition policy: pulls are lookups (a hash store inserts absent keys and
counts the access for eviction), pushes upsert, and ``push_update`` runs the rule on the
store's columns, so optimizer state moves, persists and is evicted with its row. On top
of the KVClient methods it has its keys managed (``remove``, ``contains``, ``get``,
``evict``, ``size``), its whole contents moved (``export``/``import_``) and checkpointed.

:class:`KeyedTables` is the mixin a placement client takes to hold keyed tables beside
its array tables, in one namespace: :class:`~distemb.kvstore.local.LocalKVClient` (one
process owns the stores) and :class:`~distemb.kvstore.remote.RemoteKVClient` (a store
per server, :mod:`distemb.kvstore.remote_keyed`). It implements, once for every placement, what a keyed table does
differently at the client (its ids, values, metadata, optimizer state and its
``state_dict``) and leaves array tables to the client's own methods. Both run one shared
test suite (tests/test_kvclient_suite.py and tests/test_keyed_suite.py).

Example:
    >>> import numpy as np
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.stores import HashStore
    >>> kv = LocalKVClient()
    >>> kv.add_table("t", HashStore(2))
    >>> kv.pull("t", np.array([10**15, -7])).shape, kv.size("t")
    ((2, 2), 2)
"""
from abc import abstractmethod
from typing import Dict, List, Optional, Tuple

import numpy as np

from distemb.arrays import check_values_shape
from distemb.errors import KVStoreError
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.types import DataMeta, unknown_name
from distemb.rules import rule_of, state_name

#: (N,) int64 keys of a keyed table.
Keys = np.ndarray


class KeyedTables:
    """Mixin of a KVClient holding keyed tables; see the module docstring.

    Listed before :class:`~distemb.kvstore.types.KVClient` in the bases. The client
    implements the keyed half of its storage methods (``create_table``, ``pull`` ... of a
    keyed table) and :meth:`keyed_names`; each method here serves keyed tables and hands
    array tables to the next class in the bases.
    """

    def _init_keyed(self):
        self._states = {}  # KVStore name of a keyed table's optimizer state -> its table
        self._state_rows = {}  # that name -> (row shape, dtype) of the state
        self._specs = {}  # name -> the spec of a keyed table made by create_table

    @abstractmethod
    def keyed_names(self) -> List[str]:
        """Names of this client's keyed tables."""

    def is_keyed(self, name: str) -> bool:
        """Whether ``name`` is a keyed table of this client."""
        return name in self.keyed_names()

    def _exists(self, name: str, spec) -> bool:
        """Whether keyed table ``name`` exists already, made from a spec like ``spec``
        (then a second ``DynamicEmbedding(name=...)`` attaches to it, as a DistTensor
        does).

        Raises:
            KVStoreError: ``name`` exists with another spec, as a given store object, or
                as an array table.
        """
        if name in super().names():
            raise KVStoreError(f"name {name!r} already exists in the KVStore (a dense "
                               "table); pick another name")
        if not self.is_keyed(name):
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

    def _state_names(self, name, rule):
        names = {}
        for spec in rule_of(rule).states:
            names[spec.name] = state_name(name, spec.name)
            self._states[names[spec.name]] = name
            self._state_rows[names[spec.name]] = (spec.shape(self.dim(name)), spec.dtype)
        return names

    def state_of(self, name: str) -> Optional[Tuple[str, str, tuple, str]]:
        """(table, column, row shape, dtype) when ``name`` is the KVStore name of a keyed
        table's optimizer state, else None. Such a state is read and written by its name
        (``pull``/``push`` of held keys, as an array table's state), e.g. by a cache
        writing back the rows it owns."""
        table = self._states.get(name)
        if table is None:
            return None
        return (table, name[len(state_name(table, "")):]) + self._state_rows[name]

    def _rows(self, name: str) -> Tuple[str, tuple, str]:
        """(the table whose shards hold them, row shape, dtype name) of the rows of
        ``name``: a table, or its optimizer state by name (a keyed table's state is a
        column of the table's stores, placed by its router; an array table's state is
        an array table of its own).

        Raises:
            KVStoreError: no such table or state.
        """
        state = self.state_of(name)
        if state is not None:
            return state[0], tuple(state[2]), str(state[3])
        if self.is_keyed(name):
            return name, (self.dim(name),), self.storage_dtype(name)
        meta = self._meta_of(name)
        return name, tuple(meta.shape[1:]), meta.dtype

    def _forget(self, name):
        """Forget keyed table ``name``'s spec and state names (it was deleted)."""
        self._specs.pop(name, None)
        self._states = {s: t for s, t in self._states.items() if t != name}
        self._state_rows = {s: r for s, r in self._state_rows.items() if s in self._states}

    # -- KVClient, for keyed tables; array tables go on to the client's own -------------

    def names(self):
        return super().names() + self.keyed_names()

    def data_meta(self, name):
        if name in self._states:
            raise KVStoreError(f"{name!r} is optimizer state kept beside the rows of table "
                               f"{self._states[name]!r}; read it with that table's export()")
        if not self.is_keyed(name):
            return super().data_meta(name)
        # rows cross this interface as float32 whatever the store keeps (half rows too)
        return DataMeta((self.size(name), self.dim(name)), "float32", None)

    def row_dim(self, name):
        return self.dim(name) if self.is_keyed(name) else super().row_dim(name)

    def ids_in(self, name, ids, F):
        """Keys of any shape as flat int64 keys (a dense store range-checks them itself).

        Raises:
            TypeError: ``ids`` are not integers.
        """
        if not self.is_keyed(name):
            return super().ids_in(name, ids, F)
        arr = self.tensor_in(ids, F)
        return keys_array(arr, "ids"), tuple(arr.shape)

    def values_in(self, name, values, F, ids_shape):
        """float32 rows for keys of shape ``ids_shape``, shaped as the keys + (dim,) or
        (number of keys, dim): float32 values, or values in the table's own 16-bit dtype
        (exact in float32; rounded on store as float32 rows are), as an array table's.

        Raises:
            TypeError: another dtype. ValueError: another shape.
        """
        if not self.is_keyed(name):
            return super().values_in(name, values, F, ids_shape)
        arr = self.tensor_in(values, F)
        got = F.dtype_of(arr) if F.is_tensor(arr) else arr.dtype.name
        own = self.storage_dtype(name)
        if got != "float32" and got != own:
            also = f" (or {own})" if own != "float32" else ""
            raise TypeError(f"values: expected dtype float32{also} for {name!r}, got {got}")
        if got != "float32":
            arr = arr.astype(np.float32)
        return arr.reshape(check_values_shape(name, arr.shape, ids_shape, (self.dim(name),)))

    # -- optimizer state and checkpoints: state columns travel with their rows ----------

    def table_state(self, name, state_names):
        """{"keys": keys, state: rows} of every key of a keyed table (its
        ``opt.state_dict()``)."""
        if not self.is_keyed(name):
            return super().table_state(name, state_names)
        keys, cols = self.export(name, [s for s in state_names])
        return {"keys": keys, **cols}

    def load_table_state(self, name, state_names, entry):
        """Write back what :meth:`table_state` gave, to keys the table holds (restore
        their rows first: a key's state belongs with its row).

        Raises:
            KVStoreError: ``entry`` lacks the keys or a state, or names keys the table
                does not hold (nothing is written).
        """
        if not self.is_keyed(name):
            return super().load_table_state(name, state_names, entry)
        missing = [k for k in ["keys"] + list(state_names) if k not in entry]
        if missing:
            raise KVStoreError(f"state_dict: table {name!r} lacks {missing} (a store "
                               f"table's state is keyed: 'keys' and one array per state)")
        keys = keys_array(np.asarray(entry["keys"]), "keys")
        absent = keys[~np.asarray(self.contains(name, keys), bool)]
        if len(absent):
            raise KVStoreError(f"state_dict: {len(absent)} key(s) of table {name!r} are not "
                               f"in it, e.g. {absent[:5].tolist()}; restore their rows first "
                               "(import_ or a checkpoint), then the optimizer's state")
        self.import_(name, keys, {s: np.ascontiguousarray(np.asarray(entry[s]))
                                  for s in state_names})

    # -- the keyed half a client implements ---------------------------------------------

    @abstractmethod
    def create_table(self, name: str, spec) -> None:
        """Make keyed table ``name`` from a table spec (:mod:`distemb.stores.spec`;
        collective in a cluster: every trainer calls it, with the same spec)."""

    @abstractmethod
    def add_table(self, name: str, store) -> None:
        """Hold the RowStore ``store`` as keyed table ``name`` (embedded only); the store
        backs this table alone (:meth:`~distemb.stores.types.RowStore.claim`)."""

    @abstractmethod
    def dim(self, name: str) -> int:
        """Row length of keyed table ``name``."""

    @abstractmethod
    def storage_dtype(self, name: str) -> str:
        """The dtype keyed table ``name``'s stores keep rows in (they cross this interface
        as float32 whatever it is)."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Keys held by keyed table ``name`` (over every shard)."""

    @abstractmethod
    def capacity(self, name: str) -> Optional[int]:
        """Keys keyed table ``name`` holds at most (None: unbounded)."""

    @abstractmethod
    def remove(self, name: str, keys: Keys) -> int:
        """Remove ``keys`` with their state; how many were present."""

    @abstractmethod
    def contains(self, name: str, keys: Keys) -> np.ndarray:
        """Bool per key: held or not (nothing inserted, no access counted)."""

    @abstractmethod
    def get(self, name: str, keys: Keys) -> np.ndarray:
        """Rows of ``keys`` without inserting or counting them.

        Raises:
            MissingKeyError: a key is not held (never inserted, removed or evicted).
        """

    @abstractmethod
    def evict(self, name: str, target_size: int, policy=None) -> Keys:
        """Evict keys by ``policy`` (default: the table's) down to ``target_size``
        (split evenly over the shards); returns the evicted keys."""

    @abstractmethod
    def export(self, name: str, columns: Optional[List[str]] = None
               ) -> Tuple[Keys, Dict[str, np.ndarray]]:
        """(keys ascending, {column: rows}) of every key held (every column when None;
        the weight as float32)."""

    @abstractmethod
    def import_(self, name: str, keys: Keys, columns: Dict[str, np.ndarray]) -> None:
        """Upsert ``keys`` with rows of each of ``columns`` (what :meth:`export` gave).

        Raises:
            StoreError: an unknown column, or rows of the wrong shape.
        """

    def flush(self, name: str) -> None:
        """Make completed writes of ``name`` durable (file stores; no-op otherwise)."""


class ShardedKeyedTables(KeyedTables):
    """:class:`KeyedTables` of a client whose keyed tables are sharded over other
    processes (a cluster's servers, a collective job's ranks): each shard's store is
    made where it lives from the table's spec, which is all this client keeps of it.

    The client says who holds the shards in :attr:`shard_holder`.
    """

    #: Who makes each shard's store from the spec ("server", "rank"), for the errors.
    shard_holder = "server"

    def keyed_names(self):
        return list(self._specs)

    def is_keyed(self, name):
        return name in self._specs

    def _spec(self, name):
        try:
            return self._specs[name]
        except KeyError:
            raise unknown_name(self, name, "a table on a row store in the KVStore",
                               self._specs) from None

    def add_table(self, name, store):
        """Refused: a store object lives in this process, not where the shards live.

        Raises:
            KVStoreError: always, saying to pass a table spec.
        """
        raise KVStoreError(f"table {name!r}: a store object lives in one process, and this "
                           f"client's tables are sharded over its {self.shard_holder}s; "
                           f"pass a table spec instead (e.g. DynamicEmbedding, or "
                           f"StoreEmbedding(FileTableSpec(...))): each {self.shard_holder} "
                           f"makes its own shard's store from it")

    def dim(self, name):
        return self._spec(name).dim

    def capacity(self, name):
        return self._spec(name).capacity

    def storage_dtype(self, name):
        return self._spec(name).dtype
