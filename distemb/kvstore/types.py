"""The KVClient interface: what trainers need from wherever the rows live.

A client is a placement strategy (as torchrec has one class per sharding strategy): it
owns where rows live and everything that depends on it, so callers never branch on a
device or a mode. Every table is one :class:`~distemb.kvstore.tables.Table` (a name, a
spec and a router, :mod:`distemb.kvstore.tables`), and every client has one path for
all of them: one :meth:`~KVClient.create_table`, one routing, one
:meth:`~KVClient.init_optimizer`, one save and load, one set of key operations, one
check of ids and values. What a table's store cannot do (remove keys of a fixed key set)
its shard refuses, naming both; what a placement cannot hold it refuses at creation,
naming both (:func:`refuse_store`). Two halves:

- storage: ``create_table``/``delete_data``/``pull``/``prefetch``/``push``/
  ``init_optimizer``/``push_update``, the key operations (``size``, ``contains``, ``get``, ``remove``,
  ``evict``, ``export``, ``import_``), checkpoints, ``barrier``/``close``, on the
  client's own arrays (``ops`` is their kernel implementation, ``from_host``/``to_host``
  convert numpy to and from them);
- placement, trainer side: ``ids_in``/``values_in``/``tensor_in`` turn the backend's
  tensors into the client's arrays (validated), ``rows_out`` turns pulled rows into
  backend tensors, ``coalesce`` sums the gradients of duplicate ids on the client's own
  device with its own kernels, and ``view_on(device)`` is the client through which rows
  are looked up onto ``device`` (itself, or a thin wrapper).

The base class inherits the placement half for host clients from
:class:`~distemb.kvstore.placement.HostPlacement`; device clients override it
(:mod:`distemb.kvstore.device`). Ids crossing the storage half are the table's int64
keys, already validated by ``ids_in``.

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
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from distemb import kernels
from distemb.arrays import GlobalIds, Rows, Shape, Tensor, UniqueIds
from distemb.errors import KVStoreError, NonFiniteGradientError, StoreError
from distemb.kvstore.placement import HostPlacement
from distemb.partition import PartitionPolicy
from distemb.rules import Hyper
from distemb.stores.dense import DenseSpec
from distemb.stores.spec import GivenStore

__all__ = ["KVClient", "DataMeta", "TableGradients", "refuse_store"]


@dataclass(frozen=True)
class DataMeta:
    """Shape (rows first: None for a table of any int64 key), dtype name and partition
    policy (None when its keys are routed otherwise) of a table or of its optimizer
    state."""

    shape: Shape
    dtype: str
    policy: object = None


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
    finite: bool = True         # no NaN or infinity among grads (False: refuse the step)


def refuse_non_finite(bad: Sequence[str], ranks: str = "") -> None:
    """Raise before anything of a step is applied when tables' gradients are not finite
    (``TableGradients.finite``, which the optimizer computes).

    Args:
        bad: the names of those tables (none: nothing to refuse).
        ranks: where their gradients came from, for the message ("" where it is here).

    Raises:
        NonFiniteGradientError: ``bad`` is not empty; the message names every table.
    """
    if bad:
        raise NonFiniteGradientError(
            f"step(): the gradients of table(s) {bad}{ranks} hold NaN or infinity; the step "
            "is refused (no row or optimizer state of any table changed) and its gradients "
            "are dropped. Look for the loss or input that diverged (a lower learning rate, "
            "gradient clipping)")


def refuse_store(client, name: str, store: str, why: str) -> KVStoreError:
    """The error of a placement that cannot hold a table on a kind of store, naming both.

    Args:
        client: the refusing client (its type names the placement).
        name: the table.
        store: the store, e.g. "a hash store (HashTableSpec)".
        why: what the placement lacks, and what to do instead.
    """
    return KVStoreError(f"{type(client).__name__}: cannot hold table {name!r} on {store}: "
                        f"{why}")


class KVClient(HostPlacement, ABC):
    """Interface of a key-value store client; implementations share one test suite.

    :class:`~distemb.kvstore.tables.TableClient` is the one path of every client that
    holds tables; wrappers (:class:`~distemb.kvstore.wrapper.Wrapper`) hand calls on.

    Implementations: :class:`~distemb.kvstore.local.LocalKVClient` (embedded, in
    process), :class:`~distemb.kvstore.remote.RemoteKVClient` (server processes),
    :class:`~distemb.kvstore.collective.CollectiveKVClient` (ranks of a torch.distributed
    job), :class:`~distemb.kvstore.device.DeviceKVClient` (embedded, tables on a GPU),
    the caches of :mod:`distemb.kvstore.caches` and the views of
    :mod:`distemb.kvstore.views`.
    """

    #: The kernel implementation of this client's arrays.
    ops = kernels
    #: The torch device of this client's arrays; None for numpy arrays in host memory.
    #: Informational (``DistEmbedding.device``): callers never branch on it.
    device = None
    #: Processes holding shards (servers, ranks): a spec's router is made for them.
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
    #: and a name it no longer knows is reported as such.
    closed = False
    #: The tables this client knows (:class:`~distemb.kvstore.tables.Tables`).
    tables = None

    # -- tables ----------------------------------------------------------------------

    # -- tables ----------------------------------------------------------------------

    @abstractmethod
    def create_table(self, name: str, spec) -> None:
        """Make table ``name`` from a table spec (:mod:`distemb.stores.spec`), or attach
        to the table of that name made from the same spec (collective in a cluster: every
        trainer calls it, with the same spec; the first creator's initial rows win).

        Raises:
            KVStoreError: ``name`` exists with another spec, or this placement cannot
                hold the spec's store (naming both).
        """

    def init_data(self, name: str, shape: Shape, dtype: str, policy: PartitionPolicy,
                  init_func=None, rounding_seed: Optional[int] = None) -> None:
        """DGL's creation of a dense table: ``create_table(name, DenseSpec(shape, dtype,
        policy, init_func, rounding_seed))`` (see :class:`~distemb.stores.dense.DenseSpec`).

        ``init_func(shard_shape, dtype_name)`` fills each partition (zeros if None); it
        may return numpy arrays or arrays of this client (see ``tensor_in``). A name is
        made once: a second ``init_data`` of it raises (a DistTensor attaches instead). Half tables
        (``dtype`` 'bfloat16' or 'float16') store rows in 16 bits but are read and
        written as float32; ``rounding_seed`` (bfloat16 only) rounds updates
        stochastically, reproducibly from that seed.
        """
        if self.data_meta(name) is not None:  # DGL's: a name is made once (attaching is
            raise KVStoreError(f"name {name!r} already exists in the KVStore")  # DistTensor's)
        self.create_table(name, DenseSpec(tuple(shape), dtype, policy, init_func,
                                          rounding_seed))

    def add_table(self, name: str, store) -> None:
        """Hold the RowStore ``store`` as table ``name`` (a
        :class:`~distemb.stores.spec.GivenStore`; the store backs this table alone and is
        closed with it)."""
        self.create_table(name, GivenStore(store))

    def data_meta(self, name: str) -> Optional[DataMeta]:
        """The :class:`~distemb.kvstore.tables.DataMeta` of table (or optimizer state)
        ``name``, or None if absent. Its shape's first entry is None for a table of any
        int64 key (how many it holds is :meth:`size`)."""
        return self.tables.meta(name)

    def names(self) -> List[str]:
        """Names of all tables this client knows, and of their optimizer state."""
        return self.tables.names()

    def table(self, name: str):
        """The :class:`~distemb.kvstore.tables.Table` ``name``.

        Raises:
            KVStoreError: no such table.
        """
        return self.tables.table(name)

    def row_dim(self, name: str) -> int:
        """Row length of table ``name``."""
        return self.tables.table(name).dim

    @abstractmethod
    def delete_data(self, name: str) -> None:
        """Drop table ``name`` and its shards (no-op when absent); a table on a store
        closes it (a file flushes)."""

    # -- rows ------------------------------------------------------------------------

    @abstractmethod
    def pull(self, name: str, ids: GlobalIds):
        """Rows ``ids`` of ``name`` (a table, or its optimizer state by name) as a new
        array (len(ids),) + row shape (float32 for a half-precision table). A lookup of
        a hash table inserts absent keys and counts the access for eviction."""

    @abstractmethod
    def push(self, name: str, ids: GlobalIds, values) -> None:
        """Write ``values`` into rows ``ids`` of ``name`` (upsert; last write wins for
        duplicates); float32 values of a half table round to nearest-even."""

    @abstractmethod
    def init_optimizer(self, name: str, rule, options: Dict[str, float]) -> Dict[str, str]:
        """Create the optimizer state of table ``name`` for update rule ``rule``: columns
        of its stores, made fresh (a new optimizer starts fresh, as torch's), except on a
        persistent store (a file table reopened to resume keeps its state).

        Returns:
            dict state name -> KVStore name of that state.

        Raises:
            KVStoreError: no table ``name``, no rule ``rule``, rows an optimizer cannot
                update, or an option of ``options`` the rule's states do not start from
                (or not finite).
        """

    @abstractmethod
    def push_update(self, name: str, ids: UniqueIds, grads: Rows, rule,
                    hyper: Hyper) -> None:
        """Apply update ``rule`` with ``hyper`` to rows ``ids`` (unique) of ``name``.

        ``grads`` is consumed (applied, or copied into a message) before this returns:
        the caller may reuse its buffer right after. A key a hash table no longer holds
        (removed or evicted since its lookup) is not updated.

        Raises:
            KVStoreError: no table ``name``, no rule ``rule``, or ``hyper`` is not its type.
        """

    def pull_many(self, requests: Sequence[Tuple[str, GlobalIds]]) -> List:
        """Rows of several tables at once: ``[pull(name, ids) for name, ids in requests]``.

        Clients that move rows between processes in rounds (collective mode) make it one
        round for all the tables; the others look them up in turn.
        """
        return [self.pull(name, ids) for name, ids in requests]

    def prefetch(self, name: str, ids: GlobalIds) -> None:
        """Start reading rows ``ids`` of table ``name`` for a coming lookup (the next
        batch's, while the current one computes); returns at once.

        The next lookups of the table take what they can from the oldest prefetch, and
        return exactly the rows they would return without it (every write since is in
        them, :mod:`distemb.kvstore.prefetch`); the table's next update after such a lookup
        releases it. A client whose rows are in this process reads them at the lookup
        (this default: nothing to start).

        Raises:
            KVStoreError: no table ``name``, or a table whose store evicts keys on its own
                where a prefetched row could be evicted before its lookup (naming both).
        """
        self.tables.table(name)

    def apply_gradients(self, tables: Sequence[TableGradients], F) -> List[bool]:
        """One optimizer step of several tables: sum each table's traced gradients per id
        (:meth:`coalesce`) and apply its rule to the sums (:meth:`push_update`).

        Returns:
            per table, whether it stepped: it had gradients (here, or on any trainer of a
            collective job), so the optimizer counts the step.

        Raises:
            NonFiniteGradientError: a table's gradients are not finite (``finite``), before
                any table is pushed.
        """
        if not all(t.finite for t in tables):
            # Nothing of this trainer's step is applied; a client whose servers wait for
            # every trainer's share of a step (sync_exact) still sends its share, empty.
            for t in tables:
                empty = self.coalesce(t.name, [], [], F)
                if empty is not None:
                    self.push_update(t.name, empty[0], empty[1], t.rule, t.hyper)
            refuse_non_finite([t.name for t in tables if not t.finite])
        stepped = []
        for t in tables:
            summed = self.coalesce(t.name, t.ids, t.grads, F)
            if summed is not None:
                self.push_update(t.name, summed[0], summed[1], t.rule, t.hyper)
            stepped.append(summed is not None)
        return stepped

    # -- keys ------------------------------------------------------------------------

    @abstractmethod
    def size(self, name: str) -> int:
        """Keys held by table ``name`` (over every shard; N for a table of fixed keys)."""

    def capacity(self, name: str) -> Optional[int]:
        """Keys table ``name`` holds at most (None: unbounded)."""
        return self.tables.table(name).spec.capacity

    @abstractmethod
    def contains(self, name: str, keys) -> np.ndarray:
        """Bool per key: held or not (nothing inserted, no access counted; a key outside
        a fixed key space: False)."""

    @abstractmethod
    def get(self, name: str, keys) -> np.ndarray:
        """Rows of ``keys`` (float32) without inserting or counting them.

        Raises:
            MissingKeyError: a key is not held. PartitionError: a key outside a fixed key
                space.
        """

    @abstractmethod
    def remove(self, name: str, keys) -> int:
        """Remove ``keys`` with their state; how many were present.

        Raises:
            StoreError: the table holds fixed keys.
        """

    @abstractmethod
    def evict(self, name: str, target_size: int, policy=None) -> np.ndarray:
        """Evict keys by ``policy`` (default: the table's) down to ``target_size`` (split
        evenly over the shards, each by its own order); returns the evicted keys.

        Raises:
            StoreError: the table holds fixed keys.
        """

    @abstractmethod
    def export(self, name: str, columns: Optional[List[str]] = None
               ) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        """(keys ascending, {column: rows}) of every key held (every column when None;
        the weight as float32)."""

    @abstractmethod
    def import_(self, name: str, keys, columns: Dict[str, np.ndarray]) -> None:
        """Upsert ``keys`` with rows of each of ``columns`` (what :meth:`export` gave), the
        weight first (it inserts absent keys; state columns then overwrite).

        Raises:
            StoreError: an unknown column, or rows of the wrong count.
        """

    def flush(self, name: str) -> None:
        """Make completed writes of ``name`` durable (file stores; no-op otherwise)."""

    # -- optimizer state and checkpoints ----------------------------------------------

    def table_state(self, name: str, state_names: Dict[str, str]) -> Dict[str, np.ndarray]:
        """``{"keys": keys, state: rows}`` of every key of table ``name`` (its
        ``opt.state_dict()`` entry)."""
        keys, cols = self.export(name, list(state_names))
        return {"keys": keys, **cols}

    def load_table_state(self, name: str, state_names: Dict[str, str], entry) -> None:
        """Write back what :meth:`table_state` gave, to keys the table holds (a table of
        fixed keys also takes an entry without ``"keys"``: its rows 0..N-1 in order, the
        format before keys were saved; a table of any key's rows are restored first: a
        key's state belongs with its row).

        Raises:
            KVStoreError: ``entry`` lacks a state, has rows of another count, or names
                keys the table does not hold (nothing is written).
        """
        table = self.tables.table(name)
        missing = [s for s in state_names if s not in entry]
        if "keys" not in entry and table.num_keys is None:
            missing = ["keys"] + missing
        if missing:
            raise KVStoreError(f"state_dict: table {name!r} lacks {missing} (a table's state "
                               f"is keyed: 'keys' and one array per state)")
        keys = np.asarray(entry["keys"]) if "keys" in entry else \
            np.arange(table.num_keys, dtype=np.int64)
        cols = {s: np.asarray(entry[s]) for s in state_names}
        for s, arr in cols.items():
            want = (len(keys),) + tuple(table.states[s][0])
            if arr.shape != want:
                raise KVStoreError(f"state_dict: state {s!r} of {name!r} has shape "
                                   f"{arr.shape}, expected {want}")
        if table.num_keys is None:  # checked on every shard before any of them writes
            absent = keys[~np.asarray(self.contains(name, keys), bool)]
            if len(absent):
                raise KVStoreError(f"state_dict: {len(absent)} key(s) of table {name!r} are "
                                   f"not in it, e.g. {absent[:5].tolist()}; restore their "
                                   "rows first (import_ or a checkpoint), then the "
                                   "optimizer's state")
        try:
            self.import_(name, keys, cols)
        except StoreError as e:
            raise KVStoreError(f"state_dict: {e}") from None

    @abstractmethod
    def save_table(self, name: str, directory: str, save_id: str,
                   columns: Sequence[str], parent: Optional[str] = None) -> dict:
        """Write ``columns`` of table ``name`` (``"weight"`` and optimizer states by their
        short names) into checkpoint ``directory`` as records of save ``save_id``
        (:mod:`distemb.kvstore.checkpoint.snapshot`), each shard where it lives; the
        manifest is the caller's. With ``parent``, each shard writes a delta: its rows
        changed since save ``parent`` and the keys removed since
        (:mod:`distemb.kvstore.checkpoint.chain`).

        Returns:
            the table's manifest entry.

        Raises:
            KVStoreError: with ``parent``, a shard that did not make or load that save.
        """

    @abstractmethod
    def load_table(self, name: str, directory: str, entry: dict,
                   columns: Sequence[str]) -> None:
        """Fill ``columns`` of table ``name`` from its checkpoint ``entry`` (saved by any
        number of shards, under any partitioning or router), all or nothing.

        Raises:
            KVStoreError: a column not saved or saved with other rows, a corrupt or
                missing segment, or rows not covered exactly once.
        """

    @abstractmethod
    def view_on(self, device) -> "KVClient":
        """The client through which rows of this client's tables are looked up onto
        ``device``: itself for its own device (None, 'cpu' for host clients), else a view
        that places the rows there (:mod:`distemb.kvstore.views`).

        Raises:
            CudaUnavailableError: ``device`` is a CUDA device that cannot be used here.
            ValueError: ``device`` is not a device.
        """

    def barrier(self) -> None:
        """Wait for every trainer (no-op with one)."""

    def close(self) -> None:
        """Release connections and, for an embedded store, its memory."""
