"""DenseStore and DenseSpec: rows 0..N-1 of any row shape and dtype, in memory.

A dense table (DGL's ``DistTensor``: float rows, int64 labels, bool masks, 16-bit rows)
is a :class:`DenseSpec` under a partition-policy router: one :class:`DenseStore` per
partition of its policy, each key its own slot. A store allocates its columns through an
:class:`Allocator` its holder gives it (a server's shared-memory arena, so co-located
trainers map the rows; numpy on huge pages otherwise) and answers the mapping of its
weight column (:meth:`DenseStore.open_column`), as a file store answers its file's.

Example:
    >>> from distemb.partition import range_policy
    >>> spec = DenseSpec((6, 2), "float32", range_policy(6, 2))
    >>> store = spec.make_store(1)
    >>> store.scatter(np.array([0]), np.ones((1, 2), np.float32))
    >>> store.gather(np.array([0, 2])).tolist(), spec.router(1).num_parts
    ([[1.0, 1.0], [0.0, 0.0]], 2)
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from distemb.arrays import DENSE_INIT, KEYED_INIT, check_init_func, check_table_shape
from distemb.errors import StoreError
from distemb.kernels import half
from distemb.kernels.half import dtype_name, storage_dtype
from distemb.kernels.hashtable import keys_array
from distemb.pages import back_with_huge_pages, populate
from distemb.layouts import json_layout, layout_json, layout_policy, policy_layout
from distemb.partition import PartitionPolicy, range_policy
from distemb.routers import PolicyRouter
from distemb.stores.init import KeyInit, ShardInit, ShardKeys, init_fields, init_of_fields
from distemb.stores.types import WEIGHT, RowStore, check_dim

#: Rows initialised per call of a KeyInit, bounding the temporary it returns.
INIT_CHUNK = 1 << 16
#: Dtypes a dense table's rows may have (an optimizer updates the float ones).
TABLE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8",
                "uint8", "bool")
#: Row dtypes the update rules run on.
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def fill_rows(arr, init, start=0, stop=None, encode=lambda rows: rows):
    """``arr[k - start] = encode(init(k))`` for keys ``k`` in [start, stop), in chunks."""
    stop = arr.shape[0] + start if stop is None else stop
    for lo in range(start, stop, INIT_CHUNK):
        keys = np.arange(lo, min(lo + INIT_CHUNK, stop), dtype=np.int64)
        rows = np.asarray(init(keys))
        if rows.shape != (len(keys),) + arr.shape[1:]:
            raise StoreError(f"init: returned shape {rows.shape} for {len(keys)} keys, "
                             f"expected {(len(keys),) + arr.shape[1:]}")
        arr[lo - start:lo - start + len(keys)] = encode(rows)


class Allocator:
    """Where a dense store's columns live: zero-filled numpy arrays, backed with huge
    pages (the default), or a holder's (a server's :class:`~distemb.transport.shm.
    ShmArena`, which has the same four methods)."""

    def allocate(self, shape, dtype) -> np.ndarray:
        """A zero-filled C-contiguous array, its pages mapped now (:func:`~distemb.pages.
        populate`: an optimizer state's pages would otherwise come one fault at a time,
        inside the steps that first touch them)."""
        arr = np.zeros(shape, dtype)
        populate(arr)
        return arr

    def dup_segment(self, arr) -> Optional[int]:
        """A new read-only descriptor of the memory file holding ``arr``, or None."""
        return None

    def version_of(self, arr) -> Optional[np.ndarray]:
        """The header of ``arr``'s memory file (int64 words: the seqlock counter first,
        :data:`~distemb.transport.shm.HEADER_WORDS`), or None."""
        return None

    def release(self, arr) -> None:
        """``arr`` is no longer used (its memory may go)."""


IN_MEMORY = Allocator()


class DenseStore(RowStore):
    """A fixed set of ``num_rows`` keys 0..N-1, each key its own slot, in memory.

    Args:
        num_rows: rows (keys) of the shard.
        dim: row length, or a row shape (a tuple: any number of dimensions).
        dtype: the rows' dtype: one of :data:`TABLE_DTYPES` (``"float32"``,
            ``"bfloat16"``, ``"float16"`` for rows an optimizer updates).
        init: ``init(keys) -> rows`` for the initial rows (zeros when None).
        rounding: ``"nearest"`` (even) or ``"stochastic"`` (bfloat16 rows only).
        seed: the stochastic rounding's seed.
        allocator: where the columns live (:class:`Allocator`; numpy by default).

    Raises:
        ValueError: ``num_rows`` not a positive int or a row dimension not a positive
            int, another dtype.
        TypeError: ``init`` cannot be called as ``init(keys)`` (a dense table's
            ``init(shape, dtype)``, say).

    Example:
        >>> s = DenseStore(3, 2, init=lambda k: np.repeat(k[:, None], 2, 1).astype("f4"))
        >>> s.gather(np.array([2])).tolist()
        [[2.0, 2.0]]
    """

    fixed_keys = True
    _allocator = IN_MEMORY

    def __init__(self, num_rows, dim, dtype="float32", init=None, rounding="nearest",
                 seed=0, allocator=IN_MEMORY):
        self.num_rows = check_dim(num_rows, "num_rows")
        row_shape = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
        self.row_shape = tuple(check_dim(d, "row shape") for d in row_shape)
        self.dim = int(np.prod(self.row_shape, dtype=np.int64))
        self.dtype = str(dtype).replace("torch.", "")
        if self.dtype not in TABLE_DTYPES:
            raise ValueError(f"dtype: expected one of {list(TABLE_DTYPES)}, got {dtype!r}")
        check_init_func(init, KEYED_INIT, "init")
        self._set_rounding(rounding, seed)
        self._allocator = allocator
        self._cols, self._shapes = {}, {}
        self._set(WEIGHT, self._new_array(WEIGHT, self.row_shape, self.dtype, 0, False),
                  self.row_shape)
        if init is not None:
            fill_rows(self._cols[WEIGHT], init, encode=self.encode)

    @classmethod
    def from_array(cls, weight, rounding="nearest", seed=0):
        """A store holding ``weight`` (shared, not copied) as its weight column.

        Args:
            weight: a C-contiguous array with one row per key (``(N, ...)``).
            rounding, seed: how updates round into bfloat16 rows.

        Raises:
            ValueError: ``weight`` is not a C-contiguous array of at least one dimension;
                stochastic rounding of rows other than bfloat16.
        """
        weight = weight if isinstance(weight, np.ndarray) else np.asarray(weight)
        if weight.ndim < 1 or not weight.flags.c_contiguous:
            raise ValueError(f"weight: expected a C-contiguous (N, ...) array, got "
                             f"{weight.dtype} {weight.shape}")
        store = cls.__new__(cls)
        store.num_rows = weight.shape[0]
        store.row_shape = tuple(weight.shape[1:])
        store.dim = int(np.prod(weight.shape[1:], dtype=np.int64))
        store.dtype = dtype_name(weight)
        store._allocator = IN_MEMORY
        store._cols, store._shapes = {}, {}
        store._set(WEIGHT, weight, weight.shape[1:])
        store._set_rounding(rounding, seed)
        return store

    def _new_array(self, name, row_shape, dtype, fill, keep):
        """A (num_rows,) + row_shape array of ``dtype`` filled with ``fill``, from the
        allocator (a file store maps column ``name``'s file, kept when ``keep``)."""
        arr = self._allocator.allocate((self.num_rows,) + tuple(row_shape),
                                       storage_dtype(dtype))
        if fill:
            arr[...] = fill
        return arr

    def _set(self, name, arr, row_shape):
        # rows are gathered and updated at random: on 2 MiB pages, not 4 KiB ones, in
        # every process (distemb/pages.py)
        back_with_huge_pages(arr)
        self._cols[name] = arr
        self._shapes[name] = (tuple(row_shape), dtype_name(arr))

    def encode(self, rows):
        """Rows in this store's dtype: float32 rows of a half store rounded to nearest-even;
        other rows as they are (numpy casts them on assignment)."""
        if not half.is_half(self.dtype) or np.asarray(rows).dtype == storage_dtype(self.dtype):
            return rows
        return half.encode(rows, self.dtype)

    def slots(self, keys, insert=False):
        keys = keys_array(keys)
        # one pass: as unsigned, a negative key is above every row count
        if keys.size and int(keys.view(np.uint64).max()) >= self.num_rows:
            lo, hi = int(keys.min()), int(keys.max())
            if lo < 0 or hi >= self.num_rows:
                raise StoreError(f"keys: key {lo if lo < 0 else hi} is out of range for a "
                                 f"store of {self.num_rows} rows (expected 0 <= key < "
                                 f"{self.num_rows})")
        return keys

    def find(self, keys):
        """Slot of each key (a dense store's keys are its slots), -1 outside 0..N-1."""
        keys = keys_array(keys)
        return np.where((keys >= 0) & (keys < self.num_rows), keys, -1)

    def column(self, name):
        try:
            return self._cols[name]
        except KeyError:
            raise StoreError(f"column: no column {name!r} (has {list(self._cols)})") from None

    def add_column(self, name, row_shape, dtype, fill=0.0, keep=False):
        if name == WEIGHT:
            raise StoreError("column: 'weight' is the rows; it cannot be re-added")
        row_shape = tuple(int(s) for s in row_shape)
        dtype = np.dtype(dtype).name
        if keep and self._shapes.get(name) == (row_shape, dtype):
            return
        self.drop_column(name)
        self._set(name, self._new_array(name, row_shape, dtype, fill, keep), row_shape)

    def drop_column(self, name):
        if name == WEIGHT:
            raise StoreError("column: 'weight' is the rows; it cannot be dropped")
        arr = self._cols.pop(name, None)
        self._shapes.pop(name, None)
        if arr is not None:
            self._allocator.release(arr)

    def columns(self):
        return dict(self._shapes)

    def keys(self):
        return np.arange(self.num_rows, dtype=np.int64)

    def size(self):
        return self.num_rows

    @property
    def capacity(self):
        return self.num_rows

    def remove(self, keys):
        raise StoreError(f"remove: a {type(self).__name__} holds the fixed keys "
                         f"0..{self.num_rows - 1}; use a HashStore for removable keys")

    def evict(self, target_size, policy=None, protect=None):
        raise StoreError(f"evict: a {type(self).__name__} holds the fixed keys "
                         f"0..{self.num_rows - 1}; only a HashStore evicts")

    def open_column(self, name):
        """A read-only descriptor of the memory file holding column ``name`` (a seqlock
        header, then the rows), when the allocator put it in one; else None."""
        return self._allocator.dup_segment(self.column(name))

    def counter_of(self, name):
        """The seqlock counter in the header of column ``name``'s memory file, or None."""
        return self._allocator.version_of(self.column(name))

    def export(self):
        # every key is its own slot: the columns are already in key order
        return self.keys(), {name: self.decode(arr) if name == WEIGHT else np.array(arr)
                             for name, arr in self._cols.items()}

    def close(self):
        for arr in self._cols.values():
            self._allocator.release(arr)
        self._cols = {}
        self.closed = True


@dataclass(frozen=True)
class DenseSpec:
    """A dense table: rows 0..N-1 of ``shape[1:]`` and ``dtype``, one
    :class:`DenseStore` per partition of ``policy`` (partition ``p`` on holder
    ``p % H``: the servers, or a collective job's ranks).

    Args:
        shape: (N, ...) of the whole table.
        dtype: one of :data:`TABLE_DTYPES`.
        policy: the :class:`~distemb.partition.PartitionPolicy` sharding its rows (None:
            one range).
        init: None (zeros), a key initialiser (:func:`~distemb.stores.key_normal`: every
            store fills its own rows, on the servers too), or a shard initialiser
            ``init(shape, dtype) -> rows`` (DGL's ``init_func``, one call per partition of
            the policy), which runs where the function lives: the client that makes the
            table writes its rows (:class:`~distemb.stores.init.ShardInit`).
        rounding_seed: None (updates round to nearest-even), or the seed of the
            stochastic rounding of a bfloat16 table (mixed with the partition).

    Raises:
        ValueError: a field out of its domain (named, with the value).
        TypeError: a shape that is not ints, an ``init`` of neither signature.

    Example:
        >>> DenseSpec((4, 3), "int64").num_keys, DenseSpec((4, 3)).row_shape
        (4, (3,))
    """

    shape: tuple
    dtype: str = "float32"
    policy: Optional[PartitionPolicy] = None
    init: Optional[object] = None
    rounding_seed: Optional[int] = None

    kind = "dense"
    sink = None  # its keys are fixed: nothing is evicted
    portable = True
    fixed_keys = True
    persistent = False

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise once, here
        shape = check_table_shape(self.shape)
        if any(s < 1 for s in shape[1:]) or len(shape) > 4:
            raise ValueError(f"shape: expected (N, ...) with 1 to 3 row dimensions >= 1, got "
                             f"{shape}")
        set_(self, "shape", shape)
        dtype = str(self.dtype).replace("torch.", "")
        if dtype not in TABLE_DTYPES:
            raise ValueError(f"dtype: expected one of {list(TABLE_DTYPES)}, got {self.dtype!r}")
        set_(self, "dtype", dtype)
        policy = self.policy if self.policy is not None else range_policy(shape[0])
        if not isinstance(policy, PartitionPolicy):
            raise TypeError(f"part_policy: expected a distemb PartitionPolicy, got "
                            f"{type(policy).__name__}")
        if policy.get_size() != shape[0]:
            raise ValueError(f"part_policy: {policy.policy_str} has {policy.get_size()} ids, "
                             f"but shape[0] is {shape[0]}")
        set_(self, "policy", policy)
        if self.init is not None and not isinstance(self.init, (KeyInit, ShardInit)):
            check_init_func(self.init, DENSE_INIT)
            set_(self, "init", ShardInit(self.init))
        if self.rounding_seed is not None:
            if isinstance(self.rounding_seed, bool) or \
                    not isinstance(self.rounding_seed, (int, np.integer)) or \
                    not 0 <= self.rounding_seed <= MAX_SEED:
                raise ValueError(f"rounding_seed: expected an int in 0..{MAX_SEED}, got "
                                 f"{self.rounding_seed!r}")
            if dtype != "bfloat16":
                raise ValueError(f"rounding_seed: stochastic rounding is for bfloat16 rows, "
                                 f"got dtype {dtype!r}")
            set_(self, "rounding_seed", int(self.rounding_seed))

    @property
    def num_keys(self):
        return self.shape[0]

    @property
    def row_shape(self):
        return self.shape[1:]

    @property
    def dim(self):
        return math.prod(self.shape[1:])

    @property
    def capacity(self):
        return self.shape[0]

    @property
    def rounding(self):
        return "nearest" if self.rounding_seed is None else "stochastic"

    def differences(self, other) -> str:
        """What differs from ``other`` apart from the policy and the initialiser ("" when
        a table made from one serves the other)."""
        if not isinstance(other, DenseSpec):
            return f"kind {self.kind!r}, got kind {getattr(other, 'kind', other)!r}"
        out = [f"{f} {getattr(self, f)!r}, got {f} {getattr(other, f)!r}"
               for f in ("shape", "dtype") if getattr(self, f) != getattr(other, f)]
        return "; ".join(out)

    def router(self, num_holders=1):
        """Keys by the table's partition policy, a shard per partition
        (:class:`~distemb.routers.PolicyRouter`)."""
        return PolicyRouter(self.policy)

    def make_store(self, part=0, num_holders=1, allocator=IN_MEMORY):
        """The DenseStore of partition ``part``, its rows from a key initialiser (a shard
        initialiser's rows are written by the client that made the table)."""
        router = self.router(num_holders)
        init = self.init if isinstance(self.init, KeyInit) else None
        if init is not None and router.progression(part) != (0, 1):
            init = ShardKeys(init, router, part)
        seed = 0 if self.rounding_seed is None else half.shard_seed(self.rounding_seed, part)
        return DenseStore(router.part_size(part), self.row_shape, self.dtype, init,
                          self.rounding, seed, allocator)

    def fields(self):
        """The spec as JSON-able fields for a server.

        Raises:
            ValueError: a policy whose book cannot travel (named).
        """
        kind, params = init_fields(self.init if isinstance(self.init, KeyInit) else None,
                                   self.dim)
        return {"kind": self.kind, "dim": self.dim, "dtype": self.dtype, "init": kind,
                "init_args": params, "capacity": 0, "evict": "lru", "low_water": 1.0,
                "rounding": self.rounding, "num_rows": self.shape[0], "path": "",
                "preallocate": 0, "partition": layout_json(policy_layout(self.policy)),
                "row_shape": list(self.shape[1:]),
                "seed": -1 if self.rounding_seed is None else self.rounding_seed,
                "sink": ""}

    @classmethod
    def from_fields(cls, f):
        """The spec :meth:`fields` described (a shard initialiser stays with the client).

        Raises:
            ValueError: a missing or invalid field.
        """
        try:
            shape = (f["num_rows"],) + tuple(f["row_shape"])
            policy = layout_policy(json_layout(f["partition"]), f["num_rows"])
            seed = None if f["seed"] < 0 else f["seed"]
            return cls(shape, f["dtype"], policy, init_of_fields(f), seed)
        except (KeyError, TypeError) as e:
            raise ValueError(f"table spec: missing or invalid field ({e})") from None


#: Largest stochastic-rounding seed (it travels as a message's int field).
MAX_SEED = (1 << 62) - 1


