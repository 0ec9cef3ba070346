"""Table specs: everything needed to make a table's stores, as plain data, by kind.

A spec is what a trainer sends a server (:meth:`fields`, checked again by
:func:`spec_from_fields` on the server), so each shard's store is made where it lives,
from validated data. The kinds (:data:`SPECS`, the store registry):

- :class:`HashTableSpec` (``"hash"``): a dynamic table, any int64 key, one
  :class:`~distemb.stores.hash.HashStore` per shard, keys routed by key hash. dim, row
  dtype, the per-key initialiser as a :class:`~distemb.stores.init.KeyInit` spec,
  capacity, eviction policy, low water and rounding. ``capacity`` is the whole table's:
  with ``S`` shards each holds at most ``ceil(capacity / S)`` keys and evicts on its own
  (per-server LRU/LFU order).
- :class:`FileTableSpec` (``"file"``): keys 0..N-1 on memory-mapped files (tables larger
  than RAM), one :class:`~distemb.stores.file.FileStore` per shard under
  ``path/part-<p>-of-<S>``, keys routed by ranges.

Each spec says how its keys are routed (:meth:`router`) and what its stores can do
(:attr:`fixed_keys`: no remove or evict; :attr:`persistent`).

Example:
    >>> from distemb.stores import key_normal
    >>> spec = HashTableSpec(4, init=key_normal(4, std=0.1), capacity=10, evict="lfu")
    >>> spec_from_fields(spec.fields()) == spec
    True
    >>> spec.make_store(0, 2).capacity
    5
"""
import os
from dataclasses import dataclass
from typing import Optional

from distemb.arrays import KEYED_INIT, check_init_func
from distemb.enums import EvictPolicy, Rounding
from distemb.routers import KeyHashRouter, PolicyRouter
from distemb.stores.file import FileStore
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
    fixed_keys = False
    persistent = False

    def router(self, num_parts):
        """Keys by their hash (:class:`~distemb.routers.KeyHashRouter`)."""
        return KeyHashRouter(num_parts)

    def shard_capacity(self, num_shards):
        """Keys one of ``num_shards`` shards holds at most (None: unbounded)."""
        return None if self.capacity is None else -(-self.capacity // num_shards)

    def make_store(self, part=0, num_parts=1):
        """A fresh :class:`HashStore` for shard ``part`` of ``num_parts``."""
        return HashStore(self.dim, dtype=self.dtype, init=self.init,
                         capacity=self.shard_capacity(num_parts), evict=self.evict,
                         low_water=self.low_water, rounding=self.rounding)

    def fields(self):
        """The spec as JSON-able fields for a server.

        Raises:
            TypeError: ``init`` is a plain function: servers cannot run it; use
                :func:`~distemb.stores.key_normal` or ``key_uniform``.
        """
        kind, params = _init_fields(self.init, self.dim)
        return {"kind": self.kind, "dim": self.dim, "dtype": self.dtype, "init": kind,
                "init_args": params, "capacity": self.capacity or 0, "evict": self.evict,
                "low_water": self.low_water, "rounding": self.rounding, "num_rows": 0,
                "path": "", "preallocate": 0}

    @classmethod
    def from_fields(cls, f):
        """The spec :meth:`fields` described (zeros init as None).

        Raises:
            ValueError: a missing or invalid field.
        """
        try:
            return cls(f["dim"], f["dtype"], _init_of(f), f["capacity"] or None, f["evict"],
                       f["low_water"], f["rounding"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"table spec: missing or invalid field ({e})") from None


def _init_fields(init, dim):
    """(kind, params) of a key initialiser a server can rebuild; TypeError otherwise."""
    init = init if init is not None else KeyZeros(dim)
    if not isinstance(init, KeyInit):
        raise TypeError(
            f"init_func: a table on a cluster's servers needs an initialiser its servers "
            f"can rebuild: distemb.stores.key_normal(dim, std, seed) or key_uniform(dim, "
            f"low, high, seed) (or None for zeros), got {init!r}; a Python function "
            f"cannot be sent to the servers")
    return init.spec()


def _init_of(fields):
    init = init_from_spec(fields["init"], dict(fields["init_args"]))
    return None if isinstance(init, KeyZeros) else init


class _Offset:
    """A key initialiser seen from one shard: its local key k is global key start + k."""

    def __init__(self, init, start):
        self.init, self.start = init, start

    def __call__(self, keys):
        return self.init(keys + self.start)


@dataclass(frozen=True)
class FileTableSpec:
    """A table of keys 0..N-1 on memory-mapped files, one FileStore per shard.

    Shard ``p`` of ``S`` is the FileStore at ``path/part-<p>-of-<S>`` (made, or reopened
    with its rows and optimizer state), holding its range of the keys
    (:meth:`router`); on a server, ``path`` names a directory on the server's machine.

    Args:
        path: the table's directory (absolute in a cluster: servers resolve it).
        num_rows: keys 0..num_rows-1.
        dim: row length.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        init: a key initialiser (None: zeros; in a cluster a ``key_normal`` /
            ``key_uniform``, which servers rebuild).
        rounding: ``"nearest"`` or ``"stochastic"`` (bfloat16 rows).
        preallocate: reserve the files' blocks when made (a full disk fails then, not
            mid-training).

    Raises:
        ValueError: a field out of its domain (named, with the value).

    Example:
        >>> import tempfile
        >>> spec = FileTableSpec(tempfile.mkdtemp(), num_rows=10, dim=2, preallocate=False)
        >>> store = spec.make_store(1, 2)
        >>> store.num_rows, os.path.basename(store.path)
        (5, 'part-1-of-2')
        >>> store.close()
    """

    path: str
    num_rows: int
    dim: int
    dtype: str = "float32"
    init: Optional[object] = None
    rounding: str = "nearest"
    preallocate: bool = True

    kind = "file"
    fixed_keys = True
    persistent = True
    capacity = None

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise once, here
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"path: expected a directory path, got {self.path!r}")
        set_(self, "path", os.fspath(self.path))
        set_(self, "num_rows", check_dim(self.num_rows, "num_rows"))
        set_(self, "dim", check_dim(self.dim, "embedding_dim"))
        set_(self, "dtype", check_float_dtype(self.dtype))
        set_(self, "rounding", Rounding.parse(self.rounding, "rounding", ValueError).value)
        set_(self, "preallocate", bool(self.preallocate))
        check_init_func(self.init, KEYED_INIT)
        if isinstance(self.init, KeyInit) and self.init.dim != self.dim:
            raise ValueError(f"init_func: makes rows of dim {self.init.dim}, the table's "
                             f"dim is {self.dim}")

    def differences(self, other) -> str:
        """What differs from ``other`` apart from the initialiser ("" when none)."""
        if not isinstance(other, FileTableSpec):
            return f"kind {self.kind!r}, got kind {getattr(other, 'kind', other)!r}"
        out = []
        for field in ("path", "num_rows", "dim", "dtype", "rounding"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field} {mine!r}, got {field} {theirs!r}")
        return "; ".join(out)

    def router(self, num_parts):
        """Keys in ``num_parts`` near-equal ranges (:class:`~distemb.routers.PolicyRouter`)."""
        return PolicyRouter.ranges(self.num_rows, num_parts)

    def make_store(self, part=0, num_parts=1):
        """The FileStore of shard ``part`` of ``num_parts`` (made or reopened).

        Raises:
            StoreError: the directory is not writable, the disk is full, or it holds a
                store of another shape.
        """
        router = self.router(num_parts)
        start = int(router.to_global(part, [0])[0]) if router.part_size(part) else 0
        init = None if self.init is None else _Offset(self.init, start)
        return FileStore(os.path.join(self.path, f"part-{part}-of-{num_parts}"),
                         num_rows=router.part_size(part), dim=self.dim, dtype=self.dtype,
                         init=init, rounding=self.rounding, preallocate=self.preallocate)

    def fields(self):
        """The spec as JSON-able fields for a server (TypeError for a plain function)."""
        kind, params = _init_fields(self.init, self.dim)
        return {"kind": self.kind, "dim": self.dim, "dtype": self.dtype, "init": kind,
                "init_args": params, "capacity": 0, "evict": "lru", "low_water": 1.0,
                "rounding": self.rounding, "num_rows": self.num_rows, "path": self.path,
                "preallocate": int(self.preallocate)}

    @classmethod
    def from_fields(cls, f):
        """The spec :meth:`fields` described.

        Raises:
            ValueError: a missing or invalid field, or a relative path.
        """
        try:
            if not os.path.isabs(f["path"]):
                raise ValueError(f"path: a server needs an absolute path, got {f['path']!r}")
            return cls(f["path"], f["num_rows"], f["dim"], f["dtype"], _init_of(f),
                       f["rounding"], bool(f["preallocate"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"table spec: missing or invalid field ({e})") from None


#: The store registry: a spec class per kind of table store.
SPECS = {"hash": HashTableSpec, "file": FileTableSpec}


def spec_from_fields(fields):
    """The spec of the kind ``fields["kind"]`` names, from a server's request fields.

    Raises:
        ValueError: an unknown kind, or invalid fields for it.
    """
    kind = fields.get("kind")
    if kind not in SPECS:
        raise ValueError(f"kind: expected one of {sorted(SPECS)}, got {kind!r}")
    return SPECS[kind].from_fields(fields)
