"""The tables a client knows: each a name, a spec and a router, and its optimizer state.

Every table is one :class:`Table`, whatever its store: a spec
(:mod:`distemb.stores.spec`: dense rows of a partition policy, a hash table, a file
table, a store object) says what its rows are and how its stores are made, a router
(:mod:`distemb.routers`) which shard holds each key. A client keeps its tables in one
:class:`Tables`: one namespace, one check of a new name (attach to a table of the same
spec, refuse any other clash), and the names of optimizer state (``<table>~opt~<state>``,
a column of the table's stores), which are read and written like tables.

Example:
    >>> from distemb.stores.dense import DenseSpec
    >>> tables = Tables()
    >>> spec = DenseSpec((5, 2))
    >>> t = tables.add("w", spec, spec.router())
    >>> tables.set_states("w", "adagrad")
    {'sum': 'w~opt~sum'}
    >>> tables.rows("w~opt~sum")[0].name, tables.meta("w~opt~sum").shape
    ('w', (5, 2))
"""
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from distemb.arrays import GlobalIds
from distemb.errors import KVStoreError, StoreError
from distemb.kernels import half
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.checkpoint import manifest, snapshot
from distemb.kvstore.types import DataMeta, KVClient, refuse_store
from distemb.kvstore.views import view_on_host
from distemb.partition import PartitionPolicy
from distemb.routers import Router
from distemb.rules import rule_of, state_name, state_owner
from distemb.stores.dense import WEIGHT_DTYPES
from distemb.stores.init import ShardInit
from distemb.stores.types import WEIGHT

#: Bytes of rows per request when a table's initial rows are written from a client.
INIT_CHUNK_BYTES = 64 << 20

@dataclass
class Table:
    """One table of a client: its name, spec and router, and its optimizer state columns
    (``{state: (row shape, dtype)}``, made by :meth:`Tables.set_states`)."""

    name: str
    spec: object
    router: Router
    states: Dict[str, Tuple[tuple, str]] = field(default_factory=dict)

    @property
    def num_keys(self) -> Optional[int]:
        """N of a table of the fixed keys 0..N-1; None for any int64 key."""
        return self.spec.num_keys

    @property
    def row_shape(self) -> tuple:
        return tuple(self.spec.row_shape)

    @property
    def dim(self) -> int:
        return int(self.spec.dim)

    @property
    def dtype(self) -> str:
        """The dtype its stores keep rows in."""
        return self.spec.dtype

    @property
    def row_dtype(self) -> str:
        """The dtype rows cross a client's interface in (half rows as float32)."""
        return half.row_dtype(self.spec.dtype)

    @property
    def policy(self):
        """The partition policy its keys are sharded by (a dense table's own, a file
        table's router's), or None (keys routed by their hash)."""
        return getattr(self.spec, "policy", None) or getattr(self.router, "policy", None)

    def columns(self) -> Dict[str, Tuple[tuple, str]]:
        """``{column: (row shape, dtype as stored)}``: the weight, then the states."""
        return {WEIGHT: (self.row_shape, self.dtype), **self.states}

    def meta(self, column: str = WEIGHT) -> DataMeta:
        shape, dtype = (self.row_shape, self.dtype) if column == WEIGHT else \
            self.states[column]
        return DataMeta((self.num_keys,) + tuple(shape), dtype, self.policy)


class Tables:
    """A client's tables by name (see the module docstring).

    Args:
        client: the client (its errors name it, and say when it is closed).
    """

    def __init__(self, client=None):
        self._tables: Dict[str, Table] = {}
        self._client = client

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def names(self) -> List[str]:
        """Every table's name and its states' names."""
        out = []
        for t in self._tables.values():
            out += [t.name] + [state_name(t.name, s) for s in t.states]
        return out

    def tables(self) -> List[Table]:
        return list(self._tables.values())

    def existing(self, name: str, spec) -> Optional[Table]:
        """The table ``name`` a new one of ``spec`` attaches to (same spec but for the
        initialiser), or None when there is none: the one check of a new name.

        Raises:
            KVStoreError: ``name`` is a table of another spec (naming what differs) or
                the name of optimizer state.
        """
        if state_owner(name) is not None and state_owner(name) in self._tables:
            raise KVStoreError(f"name {name!r} already exists in the KVStore (optimizer "
                               f"state of {state_owner(name)!r})")
        have = self._tables.get(name)
        if have is None:
            return None
        diff = have.spec.differences(spec)
        if diff:
            raise KVStoreError(f"name {name!r} already exists in the KVStore: table {name!r} "
                               f"exists with {diff}; use another name, or the same "
                               "arguments to attach to it")
        return have

    def add(self, name: str, spec, router: Router) -> Table:
        table = Table(name, spec, router)
        self._tables[name] = table
        return table

    def drop(self, name: str) -> Optional[Table]:
        """Forget table ``name`` (its states with it); the table, or None."""
        return self._tables.pop(name, None)

    def table(self, name: str) -> Table:
        """The table ``name``.

        Raises:
            KVStoreError: no such table (or the client is closed).
        """
        t = self._tables.get(name)
        if t is None:
            raise self.unknown(name)
        return t

    def rows(self, name: str) -> Tuple[Table, str]:
        """(table, column) of ``name``: a table's weight, or its optimizer state.

        Raises:
            KVStoreError: no such table or state.
        """
        t = self._tables.get(name)
        if t is not None:
            return t, WEIGHT
        owner = state_owner(name)
        t = self._tables.get(owner) if owner is not None else None
        column = name[len(state_name(owner, "")):] if owner is not None else None
        if t is None or column not in t.states:
            raise self.unknown(name)
        return t, column

    def meta(self, name: str) -> Optional[DataMeta]:
        """The :class:`DataMeta` of table or state ``name``, or None."""
        try:
            table, column = self.rows(name)
        except KVStoreError:
            return None
        return table.meta(column)

    def set_states(self, name: str, rule) -> Dict[str, str]:
        """Name the optimizer state columns of update rule ``rule`` in table ``name``.

        Returns:
            ``{state: its KVStore name}``.
        """
        t = self.table(name)
        specs = rule_of(rule).states
        t.states = {s.name: (tuple(s.shape(t.dim)), s.dtype) for s in specs}
        return {s.name: state_name(name, s.name) for s in specs}

    def unknown(self, name: str) -> KVStoreError:
        """The error of a name this client does not hold."""
        if self._client is not None and self._client.closed:
            return KVStoreError(f"name {name!r}: this {type(self._client).__name__} is closed "
                                "(its context was closed, and its tables with it); make "
                                "tables on an open context")
        return KVStoreError(f"name {name!r} is not in the KVStore (known: "
                            f"{sorted(self.names())[:10]})")


def check_entry_rows(entry: dict, table: Table, directory: str) -> None:
    """KVStoreError unless checkpoint ``entry`` holds as many rows as table ``table``
    when its keys are fixed: such a table loads a checkpoint of exactly its keys."""
    if table.num_keys is None:
        return
    saved = manifest.entry_rows(entry)
    if saved != table.num_keys:
        raise KVStoreError(f"{directory}: table {table.name!r} was saved with {saved:,} "
                           f"rows, the live one has {table.num_keys:,}")


def partition_keys(policy: PartitionPolicy, part: int) -> np.ndarray:
    """The global ids of partition ``part`` of ``policy``, in its local order."""
    try:
        start, step, count = policy.id_progression(part)
        return start + step * np.arange(count, dtype=np.int64)
    except NotImplementedError:
        ids = np.arange(policy.get_size(), dtype=np.int64)
        mine = ids[policy.to_partid(ids) == part]
        return mine[np.argsort(policy.to_local(mine), kind="stable")]


def refuse_fixed(table: Table, what: str) -> None:
    """The one refusal of ``what`` (a removal, an eviction) on a table of fixed keys,
    naming the table and its store.

    Raises:
        StoreError: the table's keys are fixed (a dense or file table).
    """
    if table.num_keys is not None:
        raise StoreError(f"{what}: {table.name!r} is a {table.spec.kind} table, which "
                         f"holds the fixed keys 0..{table.num_keys - 1}; only tables of any "
                         f"key (hash tables: DistEmbedding(None, dim)) {what} keys")


class TableClient(KVClient):
    """The one path of every client that holds tables (embedded, servers, collective
    ranks, a GPU): creation, routing, optimizer state, key operations and checkpoints
    written once, over the hooks an implementation fills (where shards are made, read,
    written and updated: ``_make``, ``_read``, ``_write``, ``_init_states``,
    ``_remove``, ``_evict``, ``_save``, ``_load``, and ``delete_data``, ``push_update``,
    ``size``, ``contains``, ``get``, ``export``).
    """

    def view_on(self, device):
        return view_on_host(self, device)

    #: Whether this client's shards live in other processes (a spec must travel there),
    #: and what those are called in errors.
    sharded = False
    shard_holders = "servers"

    def create_table(self, name: str, spec) -> None:
        """Make table ``name`` from a table spec (:mod:`distemb.stores.spec`), or attach
        to the table of that name made from the same spec (collective in a cluster: every
        trainer calls it, with the same spec; the first creator's initial rows win).

        A shard initialiser (:class:`~distemb.stores.init.ShardInit`, DGL's
        ``init_func(shape, dtype)``) runs here, where the function lives, once per
        partition of the spec's policy whose shard this call made, and its rows are
        written where they live.

        Raises:
            KVStoreError: ``name`` exists with another spec, or this placement cannot
                hold the spec's store (naming both).
            StoreError: a store cannot be made (a given store already backs a table).
        """
        self.check_spec(name, spec)
        if self.tables.existing(name, spec) is not None:
            return
        router = self.router_of(spec)
        made = self._make(name, spec, router)
        table = self.tables.add(name, spec, router)
        try:
            self._initial_rows(table, made)
        except BaseException:
            self.delete_data(name)
            raise

    def check_spec(self, name: str, spec) -> None:
        """Refuse a spec this placement cannot hold: a client whose shards live in other
        processes (:attr:`sharded`) holds the specs those processes can make.

        Raises:
            KVStoreError: naming the placement and the store (:func:`refuse_store`).
        """
        if self.sharded and not spec.portable:
            raise refuse_store(self, name, f"a {spec.kind} object",
                               "a store object lives in one process, and this client's "
                               f"tables are sharded over its {self.shard_holders}; pass a "
                               "table spec instead (e.g. DynamicEmbedding, or "
                               "StoreEmbedding(FileTableSpec(...))): each of them makes its "
                               "own shard's store from it")

    def router_of(self, spec):
        """The router of a table made from ``spec`` on this placement."""
        return spec.router(self.num_servers)

    @abstractmethod
    def _make(self, name: str, spec, router) -> Set[int]:
        """Make the shards of table ``name`` where they live; the shards made by this
        call (none when another trainer made them first)."""

    def _initial_rows(self, table: Table, made: Set[int]) -> None:
        """Write a shard initialiser's rows, one call per partition of the spec's policy
        whose shard ``made`` has (see :meth:`create_table`)."""
        init = table.spec.init
        if not isinstance(init, ShardInit) or not made:
            return
        policy = table.spec.policy
        for part in range(policy.num_partitions):
            keys = partition_keys(policy, part)
            if not len(keys) or int(table.router.part_of(keys[:1])[0]) not in made:
                continue
            shape = (len(keys),) + table.row_shape
            rows = init(shape, table.dtype)
            if tuple(rows.shape) != shape:
                raise KVStoreError(f"init_func of {table.name!r}: returned shape "
                                   f"{tuple(rows.shape)}, expected {shape}")
            rows = self.stored_rows(table, WEIGHT, rows, len(keys))
            step = max(1, INIT_CHUNK_BYTES // max(1, rows[:1].nbytes))
            for lo in range(0, len(keys), step):
                self._write_initial(table, self.from_host(keys[lo:lo + step]),
                                    rows[lo:lo + step])

    def _write_initial(self, table: Table, keys, rows) -> None:
        """Write initial rows (as stored) made by this process's shard initialiser."""
        self._write(table, WEIGHT, keys, rows)

    def stored_rows(self, table: Table, column: str, values, n: int):
        """``values`` for ``n`` rows of ``column`` of ``table`` as its store keeps them:
        float32 rows of a half weight rounded to nearest-even (16 bits cross between
        processes), any other rows cast to the column's dtype."""
        shape, dtype = table.columns()[column]
        values = np.asarray(values)
        if half.is_half(dtype):
            if values.dtype != half.storage_dtype(dtype):
                values = half.encode(np.asarray(values, np.float32), dtype)
        elif values.dtype != np.dtype(dtype):
            values = values.astype(dtype)
        return np.ascontiguousarray(values).reshape((n,) + tuple(shape))

    def pull(self, name: str, ids: GlobalIds):
        table, column = self.tables.rows(name)
        return self._read(table, column, ids)

    def push(self, name: str, ids: GlobalIds, values) -> None:
        table, column = self.tables.rows(name)
        self._write(table, column, ids, self.stored_rows(table, column, values, len(ids)))

    @abstractmethod
    def _read(self, table: Table, column: str, ids: GlobalIds):
        """Rows ``ids`` of ``column`` (the weight decoded to float32)."""

    @abstractmethod
    def _write(self, table: Table, column: str, ids: GlobalIds, rows) -> None:
        """Write ``rows``, as stored, into rows ``ids`` of ``column``."""

    def init_optimizer(self, name: str, rule, options: Dict[str, float]) -> Dict[str, str]:
        table = self.tables.table(name)
        if table.dtype not in WEIGHT_DTYPES or len(table.row_shape) != 1:
            raise KVStoreError(f"optimizer of {name!r}: needs a 2-d table of "
                               f"{'/'.join(WEIGHT_DTYPES)}, it has rows {table.row_shape} "
                               f"{table.dtype}")
        # an unknown rule, or an option its states do not start from, is refused before
        # any state is made (a cluster's every rank, before its barrier)
        options = rule_of(rule).options_from(options)
        self._init_states(table, rule, options)
        return self.tables.set_states(name, rule)

    @abstractmethod
    def _init_states(self, table: Table, rule, options: Dict[str, float]) -> None:
        """Make the state columns of ``rule`` in every shard of ``table``."""

    def remove(self, name: str, keys) -> int:
        table = self.tables.table(name)
        refuse_fixed(table, "remove")
        return self._remove(table, keys_array(keys))

    def evict(self, name: str, target_size: int, policy=None) -> np.ndarray:
        table = self.tables.table(name)
        refuse_fixed(table, "evict")
        if isinstance(target_size, bool) or not isinstance(target_size, (int, np.integer)) \
                or target_size < 0:
            raise ValueError(f"target_size: expected an int >= 0, got {target_size!r}")
        return self._evict(table, int(target_size), policy)

    @abstractmethod
    def _remove(self, table: Table, keys: np.ndarray) -> int:
        """Remove ``keys`` of a table of any key from their shards."""

    @abstractmethod
    def _evict(self, table: Table, target_size: int, policy) -> np.ndarray:
        """Evict every shard of a table of any key down to its share of ``target_size``."""

    def export(self, name: str, columns: Optional[List[str]] = None):
        table = self.tables.table(name)
        cols = list(columns) if columns is not None else list(table.columns())
        missing = [c for c in cols if c not in table.columns()]
        if missing:
            raise KVStoreError(f"columns: {missing} not in table {name!r} (has "
                               f"{sorted(table.columns())})")
        parts = self._export(table, cols)
        keys = np.concatenate([np.empty(0, np.int64)] + [k for k, _ in parts])
        order = np.argsort(keys, kind="stable")
        return keys[order], {c: np.concatenate([r[c] for _, r in parts])[order]
                             for c in cols} if parts else {}

    @abstractmethod
    def _export(self, table: Table, columns: List[str]) -> list:
        """``(keys, {column: rows})`` of every shard of ``table``, in any order."""

    def import_(self, name: str, keys, columns: Dict[str, np.ndarray]) -> None:
        table = self.tables.table(name)
        keys = keys_array(keys, "keys")
        have = table.columns()
        missing = [c for c in columns if c not in have]
        if missing:  # refused before any row is written
            raise StoreError(f"columns: {missing} not in table {name!r} (has "
                             f"{sorted(have)}; create the optimizer first to import its "
                             "state)")
        for c, values in columns.items():
            if len(values) != len(keys):
                raise StoreError(f"columns[{c!r}]: expected {len(keys)} rows, got "
                                 f"{len(values)}")
        table.router.check(keys, "keys")
        for c in sorted(columns, key=lambda c: c != WEIGHT):
            self._write(table, c, self.from_host(keys),
                        self.stored_rows(table, c, columns[c], len(keys)))

    def save_table(self, name: str, directory: str, save_id: str,
                   columns: Sequence[str], parent: Optional[str] = None) -> dict:
        table = self.tables.table(name)
        records = self._save(table, directory, save_id, list(columns), parent)
        return snapshot.new_entry((table.num_keys,) + table.row_shape, table.dtype,
                                  records, table.policy)

    def load_table(self, name: str, directory: str, entry: dict,
                   columns: Sequence[str]) -> None:
        table = self.tables.table(name)
        check_entry_rows(entry, table, directory)
        self._load(table, directory, entry, list(columns))

    @abstractmethod
    def _save(self, table: Table, directory: str, save_id: str, columns: List[str],
              parent: Optional[str]) -> list:
        """Every shard's checkpoint record of ``table`` (written where it lives; a delta
        since save ``parent`` when given)."""

    @abstractmethod
    def _load(self, table: Table, directory: str, entry: dict, columns: List[str]) -> None:
        """Every shard of ``table`` filled from ``entry``, all checked before any write."""
