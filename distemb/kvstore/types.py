"""The KVClient interface: what trainers need from wherever the rows live.

A client is a placement strategy (as torchrec has one class per sharding strategy): it
owns where rows live and everything that depends on it, so callers never branch on a
device or a mode. Two halves:

- storage: ``init_data``/``delete_data``/``pull``/``push``/``init_optimizer``/
  ``push_update``/``barrier``/``close``, on the client's own arrays (``ops`` is their
  kernel implementation, ``from_host``/``to_host`` convert numpy to and from them);
- placement, trainer side: ``ids_in``/``values_in``/``tensor_in`` turn the backend's
  tensors into the client's arrays (validated), ``rows_out`` turns pulled rows into
  backend tensors, ``coalesce`` sums the gradients of duplicate ids on the client's own
  device with its own kernels, and ``view_on(device)`` is the client through which rows
  are looked up onto ``device`` (itself, or a thin wrapper).

The base class inherits the placement half for host clients (numpy arrays in this
process's memory, or on servers: :class:`~distemb.kvstore.local.LocalKVClient` and
:class:`~distemb.kvstore.remote.RemoteKVClient`) from
:class:`~distemb.kvstore.placement.HostPlacement`. Device clients override it
(:mod:`distemb.kvstore.device`). Ids crossing the storage half are global (type-wise)
int64 ids, already validated against the table's policy by ``ids_in``.

Example:
    >>> import numpy as np
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.partition import range_policy
    >>> kv: KVClient = LocalKVClient()
    >>> kv.init_data("t", (3, 2), "float32", range_policy(3))
    >>> kv.data_meta("t").shape
    (3, 2)
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from distemb import kernels
from distemb.kernels import half
from distemb.arrays import Array, GlobalIds, Rows, Shape, Tensor, UniqueIds, check_shape
from distemb.errors import KVStoreError
from distemb.kvstore import snapshot
from distemb.kvstore.placement import HostPlacement
from distemb.partition import PartitionPolicy
from distemb.rules import Hyper, rule_of, state_init, state_name
from distemb.stores.types import WEIGHT

#: Rows per request when optimizer state is read or written whole (as checkpoints do).
STATE_CHUNK_ROWS = 1 << 20

#: ``init_func(shard_shape, dtype_name)`` -> the shard's initial values.
InitFunc = Callable[[Shape, str], Array]


@dataclass(frozen=True)
class DataMeta:
    """Shape, dtype name and partition policy of one named tensor."""

    shape: Shape
    dtype: str
    policy: PartitionPolicy


def check_entry_rows(entry: dict, rows: int, name: str, directory: str) -> None:
    """KVStoreError unless checkpoint ``entry`` holds ``rows`` rows in all: a table of
    fixed rows loads a checkpoint of exactly its keys (a dense table's or a keyed one's
    whose keys are 0..rows-1), never one it would leave some keys of unloaded."""
    saved = snapshot.entry_rows(entry)
    if saved != rows:
        raise KVStoreError(f"{directory}: table {name!r} was saved with {saved:,} rows, the "
                           f"live one has {rows:,}")


class TableGradients(NamedTuple):
    """One table's share of an optimizer step: its traced gradients, not yet summed, and
    the update to make of them (:meth:`KVClient.apply_gradients`).

    Example:
        >>> from distemb.rules import SGDHyper
        >>> g = TableGradients("t", [np.array([1, 1])], [np.ones((2, 4), np.float32)], "sgd",
        ...                    SGDHyper(lr=0.1))
        >>> g.name, len(g.ids)
        ('t', 1)
    """

    name: str
    ids: Sequence[GlobalIds]    # one flat id array per traced lookup (none: no gradients)
    grads: Sequence[Tensor]     # one (N_i, D) gradient per lookup, any device
    rule: str                   # the update rule (a RuleName or its value)
    hyper: Hyper                # its hyperparameters, should the table step


def check_new_name(meta: Dict[str, DataMeta], name: str) -> None:
    """KVStoreError when ``name`` already exists in ``meta``."""
    if name in meta:
        raise KVStoreError(f"name {name!r} already exists in the KVStore")


#: Largest stochastic-rounding seed (it travels as a message's int field).
MAX_SEED = (1 << 62) - 1


def check_rounding(dtype: str, rounding_seed: Optional[int]) -> None:
    """ValueError unless ``rounding_seed`` is None, or an int in 0..MAX_SEED for a
    bfloat16 table (stochastic rounding is offered for bfloat16 rows only)."""
    if rounding_seed is None:
        return
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, (int, np.integer)) \
            or not 0 <= rounding_seed <= MAX_SEED:
        raise ValueError(f"rounding_seed: expected an int in 0..{MAX_SEED}, got "
                         f"{rounding_seed!r}")
    if dtype != "bfloat16":
        raise ValueError(f"rounding_seed: stochastic rounding is for bfloat16 rows, got "
                         f"dtype {dtype!r}")


class KVClient(HostPlacement, ABC):
    """Interface of a key-value store client; implementations share one test suite.

    Implementations: :class:`~distemb.kvstore.local.LocalKVClient` (embedded, in
    process), :class:`~distemb.kvstore.remote.RemoteKVClient` (server processes),
    :class:`~distemb.kvstore.device.DeviceKVClient` (embedded, tables on a GPU) and the
    views of :mod:`distemb.kvstore.device` (a host table looked up onto a GPU).
    """

    #: The kernel implementation of this client's arrays.
    ops = kernels
    #: The torch device of this client's arrays; None for numpy arrays in host memory.
    #: Informational (``DistEmbedding.device``): callers never branch on it.
    device = None
    num_servers = 1
    #: Processes writing this client's tables, this one included (a cluster's trainers, a
    #: collective job's ranks).
    num_trainers = 1
    #: OpenMP threads of this client's own kernels (coalescing, shared-memory gathers).
    num_threads = 1
    #: Whether every trainer takes part in a checkpoint, each writing and reading its own
    #: shards (collective clients); False: one trainer saves and loads for all.
    all_ranks_checkpoint = False
    #: True once :meth:`close` ran: the client's tables (an embedded one's rows) are gone,
    #: and a name it no longer knows is reported as such (:func:`unknown_name`).
    closed = False

    # -- storage ---------------------------------------------------------------------

    @abstractmethod
    def init_data(self, name: str, shape: Shape, dtype: str, policy: PartitionPolicy,
                  init_func: Optional[InitFunc] = None,
                  rounding_seed: Optional[int] = None) -> None:
        """Create ``name``; ``init_func(shard_shape, dtype_name)`` fills each shard (zeros if None).

        ``init_func`` may return numpy arrays or arrays of this client (see ``tensor_in``).

        Half-precision tables (``dtype`` 'bfloat16' or 'float16') store rows in 16 bits
        (and move them in 16 bits between processes) but are read and written as float32:
        ``pull`` returns float32 rows, ``push`` takes float32 values and rounds them to
        nearest-even; their optimizer state is float32. ``rounding_seed`` (bfloat16 only)
        rounds updates stochastically instead, reproducibly from that seed (see
        :func:`check_rounding`).

        Raises:
            KVStoreError: ``name`` exists, or ``init_func`` returned the wrong shape.
        """

    # Implementations keep the DataMeta of every tensor they know in ``self._meta``.

    def data_meta(self, name: str) -> Optional[DataMeta]:
        """The :class:`DataMeta` of ``name``, or None if absent."""
        return self._meta.get(name)

    def names(self) -> List[str]:
        """Names of all tensors this client knows."""
        return list(self._meta)

    @abstractmethod
    def delete_data(self, name: str) -> None:
        """Drop ``name`` and its shards (no-op when absent)."""

    @abstractmethod
    def pull(self, name: str, ids: GlobalIds) -> Array:
        """Rows ``ids`` of ``name`` as a new array (len(ids),) + shape[1:] (float32 for a
        half-precision table)."""

    @abstractmethod
    def push(self, name: str, ids: GlobalIds, values: Array) -> None:
        """Write ``values`` into rows ``ids`` of ``name`` (last write wins for duplicates)."""

    def init_optimizer(self, name: str, rule, options: Dict[str, float]) -> Dict[str, str]:
        """Create the optimizer state of table ``name`` for update rule ``rule``.

        The default creates each state tensor with :meth:`init_data`, sharded like the
        table; a state that exists is replaced (a new optimizer starts fresh, as torch's).

        Returns:
            dict state name -> KVStore name of that state tensor.

        Raises:
            KVStoreError: no table ``name``, no rule ``rule``, or an option of
                ``options`` the rule's states do not start from (or not finite).
        """
        meta = self._meta_of(name)
        impl = rule_of(rule)
        options = impl.options_from(options)
        names = {}
        for spec in impl.states:
            sname = state_name(name, spec.name)
            self.delete_data(sname)
            shape = (meta.shape[0],) + spec.shape(meta.shape[1])
            self.init_data(sname, shape, spec.dtype, meta.policy,
                           lambda s, d, spec=spec: state_init(spec, s, options))
            names[spec.name] = sname
        return names

    @abstractmethod
    def push_update(self, name: str, ids: UniqueIds, grads: Rows, rule,
                    hyper: Hyper) -> None:
        """Apply update ``rule`` with ``hyper`` to rows ``ids`` (unique) of ``name``.

        ``grads`` is consumed (applied, or copied into a message) before this returns:
        the caller may reuse its buffer right after.

        Raises:
            KVStoreError: no table ``name``, no rule ``rule``, or ``hyper`` is not its type.
        """

    def pull_many(self, requests: Sequence[Tuple[str, GlobalIds]]) -> List[Array]:
        """Rows of several tables at once: ``[pull(name, ids) for name, ids in requests]``.

        Clients that move rows between processes in rounds (collective mode) make it one
        round for all the tables; the others look them up in turn.
        """
        return [self.pull(name, ids) for name, ids in requests]

    def apply_gradients(self, tables: Sequence[TableGradients], F) -> List[bool]:
        """One optimizer step of several tables: sum each table's traced gradients per id
        (:meth:`coalesce`) and apply its rule to the sums (:meth:`push_update`).

        The optimizer hands every table of its step at once, so a client that exchanges
        rows in rounds (collective mode) sends all the tables' sums in one round; the
        others coalesce and push each table in turn.

        Returns:
            per table, whether it stepped: it had gradients (here, or on any trainer of a
            collective job), so the optimizer counts the step.
        """
        stepped = []
        for t in tables:
            summed = self.coalesce(t.name, t.ids, t.grads, F)
            if summed is not None:
                self.push_update(t.name, summed[0], summed[1], t.rule, t.hyper)
            stepped.append(summed is not None)
        return stepped

    # -- checkpoints and optimizer state (tables on row stores override these) --------

    def save_table(self, name: str, directory: str, save_id: str,
                   columns: Sequence[str]) -> dict:
        """Write ``columns`` of table ``name`` (``"weight"`` and optimizer states by their
        short names) into checkpoint ``directory`` as records of save ``save_id``
        (:mod:`distemb.kvstore.snapshot`); the manifest is the caller's.

        The default pulls the rows in blocks into one record; clients that own their
        shards (embedded, servers, collective ranks) write one record per shard, where
        the shard is.

        Returns:
            the table's manifest entry.
        """
        meta = self._meta_of(name)
        cols = {}
        for col in columns:
            kvname, cmeta = self._column(name, col)

            def read_block(lo, hi, kvname=kvname, dtype=cmeta.dtype):
                rows = self.to_host(self.pull(kvname, self.from_host(
                    np.arange(lo, hi, dtype=np.int64))))
                return half.encode(rows, dtype) if half.is_half(dtype) else rows
            cols[col] = (cmeta.shape[1:], cmeta.dtype, read_block)
        record = snapshot.write_shard(directory, save_id, name, 0, meta.shape[0], cols)
        return snapshot.new_entry(meta.shape, meta.dtype, [record], meta.policy)

    def load_table(self, name: str, directory: str, entry: dict,
                   columns: Sequence[str]) -> None:
        """Fill ``columns`` of table ``name`` from its checkpoint ``entry`` (saved by any
        number of shards, under any partitioning or router), all or nothing.

        Raises:
            KVStoreError: a column not saved or saved with other rows, a corrupt or
                missing segment, or rows not covered exactly once.
        """
        meta = self._meta_of(name)
        check_entry_rows(entry, meta.shape[0], name, directory)
        cols = {col: self._column(name, col) for col in columns}

        def write(col, ids, rows):
            self.push(cols[col][0], self.from_host(ids),
                      self.from_host(np.ascontiguousarray(half.as_rows(rows))))
        snapshot.load_shard(directory, entry,
                            {c: (m.shape[1:], m.dtype) for c, (_, m) in cols.items()},
                            snapshot.Target.fixed(0, 1, meta.shape[0]), write)

    def _column(self, name: str, column: str) -> Tuple[str, DataMeta]:
        """(KVStore name, DataMeta) of column ``column`` of table ``name``."""
        kvname = name if column == WEIGHT else state_name(name, column)
        return kvname, self._meta_of(kvname)

    def table_state(self, name: str, state_names: Dict[str, str]) -> Dict[str, np.ndarray]:
        """{state: every row of it} of table ``name`` (for ``opt.state_dict()``)."""
        out = {}
        for sname, kvname in state_names.items():
            n = self._meta_of(kvname).shape[0]
            parts = [self.to_host(self.pull(kvname, self.from_host(
                np.arange(s, min(s + STATE_CHUNK_ROWS, n), dtype=np.int64))))
                for s in range(0, n, STATE_CHUNK_ROWS)]
            out[sname] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out

    def load_table_state(self, name: str, state_names: Dict[str, str], entry) -> None:
        """Write back what :meth:`table_state` gave (``opt.load_state_dict()``).

        Raises:
            KVStoreError: a state is missing from ``entry`` or has another shape.
        """
        for sname, kvname in state_names.items():
            if sname not in entry:
                raise KVStoreError(f"state_dict: table {name!r} lacks state {sname!r}")
            meta = self._meta_of(kvname)
            arr = np.ascontiguousarray(np.asarray(entry[sname]))
            check_shape(f"state_dict: state {sname!r} of {name!r}", arr.shape, meta.shape,
                        KVStoreError)
            arr = arr.astype(meta.dtype, copy=False)
            for s in range(0, arr.shape[0], STATE_CHUNK_ROWS):
                ids = np.arange(s, min(s + STATE_CHUNK_ROWS, arr.shape[0]), dtype=np.int64)
                self.push(kvname, self.from_host(ids),
                          self.from_host(np.ascontiguousarray(arr[s:s + len(ids)])))

    #: Why this client holds no tables on row stores (its :meth:`create_table` says it).
    keyed_refusal = ("it places rows in dense arrays of rows 0..N-1; make the table in a "
                     "context whose tables live in host memory or on servers")

    def create_table(self, name: str, spec) -> None:
        """Make keyed table ``name`` from a table spec (:mod:`distemb.stores.spec`).

        Raises:
            KVStoreError: always here: this placement holds no tables on row stores (the
                message names the placement and the spec's store).
        """
        raise refuse_store(self, name, f"a {spec.kind} store ({type(spec).__name__})",
                           self.keyed_refusal)

    def add_table(self, name: str, store) -> None:
        """Hold the RowStore ``store`` as keyed table ``name``.

        Raises:
            KVStoreError: always here, as :meth:`create_table`.
        """
        raise refuse_store(self, name, f"a {type(store).__name__}", self.keyed_refusal)

    def is_keyed(self, name: str) -> bool:
        """Whether ``name`` is a table on row stores (none here)."""
        return False

    def row_dim(self, name: str) -> int:
        """Row length of table ``name``."""
        return self._meta_of(name).shape[1]

    def _meta_of(self, name: str) -> DataMeta:
        """The DataMeta of ``name``; KVStoreError when absent."""
        meta = self.data_meta(name)
        if meta is None:
            raise unknown_name(self, name, "in the KVStore", self.names())
        return meta

    def barrier(self) -> None:
        """Wait for every trainer (no-op with one)."""

    def close(self) -> None:
        """Release connections and, for an embedded store, its memory."""

def unknown_name(client: KVClient, name: str, what: str, known) -> KVStoreError:
    """The error of a name ``client`` does not hold: that the client is closed when it is
    (its context closed, its tables gone with it), else that ``name`` is not ``what``,
    with some of the ``known`` names."""
    if client.closed:
        return KVStoreError(f"name {name!r}: this {type(client).__name__} is closed (its "
                            "context was closed, and its tables with it); make tables on "
                            "an open context")
    return KVStoreError(f"name {name!r} is not {what} (known: {sorted(known)[:10]})")


def refuse_store(client: KVClient, name: str, store: str, why: str) -> KVStoreError:
    """The error of a placement that cannot hold a table on a kind of store, naming both.

    Args:
        client: the refusing client (its type names the placement).
        name: the table.
        store: the store, e.g. "a hash store (HashTableSpec)".
        why: what the placement lacks, and what to do instead.
    """
    return KVStoreError(f"{type(client).__name__}: cannot hold table {name!r} on {store}: "
                        f"{why}")
