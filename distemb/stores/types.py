"""The RowStore interface: where one shard's rows and their optimizer state physically live.

A store maps *keys* to *slots*: a key is what callers address rows by (a local row id
for dense stores, any int64 for a hash store), a slot is the row number in the store's
*columns*, one numpy array per column, all with one row per slot. The column
``"weight"`` holds the rows; optimizer state columns (named by the rule's
:class:`~distemb.rules.StateSpec`) sit beside it, so state lives, moves and dies with
its row. The update rules never see keys: :meth:`RowStore.update` turns keys into slots
and hands the rule the column arrays and the slots, so the same fused kernels run on
every store and give bit-identical rows for the same keys.

Implementations (one module each, one shared test suite, tests/test_store_suite.py):
:class:`~distemb.stores.dense.DenseStore` (one array in memory, keys 0..N-1),
:class:`~distemb.stores.hash.HashStore` (any int64 key, open-addressing index, growth,
eviction) and :class:`~distemb.stores.file.FileStore` (memory-mapped files: tables
larger than RAM, persistent across processes).

Concurrency: a store assumes one writer at a time (the KVServer's lock, or the one
embedded trainer); reads concurrent with a write may see a row half-updated.

Example:
    >>> import numpy as np
    >>> from distemb.stores import DenseStore
    >>> s = DenseStore(4, 2)
    >>> s.scatter(np.array([3]), np.ones((1, 2), np.float32))
    >>> s.gather(np.array([3, 0])).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
"""
import abc
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from distemb import kernels
from distemb.enums import Rounding
from distemb.errors import StoreError
from distemb.kernels import half
from distemb.kernels.hashtable import keys_array

#: (N,) int64 keys: local row ids for dense stores, any int64 for a hash store.
Keys = np.ndarray
#: (N,) int64 row numbers in a store's column arrays.
Slots = np.ndarray
#: (N, D) rows of one column.
Rows = np.ndarray
#: ``init(keys) -> (len(keys), dim) float32``: a key's initial row, a pure function of
#: the key (so every run and every server count gives a key the same row).
KeyInit = Callable[[Keys], Rows]

WEIGHT = "weight"


class RowStore(abc.ABC):
    """Interface of a shard's row storage; see the module docstring.

    Attributes:
        dim: row length of the weight column.
        dtype: dtype name of the weight column: ``"float32"``, or ``"bfloat16"`` /
            ``"float16"`` for half-precision rows (state columns stay float32; rows are
            read and written as float32 through :meth:`gather`/:meth:`scatter`, and the
            update rules run on :attr:`ops`, the kernels of the weight's dtype).
    """

    dim: int
    dtype: str

    #: How updates round into half-precision rows (:class:`~distemb.enums.Rounding`).
    rounding = Rounding.NEAREST
    _stochastic_ops = None

    def _set_rounding(self, rounding, seed=0):
        """Validate ``rounding`` against this store's dtype (constructors call this)."""
        self.rounding = Rounding.parse(rounding, "rounding", ValueError)
        if self.rounding is Rounding.STOCHASTIC:
            if self.dtype != "bfloat16":
                raise ValueError(f"rounding: 'stochastic' is for bfloat16 rows, got dtype "
                                 f"{self.dtype!r}")
            self._stochastic_ops = half.StochasticRounding(seed)

    @property
    def ops(self):
        """The kernels of the weight column: :mod:`distemb.kernels` for float32 rows, the
        half-precision twin otherwise (with stochastic rounding when asked)."""
        if not half.is_half(self.dtype):
            return kernels
        return self._stochastic_ops or half
    #: True when the rows outlive the process (a file store): optimizer state columns are
    #: then kept on reopening, not reset.
    persistent = False
    #: True when the store holds a fixed key set 0..N-1 (dense, file): no remove, no evict.
    fixed_keys = False
    #: True once :meth:`close` ran: the arrays are released, no table takes the store.
    closed = False
    #: The table this store backs (set by :meth:`claim`), None while it backs none.
    owner: Optional[str] = None

    def claim(self, table: str) -> None:
        """Make this store the one of table ``table`` (a client's ``add_table`` calls it
        where a store becomes a table): a store backs one table, which closes it when
        the table goes.

        Raises:
            StoreError: the store is closed, or it already backs a table (named): two
                tables on one store would share its rows and optimizer-state columns.
        """
        if self.closed:
            raise StoreError(f"store: the {type(self).__name__} given to table {table!r} is "
                             "closed (by its table, or by close()); make a new store (a "
                             "FileStore reopens its files: FileStore(path))")
        if self.owner is not None:
            raise StoreError(f"store: the {type(self).__name__} given to table {table!r} "
                             f"already holds table {self.owner!r} (a store backs one table: "
                             "two would share its rows and optimizer state); use that "
                             "table, or give this one a store of its own")
        self.owner = table

    # ---- what implementations provide -------------------------------------------------

    @abc.abstractmethod
    def slots(self, keys: Keys, insert: bool = False) -> Slots:
        """Slots of ``keys`` (int64, same length), in order; duplicates get equal slots.

        Args:
            keys: (N,) integer keys.
            insert: add absent keys (hash store: new rows from its ``init``, state
                columns at their fill value). Dense stores hold a fixed key set and
                ignore it.

        Raises:
            TypeError: ``keys`` are not integers.
            StoreError: a key outside a dense store's range.
            MissingKeyError: ``insert`` is False and a key is absent (hash store).
        """

    @abc.abstractmethod
    def find(self, keys: Keys) -> Slots:
        """Slots of ``keys``, -1 where absent: nothing inserted, no access counted."""

    @abc.abstractmethod
    def column(self, name: str) -> np.ndarray:
        """The array of column ``name`` (rows indexed by slot; shared, not copied).

        Valid until the next call that may insert (a hash store may grow its arrays).

        Raises:
            StoreError: no such column.
        """

    @abc.abstractmethod
    def add_column(self, name: str, row_shape: Tuple[int, ...], dtype: str,
                   fill: float = 0.0, keep: bool = False) -> None:
        """Add column ``name`` with rows of ``row_shape``, every row set to ``fill``.

        An existing column is replaced, unless ``keep`` and it has the same row shape
        and dtype (a persistent store resuming its optimizer state).
        """

    def set_fill(self, name: str, fill: float) -> None:
        """Make ``fill`` the value that rows inserted from now on start at in column
        ``name`` (rows held keep theirs). A store with a fixed key set never inserts, so
        for it this does nothing; a store that inserts must implement it.

        Raises:
            StoreError: no such column, or a store that inserts without implementing it.
        """
        self.column(name)
        if not self.fixed_keys:
            raise StoreError(f"set_fill: {type(self).__name__} inserts keys but cannot set "
                             "the value new rows start at")

    @abc.abstractmethod
    def drop_column(self, name: str) -> None:
        """Remove column ``name`` (no-op when absent; the weight cannot be dropped)."""

    @abc.abstractmethod
    def columns(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """``{name: (row_shape, dtype)}`` of every column, the weight first."""

    @abc.abstractmethod
    def keys(self) -> Keys:
        """Every key held, ascending."""

    @abc.abstractmethod
    def size(self) -> int:
        """Number of keys held."""

    @property
    @abc.abstractmethod
    def capacity(self) -> Optional[int]:
        """Keys this store holds at most (dense: its rows; hash: None when unbounded)."""

    @abc.abstractmethod
    def remove(self, keys: Keys) -> int:
        """Remove ``keys`` and their state; returns how many were present.

        Raises:
            StoreError: the store has a fixed key set (dense and file stores).
        """

    def flush(self) -> None:
        """Make every completed write durable (file stores); no-op in memory."""

    def close(self) -> None:
        """Flush and release the arrays; the store is unusable afterwards (and
        :attr:`closed`)."""

    def nbytes(self) -> int:
        """Bytes held: every column plus the index and bookkeeping."""
        return int(sum(self.column(c).nbytes for c in self.columns()))

    def open_column(self, name: str) -> Optional[int]:
        """A new read-only descriptor of the file that holds column ``name``'s rows as
        :meth:`column` has them (from offset 0), for another process on this machine to
        map; None when the rows are in memory only (the caller closes the descriptor)."""
        return None

    # ---- shared behaviour, written once on top of the above ---------------------------

    def gather(self, keys: Keys, column: str = WEIGHT, insert: bool = True,
               stored: bool = False) -> Rows:
        """Rows of ``keys`` in ``column``, as a new array (absent keys inserted first).

        Weight rows come as float32, or with ``stored`` in the storage dtype (half rows
        as 2 bytes, for the wire: the trainer decodes them)."""
        return self.gather_slots(self.slots(keys, insert=insert), column, stored=stored)

    def read(self, keys: Keys, column: str = WEIGHT, out: Optional[np.ndarray] = None,
             num_threads: int = 1, access: bool = True) -> np.ndarray:
        """Rows of ``keys`` in ``column`` (into ``out`` when given): a training lookup of
        the weight (:meth:`access`; without ``access`` absent keys are still inserted, the
        access not counted), the rows of held keys for any other column.

        Weight rows come as float32 when ``out`` is None or float32, else as stored (half
        rows travel in 16 bits)."""
        if column == WEIGHT:
            slots = self.access(keys) if access else self.slots(keys, insert=True)
        else:
            slots = self.slots(keys, insert=False)
        stored = out is not None and out.dtype != np.float32
        return self.gather_slots(slots, column, out, num_threads, stored)

    def gather_slots(self, slots: Slots, column: str = WEIGHT,
                     out: Optional[np.ndarray] = None, num_threads: int = 1,
                     stored: bool = False) -> np.ndarray:
        """Rows ``slots`` of ``column`` (into ``out`` when given; the weight as float32
        unless ``stored``), with the gather kernels where the rows are float or half."""
        arr = self.column(column)
        if column == WEIGHT and not stored and half.is_half(self.dtype):
            return self.ops.gather_rows(arr, slots, out, num_threads)
        if arr.dtype == np.float32 and arr.ndim == 2:
            return kernels.gather_rows(arr, slots, out, num_threads)
        if out is None:
            return arr[slots]
        np.take(arr, slots, axis=0, out=out)
        return out

    def lookup(self, keys: Keys, stored: bool = False) -> Rows:
        """Weight rows of ``keys`` for a training lookup (float32, or as stored with
        ``stored``): see :meth:`access`."""
        return self.gather_slots(self.access(keys), stored=stored)

    def access(self, keys: Keys) -> Slots:
        """Slots of ``keys`` for a training lookup: absent keys are inserted, and a store
        that evicts counts the access (and holds its capacity, sparing these keys: see
        :class:`~distemb.stores.hash.HashStore`)."""
        return self.slots(keys, insert=True)

    def scatter(self, keys: Keys, values: np.ndarray, column: str = WEIGHT) -> None:
        """Write ``values`` into rows ``keys`` of ``column`` (upsert; last duplicate wins).
        Values of the wrong shape are refused before any key is inserted."""
        values = np.asarray(values)
        want = (len(keys),) + self.column(column).shape[1:]
        if values.shape != want:
            raise StoreError(f"values: expected shape {want} for column {column!r}, "
                             f"got {values.shape}")
        self._write_slots(column, self._slots_to_write(keys, column), values)

    def _slots_to_write(self, keys: Keys, column: str) -> Slots:
        """Slots of keys about to be written in ``column`` (upserted: absent keys inserted
        first; a store that evicts holds its capacity)."""
        return self.slots(keys, insert=True)

    def _write_slots(self, column, slots, values):
        """Write float32 ``values`` (weight rows: rounded to its dtype; rows already in it
        as they are) into ``slots`` of ``column``."""
        self.column(column)[slots] = self.encode(values) \
            if column == WEIGHT and np.ndim(values) else values

    def read_rows(self, column: str, slots: Slots, stored: bool = False) -> np.ndarray:
        """Rows ``slots`` of ``column`` as a new host array (the weight as float32, or as
        stored with ``stored``): what exports and checkpoints write."""
        rows = self.column(column)[slots]
        return self.decode(rows) if column == WEIGHT and not stored else rows

    def update(self, rule, keys: Keys, grads: Rows, hyper,
               num_threads: int = 1) -> Optional[np.ndarray]:
        """Apply update ``rule`` (a :class:`~distemb.rules.UpdateRule`) to unique ``keys``.
        The rule gets the weight and state columns and the slots: the kernels never see
        keys.

        An update never inserts: a key the store does not hold (removed or evicted since
        the lookup its gradient came from) is skipped, its gradient dropped, so a removal
        holds, and so does a capacity.

        Returns:
            positions in ``keys`` of the keys updated, or None when every key was.

        Raises:
            StoreError: a state column the rule needs is missing (no optimizer set up).
        """
        slots, at = self._held_slots(keys)
        if at is not None:
            grads = grads[at]
        states = {s.name: self.column(s.name) for s in rule.states}
        rule.apply(self.ops, self.column(WEIGHT), states, slots, grads, hyper, num_threads)
        return at

    def _held_slots(self, keys: Keys) -> Tuple[Slots, Optional[np.ndarray]]:
        """(slots of the held ``keys``, their positions or None when all are held): one
        pass over the index, as the lookup's."""
        if self.fixed_keys:
            return self.slots(keys), None
        slots = self.find(keys)
        held = slots >= 0
        if held.all():
            return slots, None
        at = np.flatnonzero(held)
        return slots[at], at

    def export(self) -> Tuple[Keys, Dict[str, np.ndarray]]:
        """(keys ascending, {column: rows of those keys}) of everything held (the weight
        as float32 whatever its storage dtype)."""
        keys = self.keys()
        slots = self.slots(keys) if len(keys) else np.empty(0, np.int64)
        return keys, {name: self.read_rows(name, slots) for name in self.columns()}

    def encode(self, rows):
        """float32 ``rows`` in the weight column's storage dtype (rounded to nearest-even);
        rows already in it (half rows off the wire) as they are."""
        if not half.is_half(self.dtype) or \
                np.asarray(rows).dtype == half.storage_dtype(self.dtype):
            return rows
        return half.encode(rows, self.dtype)

    def decode(self, stored):
        """Weight rows as stored -> float32 (other dtypes as they are)."""
        return half.decode(stored) if half.is_half(self.dtype) else stored

    def import_(self, keys: Keys, columns: Dict[str, np.ndarray]) -> None:
        """Upsert rows ``keys`` of every column in ``columns`` (what :meth:`export` gave),
        the weight first: a store that inserts takes state only for keys it holds.

        Raises:
            StoreError: a column is unknown here or its rows have the wrong shape.
            MissingKeyError: state of a key neither held nor in ``columns``' weight.
        """
        keys = keys_array(keys)
        for name, values in columns.items():
            self.column(name)  # unknown columns fail before anything is written
            if len(values) != len(keys):
                raise StoreError(f"columns[{name!r}]: expected {len(keys)} rows, "
                                 f"got {len(values)}")
        for name in sorted(columns, key=lambda c: c != WEIGHT):
            self.scatter(keys, np.asarray(columns[name]), name)


def check_dim(dim, what="dim"):
    """``dim`` as a positive int; ValueError naming it otherwise."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
        raise ValueError(f"{what}: expected a positive int, got {dim!r}")
    return int(dim)


ROW_DTYPES = ("float32", "bfloat16", "float16")


def check_float_dtype(dtype):
    """The weight dtype name: 'float32', 'bfloat16' or 'float16' (also as torch/numpy dtypes)."""
    name = str(dtype).replace("torch.", "")
    if name not in ROW_DTYPES:
        raise ValueError(f"dtype: expected one of {list(ROW_DTYPES)} for the rows, "
                         f"got {dtype!r}")
    return name
