"""HashIndex: a batch int64 key -> slot index, compiled (open addressing) or its twin.

The compiled table (``csrc/_hashtable.pyx``) is chosen by the same switches as every
kernel: it is the default while :func:`distemb.kernels.active` is ``'compiled'``
(``DISTEMB_NO_EXT=1`` or ``kernels.implementation('reference')`` give the dict twin in
:mod:`distemb.kernels.reference_hashtable`); ``native=`` picks per object. Both give the same slots for the same calls.

A slot is a row number in the value arrays of whoever owns the index (a hash store):
keys map to slots, freed slots are reused (last freed first), and ``high_water`` is one
past the largest slot ever handed out, so the owner knows how many rows its arrays need.

Example:
    >>> import numpy as np
    >>> idx = HashIndex()
    >>> slots, new = idx.find_or_insert(np.array([7, -3, 7]))
    >>> slots.tolist(), new.tolist()
    ([0, 1, 0], [True, True, False])
    >>> idx.find(np.array([-3, 5])).tolist()
    [1, -1]
"""
import numpy as np

from distemb import kernels
from distemb.kernels import reference_hashtable

if kernels.HAS_EXT:
    from distemb import _hashtable as _compiled  # built with _kernels, same switch
else:
    _compiled = None

#: Key values the table uses as markers; rejected as keys.
RESERVED_KEYS = (np.iinfo(np.int64).min, np.iinfo(np.int64).min + 1)


def keys_array(keys, what="keys"):
    """``keys`` as a 1-d C-contiguous int64 array; TypeError for non-integers."""
    a = np.asarray(keys)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what}: expected integer keys (int32/int64), got dtype={a.dtype}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: expected keys that fit in int64, got {int(a.max())}")
    return np.ascontiguousarray(a.reshape(-1), dtype=np.int64)


def table_keys(keys, what="keys"):
    """:func:`keys_array`, also refusing the two keys the hash table reserves.

    Raises:
        TypeError: non-integer keys.
        ValueError: a key <= -2**63 + 1 (the table's markers) or beyond int64.
    """
    k = keys_array(keys, what)
    if k.size and k.min() <= RESERVED_KEYS[1]:
        raise ValueError(f"{what}: {int(k.min())} is reserved by the hash table "
                         f"(every int64 key > {RESERVED_KEYS[1]} is allowed)")
    return k


class HashIndex:
    """Batch key -> slot map on an open-addressing table with linear probing.

    Args:
        capacity: keys to make room for up front (the table grows past it by rehashing).
        max_load: fraction of buckets filled before the table doubles, in (0, 1).
        native: True for the compiled table, False for the dict twin, None for the
            default (compiled when built and ``DISTEMB_NO_EXT`` is not set).

    Raises:
        ValueError: ``capacity`` < 0 or ``max_load`` outside (0, 1); ``native=True``
            when the compiled module is not available.

    Example:
        >>> idx = HashIndex(capacity=100)
        >>> idx.find_or_insert(np.arange(3))[0].tolist(), idx.size
        ([0, 1, 2], 3)
    """

    def __init__(self, capacity=0, max_load=0.75, native=None):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) \
                or capacity < 0:
            raise ValueError(f"capacity: expected an int >= 0, got {capacity!r}")
        if not isinstance(max_load, (int, float)) or not 0.0 < max_load < 1.0:
            raise ValueError(f"max_load: expected a float in (0, 1), got {max_load!r}")
        if native is None:
            native = _compiled is not None and kernels.active() == "compiled"
        if native and _compiled is None:
            raise ValueError("native: the compiled hash table is not available "
                             f"(kernels: {kernels.IMPL_NAME}); build the extension")
        impl = _compiled if native else reference_hashtable
        self.native = bool(native)
        self._t = impl.HashTable(16, float(max_load))
        self._t.reserve(int(capacity))

    def _keys(self, keys):
        return table_keys(keys)

    def find(self, keys):
        """Slots of ``keys`` (int64, -1 where absent)."""
        k = self._keys(keys)
        out = np.empty(k.shape[0], np.int64)
        self._t.find(k, out)
        return out

    def find_or_insert(self, keys):
        """(slots, is_new): slots of ``keys``, absent keys inserted (is_new True)."""
        k = self._keys(keys)
        out = np.empty(k.shape[0], np.int64)
        new = np.empty(k.shape[0], np.uint8)
        self._t.find_or_insert(k, out, new)
        return out, new.view(np.bool_)

    def remove(self, keys):
        """Remove ``keys``; the slots they held (-1 where absent), now free for reuse."""
        k = self._keys(keys)
        out = np.empty(k.shape[0], np.int64)
        self._t.remove(k, out)
        return out

    def items(self):
        """(keys, slots) of every key held, in no particular order."""
        return self._t.items()

    def reserve(self, n):
        """Grow now so that ``n`` keys fit under the maximum load."""
        self._t.reserve(int(n))

    @property
    def size(self):
        """Keys held."""
        return self._t.size

    @property
    def buckets(self):
        """Buckets of the table (a power of two)."""
        return self._t.buckets

    @property
    def high_water(self):
        """One past the largest slot ever handed out."""
        return self._t.high_water

    def nbytes(self):
        """Bytes of the index itself (buckets and free list; the compiled table)."""
        return self._t.nbytes()
