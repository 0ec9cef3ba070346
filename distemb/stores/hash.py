"""HashStore: any int64 key, an open-addressing index over growable column arrays.

Keys map to slots through a :class:`~distemb.kernels.hashtable.HashIndex` (compiled, or
its dict twin under ``DISTEMB_NO_EXT=1``); columns are numpy arrays with one row per
slot, doubled when the index hands out a slot past their end. A removed key's slot is
reused by the next insertion, which re-initialises every column of that slot: a key
that comes back starts from its initial row and fresh optimizer state.

Eviction follows TFRA's restrict policies: ``"lru"`` removes the keys looked up least
recently (a per-slot tick, advanced by every lookup batch), ``"lfu"`` the keys looked up
in the fewest batches (ties: least recent first). :meth:`HashStore.evict` does it on
demand; with a ``capacity``, a lookup that grows the store past it evicts down to
``low_water`` (a fraction of the capacity, so one eviction pass serves many batches),
never evicting the keys of that lookup.
"""
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

from distemb.arrays import KEYED_INIT, check_init_func
from distemb.enums import EvictPolicy, Rounding
from distemb.errors import MissingKeyError, StoreError
from distemb.kernels.half import storage_dtype
from distemb.kernels.hashtable import RESERVED_KEYS, HashIndex, keys_array
from distemb.routers import KeyHashRouter
from distemb.stores.init import KeyInit, init_fields, init_of_fields
from distemb.stores.types import WEIGHT, RowStore, check_dim, check_float_dtype

log = logging.getLogger("distemb")

# slot_key of a slot no key holds: a key the index reserves (-1 is a key like any other;
# as the marker it made key -1 invisible to eviction)
FREE = RESERVED_KEYS[0]


class HashStore(RowStore):
    """Rows keyed by arbitrary int64 keys; grows, removes, evicts.

    Args:
        dim: row length.
        dtype: weight dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        init: ``init(keys) -> rows``, a pure function of each key (zeros when None):
            see :mod:`distemb.stores.init` for seeded random initialisers.
        capacity: keys held at most; a lookup past it evicts (None: unbounded).
        evict: eviction policy, ``"lru"`` or ``"lfu"`` (:class:`EvictPolicy`).
        low_water: automatic eviction brings the size down to ``low_water * capacity``.
        rounding: ``"nearest"`` (even) or ``"stochastic"`` (bfloat16 rows only).
        reserve: keys to make room for up front.
        native: index implementation (see :class:`~distemb.kernels.hashtable.HashIndex`).

    Raises:
        ValueError: ``capacity`` < 1, an unknown ``evict``, ``low_water`` outside (0, 1].
        TypeError: ``init`` cannot be called as ``init(keys)`` (a dense table's
            ``init(shape, dtype)``, say).

    Example:
        >>> s = HashStore(2, capacity=2)
        >>> s.lookup(np.array([10**12])).shape
        (1, 2)
        >>> _ = s.lookup(np.array([-5]))
        >>> _ = s.lookup(np.array([7]))   # past capacity: evicts the least recent key
        >>> s.keys().tolist()
        [-5, 7]
    """

    def __init__(self, dim, dtype="float32", init=None, capacity=None, evict="lru",
                 low_water=1.0, reserve=0, native=None, rounding="nearest"):
        self.dim = check_dim(dim)
        self.dtype = check_float_dtype(dtype)
        self._set_rounding(rounding)
        if capacity is not None:
            capacity = check_dim(capacity, "capacity")
        self._capacity = capacity
        self.policy = EvictPolicy.parse(evict, "evict", ValueError)
        if not isinstance(low_water, (int, float)) or not 0.0 < low_water <= 1.0:
            raise ValueError(f"low_water: expected a float in (0, 1], got {low_water!r}")
        self.low_water = float(low_water)
        check_init_func(init, KEYED_INIT, "init")
        self._init = init
        self._index = HashIndex(reserve, native=native)
        rows = max(16, int(reserve))
        self._cols = {WEIGHT: self._new_column(WEIGHT, rows, (self.dim,), self.dtype, 0.0)}
        self._specs = {WEIGHT: ((self.dim,), self.dtype, 0.0)}
        self._slot_key = np.full(rows, FREE, np.int64)
        self._last = np.zeros(rows, np.int64)
        self._count = np.zeros(rows, np.int64)
        self._tick = 0

    # ---- slots ------------------------------------------------------------------------

    def _grow(self, need):
        rows = self._slot_key.shape[0]
        if need <= rows:
            return
        while rows < need:
            rows *= 2

        def grown(a, fill):
            b = np.full((rows,) + a.shape[1:], fill, a.dtype)
            b[:a.shape[0]] = a
            return b

        def grown_column(name, a):
            shape, dtype, fill = self._specs[name]
            b = self._new_column(name, rows, shape, dtype, fill)
            b[:a.shape[0]] = a
            return b

        self._cols = {n: grown_column(n, a) for n, a in self._cols.items()}
        self._slot_key = grown(self._slot_key, FREE)
        self._last, self._count = grown(self._last, 0), grown(self._count, 0)

    def _init_slots(self, keys, slots):
        """Fresh rows for newly inserted ``keys`` at ``slots`` (every column)."""
        for name in self._cols:
            if name == WEIGHT and self._init is not None:
                rows = np.asarray(self._init(keys))
                if rows.shape != (len(keys), self.dim):
                    raise StoreError(f"init: returned shape {rows.shape} for {len(keys)} "
                                     f"keys, expected {(len(keys), self.dim)}")
                self._write_slots(name, slots, rows)
            else:
                self._write_slots(name, slots, self._specs[name][2])
        self._slot_key[slots] = keys
        self._last[slots] = 0
        self._count[slots] = 0

    def _new_column(self, name, rows, row_shape, dtype, fill):
        """Column ``name``: ``rows`` slots of ``row_shape`` (dtype name: a half weight
        column in its storage dtype), every slot ``fill``."""
        return np.full((rows,) + tuple(row_shape), fill, storage_dtype(dtype))

    def slots(self, keys, insert=False):
        keys = keys_array(keys)
        if not insert:
            slots = self._index.find(keys)
            missing = slots < 0
            if missing.any():
                bad = keys[missing]
                raise MissingKeyError(f"keys: {bad.size} key(s) not in the store, e.g. "
                                      f"{bad[:5].tolist()} (never inserted, removed or "
                                      "evicted); look them up with insert=True to add them")
            return slots
        slots, new = self._index.find_or_insert(keys)
        if new.any():
            try:
                self._grow(self._index.high_water)
                self._init_slots(keys[new], slots[new])
            except BaseException:  # e.g. the user's init raised: nothing is inserted
                self._index.remove(keys[new])
                raise
        return slots

    def find(self, keys):
        """Slots of ``keys``, -1 where absent (nothing inserted, no access counted)."""
        return self._index.find(keys)

    def access(self, keys):
        """Slots of ``keys`` (inserted when absent), counted as an access for eviction.

        Past ``capacity``, evicts down to ``low_water * capacity`` first-least-recent (or
        least-frequent), sparing these keys.
        """
        keys = keys_array(keys)
        slots = self.slots(keys, insert=True)
        self._tick += 1
        self._last[slots] = self._tick
        self._count[slots] += 1
        if self._capacity is not None and self._index.size > self._capacity:
            self.evict(int(self._capacity * self.low_water), protect=self._tick)
            slots = self._index.find(keys)  # unchanged: the keys of this tick are spared
        return slots

    def _slots_to_write(self, keys, column):
        """Slots of upserted ``keys``: a write of the weight is an access (it may evict
        other keys past the capacity, as a lookup does); state columns are written to keys
        the weight's write made, never inserting one.

        Raises:
            StoreError: more distinct keys than the capacity (nothing is written): the
                store could not hold them, and would evict some at the next lookup.
            MissingKeyError: a state column's write to a key not held (nothing is
                written): the state of a key belongs with its row.
        """
        if column != WEIGHT:
            slots = self._index.find(keys)
            if (slots < 0).any():
                bad = keys_array(keys)[slots < 0]
                raise MissingKeyError(
                    f"keys: {bad.size} key(s) not in the store, e.g. {bad[:5].tolist()}: "
                    f"state {column!r} is written to keys the store holds (write their "
                    "weight first)")
            return slots
        if self._capacity is not None:
            n = len(np.unique(keys))
            if n > self._capacity:
                raise StoreError(f"keys: {n:,} distinct keys written to a store that holds "
                                 f"at most {self._capacity:,} (its capacity); write fewer, "
                                 "or make the table with a larger capacity")
        return self.access(keys)

    # ---- columns ----------------------------------------------------------------------

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
        if keep and name in self._specs and self._specs[name][:2] == (row_shape, dtype):
            return
        self._cols[name] = self._new_column(name, self._slot_key.shape[0], row_shape, dtype,
                                            fill)
        self._specs[name] = (row_shape, dtype, fill)

    def set_fill(self, name, fill):
        if name == WEIGHT or name not in self._specs:
            raise StoreError(f"set_fill: no state column {name!r} (has "
                             f"{[c for c in self._specs if c != WEIGHT]})")
        shape, dtype, _ = self._specs[name]
        self._specs[name] = (shape, dtype, fill)

    def drop_column(self, name):
        if name == WEIGHT:
            raise StoreError("column: 'weight' is the rows; it cannot be dropped")
        self._cols.pop(name, None)
        self._specs.pop(name, None)

    def columns(self):
        return {n: s[:2] for n, s in self._specs.items()}

    # ---- keys -------------------------------------------------------------------------

    def keys(self):
        keys, _ = self._index.items()
        return np.sort(keys)

    def size(self):
        return self._index.size

    @property
    def capacity(self):
        return self._capacity

    def remove(self, keys):
        slots = self._index.remove(keys)
        freed = slots[slots >= 0]
        self._slot_key[freed] = FREE
        return int(freed.size)

    def evict(self, target_size, policy=None, protect=None):
        """Remove keys, by ``policy`` (default: the store's), until ``target_size`` remain.

        Args:
            target_size: keys to keep (>= 0).
            policy: ``"lru"``/``"lfu"`` or an :class:`EvictPolicy`.
            protect: a tick whose keys are never evicted (the lookup in progress).

        Returns:
            The evicted keys (int64), their rows and state gone with them.
        """
        if isinstance(target_size, bool) or not isinstance(target_size, (int, np.integer)) \
                or target_size < 0:
            raise ValueError(f"target_size: expected an int >= 0, got {target_size!r}")
        if policy is not None:
            policy = EvictPolicy.parse(policy, "policy", ValueError)
        policy = policy or self.policy
        excess = self._index.size - int(target_size)
        if excess <= 0:
            return np.empty(0, np.int64)
        live = np.flatnonzero(self._slot_key[:self._index.high_water] != FREE)
        last = self._last[live]
        # one int64 rank per slot (smaller goes first); ticks stay far below 2**40
        rank = last if policy is EvictPolicy.LRU else \
            (np.minimum(self._count[live], (1 << 22) - 1) << 40) | last
        if protect is not None:
            rank = np.where(last == protect, np.iinfo(np.int64).max, rank)
            excess = min(excess, int((last != protect).sum()))
            if excess < self._index.size - int(target_size):
                log.warning("HashStore: %d keys of one lookup exceed the capacity's "
                            "low-water target of %d keys (low_water %s x capacity %s); "
                            "holding %d keys", int((last == protect).sum()), target_size,
                            self.low_water, self._capacity, self._index.size - excess)
        if excess <= 0:
            return np.empty(0, np.int64)
        victims = live[np.argpartition(rank, excess - 1)[:excess]]
        keys = self._slot_key[victims].copy()
        self.remove(keys)
        return keys

    def load_factor(self):
        """Keys held per bucket of the index."""
        return self._index.size / self._index.buckets

    def access_counts(self, keys):
        """(last lookup tick, lookup batches) of each key (MissingKeyError when absent)."""
        slots = self.slots(keys)
        return self._last[slots].copy(), self._count[slots].copy()

    def nbytes(self):
        per_slot = sum(a.nbytes for a in self._cols.values()) + self._slot_key.nbytes \
            + self._last.nbytes + self._count.nbytes
        return int(per_slot + self._index.nbytes())

    def close(self):
        self._cols = {}
        self.closed = True


@dataclass(frozen=True)
class HashTableSpec:
    """How to make a dynamic table's hash store(s); validated on construction.

    Args:
        dim: row length.
        dtype: row storage: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        init: the per-key initialiser (None: zeros). Any callable embedded; only a
            :class:`~distemb.stores.init.KeyInit` (``key_normal``/``key_uniform``) can be
            sent to servers (:meth:`fields` refuses anything else).
        capacity: keys the whole table holds at most (None: unbounded).
        evict: ``"lru"`` or ``"lfu"``.
        low_water: fraction of the capacity an automatic eviction goes down to.
        rounding: ``"nearest"`` or ``"stochastic"`` (bfloat16 rows).

    Raises:
        ValueError: a field out of its domain (named, with the value).

    Example:
        >>> from distemb.stores import key_normal
        >>> spec = HashTableSpec(4, init=key_normal(4, std=0.1), capacity=10, evict="lfu")
        >>> HashTableSpec.from_fields(spec.fields()) == spec, spec.make_store(0, 2).capacity
        (True, 5)
    """

    dim: int
    dtype: str = "float32"
    init: Optional[object] = None
    capacity: Optional[int] = None
    evict: str = "lru"
    low_water: float = 1.0
    rounding: str = "nearest"

    def differences(self, other: "HashTableSpec") -> str:
        """What differs between this spec and ``other`` apart from the initialiser
        (``"dim 2, got dim 3"``), or "" when a table made from one can serve the other."""
        if not isinstance(other, HashTableSpec):
            return f"kind {self.kind!r}, got kind {getattr(other, 'kind', other)!r}"
        out = []
        for field in ("dim", "dtype", "capacity", "evict", "low_water", "rounding"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field} {mine!r}, got {field} {theirs!r}")
        return "; ".join(out)

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "dim", check_dim(self.dim, "embedding_dim"))
        set_(self, "dtype", check_float_dtype(self.dtype))
        if self.capacity is not None:
            set_(self, "capacity", check_dim(self.capacity, "capacity"))
        set_(self, "evict", EvictPolicy.parse(self.evict, "evict", ValueError).value)
        set_(self, "rounding", Rounding.parse(self.rounding, "rounding", ValueError).value)
        lw = self.low_water
        if isinstance(lw, bool) or not isinstance(lw, (int, float)) or not 0.0 < lw <= 1.0:
            raise ValueError(f"low_water: expected a float in (0, 1], got {lw!r}")
        set_(self, "low_water", float(lw))
        check_init_func(self.init, KEYED_INIT)
        if isinstance(self.init, KeyInit) and self.init.dim != self.dim:
            raise ValueError(f"init_func: makes rows of dim {self.init.dim}, the table's "
                             f"dim is {self.dim}")

    kind = "hash"
    portable = True
    fixed_keys = False
    persistent = False

    def router(self, num_parts):
        """Keys by their hash (:class:`~distemb.routers.KeyHashRouter`)."""
        return KeyHashRouter(num_parts)

    def shard_capacity(self, num_shards):
        """Keys one of ``num_shards`` shards holds at most (None: unbounded)."""
        return None if self.capacity is None else -(-self.capacity // num_shards)

    num_keys = None  # any int64 key

    @property
    def row_shape(self):
        return (self.dim,)

    def make_store(self, part=0, num_parts=1, allocator=None):
        """A fresh :class:`HashStore` for shard ``part`` of ``num_parts`` (its columns
        grow: it takes no allocator)."""
        return HashStore(self.dim, dtype=self.dtype, init=self.init,
                         capacity=self.shard_capacity(num_parts), evict=self.evict,
                         low_water=self.low_water, rounding=self.rounding)

    def fields(self):
        """The spec as JSON-able fields for a server.

        Raises:
            TypeError: ``init`` is a plain function: servers cannot run it; use
                :func:`~distemb.stores.key_normal` or ``key_uniform``.
        """
        kind, params = init_fields(self.init, self.dim)
        return {"kind": self.kind, "dim": self.dim, "dtype": self.dtype, "init": kind,
                "init_args": params, "capacity": self.capacity or 0, "evict": self.evict,
                "low_water": self.low_water, "rounding": self.rounding, "num_rows": 0,
                "path": "", "preallocate": 0, "partition": None, "row_shape": [self.dim],
                "seed": -1}

    @classmethod
    def from_fields(cls, f):
        """The spec :meth:`fields` described (zeros init as None).

        Raises:
            ValueError: a missing or invalid field.
        """
        try:
            return cls(f["dim"], f["dtype"], init_of_fields(f), f["capacity"] or None, f["evict"],
                       f["low_water"], f["rounding"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"table spec: missing or invalid field ({e})") from None
