"""HashTableSpec: everything needed to make a dynamic table's hash store, as plain data.

A dynamic table is one :class:`~distemb.stores.hash.HashStore` embedded, or one per
server in a cluster. The spec is what a trainer sends a server (:meth:`fields`, checked
again by :meth:`from_fields` on the server): dim, row dtype, the per-key initialiser as
a :class:`~distemb.stores.init.KeyInit` spec, capacity, eviction policy, low water and
rounding. ``capacity`` is the whole table's: with ``S`` shards each holds at most
``ceil(capacity / S)`` keys and evicts on its own (per-server LRU/LFU order).

Example:
    >>> from distemb.stores import key_normal
    >>> spec = HashTableSpec(4, init=key_normal(4, std=0.1), capacity=10, evict="lfu")
    >>> HashTableSpec.from_fields(spec.fields()) == spec
    True
    >>> spec.make_store(num_shards=2).capacity
    5
"""
from dataclasses import dataclass
from typing import Optional

from distemb.arrays import KEYED_INIT, check_init_func
from distemb.enums import EvictPolicy, Rounding
from distemb.stores.hash import HashStore
from distemb.stores.init import KeyInit, KeyZeros, init_from_spec
from distemb.stores.types import check_dim, check_float_dtype


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

    def shard_capacity(self, num_shards):
        """Keys one of ``num_shards`` shards holds at most (None: unbounded)."""
        return None if self.capacity is None else -(-self.capacity // num_shards)

    def make_store(self, num_shards=1):
        """A fresh :class:`HashStore` for one of ``num_shards`` shards of this table."""
        return HashStore(self.dim, dtype=self.dtype, init=self.init,
                         capacity=self.shard_capacity(num_shards), evict=self.evict,
                         low_water=self.low_water, rounding=self.rounding)

    def fields(self):
        """The spec as JSON-able fields for a server.

        Raises:
            TypeError: ``init`` is a plain function: servers cannot run it; use
                :func:`~distemb.stores.key_normal` or ``key_uniform``.
        """
        init = self.init if self.init is not None else KeyZeros(self.dim)
        if not isinstance(init, KeyInit):
            raise TypeError(
                f"init_func: a dynamic table in a cluster needs an initialiser its servers "
                f"can rebuild: distemb.stores.key_normal(dim, std, seed) or key_uniform(dim, "
                f"low, high, seed) (or None for zeros), got {init!r}; a Python function "
                f"cannot be sent to the servers")
        kind, params = init.spec()
        return {"dim": self.dim, "dtype": self.dtype, "init": kind, "init_args": params,
                "capacity": self.capacity or 0, "evict": self.evict,
                "low_water": self.low_water, "rounding": self.rounding}

    @classmethod
    def from_fields(cls, f):
        """The spec :meth:`fields` described (zeros init as None).

        Raises:
            ValueError: a missing or invalid field.
        """
        try:
            init = init_from_spec(f["init"], dict(f["init_args"]))
            return cls(f["dim"], f["dtype"], None if isinstance(init, KeyZeros) else init,
                       f["capacity"] or None, f["evict"], f["low_water"], f["rounding"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"table spec: missing or invalid field ({e})") from None
