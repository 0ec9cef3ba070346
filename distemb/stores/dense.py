"""DenseStore: one numpy array per column, keys 0..N-1 are the slots (today's shard)."""
import numpy as np

from distemb.arrays import KEYED_INIT, check_init_func
from distemb.errors import StoreError
from distemb.kernels.half import dtype_name, storage_dtype
from distemb.kernels.hashtable import keys_array
from distemb.pages import back_with_huge_pages
from distemb.stores.types import WEIGHT, RowStore, check_dim, check_float_dtype

#: Rows initialised per call of a KeyInit, bounding the temporary it returns.
INIT_CHUNK = 1 << 16


def fill_rows(arr, init, start=0, stop=None, encode=lambda rows: rows):
    """``arr[k - start] = encode(init(k))`` for keys ``k`` in [start, stop), in chunks."""
    stop = arr.shape[0] + start if stop is None else stop
    for lo in range(start, stop, INIT_CHUNK):
        keys = np.arange(lo, min(lo + INIT_CHUNK, stop), dtype=np.int64)
        rows = np.asarray(init(keys))
        if rows.shape != (len(keys), arr.shape[1]):
            raise StoreError(f"init: returned shape {rows.shape} for {len(keys)} keys, "
                             f"expected {(len(keys), arr.shape[1])}")
        arr[lo - start:lo - start + len(keys)] = encode(rows)


class DenseStore(RowStore):
    """A fixed set of ``num_rows`` keys 0..N-1, each key its own slot, in memory.

    Args:
        num_rows: rows (keys) of the shard.
        dim: row length.
        dtype: weight dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        init: ``init(keys) -> rows`` for the initial rows (zeros when None).
        rounding: ``"nearest"`` (even) or ``"stochastic"`` (bfloat16 rows only).

    Raises:
        ValueError: ``num_rows`` or ``dim`` not a positive int, another dtype.
        TypeError: ``init`` cannot be called as ``init(keys)`` (a dense table's
            ``init(shape, dtype)``, say).

    Example:
        >>> s = DenseStore(3, 2, init=lambda k: np.repeat(k[:, None], 2, 1).astype("f4"))
        >>> s.gather(np.array([2])).tolist()
        [[2.0, 2.0]]
    """

    fixed_keys = True

    def __init__(self, num_rows, dim, dtype="float32", init=None, rounding="nearest"):
        self.num_rows = check_dim(num_rows, "num_rows")
        self.dim = check_dim(dim)
        self.dtype = check_float_dtype(dtype)
        check_init_func(init, KEYED_INIT, "init")
        self._set_rounding(rounding)
        self._cols, self._shapes = {}, {}
        self._set(WEIGHT, self._new_array(WEIGHT, (self.dim,), self.dtype, 0.0, False),
                  (self.dim,))
        if init is not None:
            fill_rows(self._cols[WEIGHT], init, encode=self.encode)

    @classmethod
    def from_array(cls, weight, rounding="nearest", seed=0):
        """A store holding ``weight`` (shared, not copied) as its weight column.

        This is how a server or an embedded client keeps a dense shard whose arrays it
        allocated itself (in /dev/shm, say). Any row shape and dtype is held (a
        DistTensor of labels, say); the update rules run on 2-d float32, bfloat16 and
        float16 weights.

        Args:
            weight: a C-contiguous array with one row per key (``(N, ...)``).
            rounding, seed: how updates round into bfloat16 rows (stochastic rounding
                draws from ``seed``).

        Raises:
            ValueError: ``weight`` is not a C-contiguous array of at least one dimension;
                stochastic rounding of rows other than bfloat16.
        """
        # the object itself, not np.asarray's base-class view of a memmap: its holder
        # finds it again by identity (a server's shm arena frees its file by it)
        weight = weight if isinstance(weight, np.ndarray) else np.asarray(weight)
        if weight.ndim < 1 or not weight.flags.c_contiguous:
            raise ValueError(f"weight: expected a C-contiguous (N, ...) array, got "
                             f"{weight.dtype} {weight.shape}")
        store = cls.__new__(cls)
        store.num_rows = weight.shape[0]
        store.dim = int(np.prod(weight.shape[1:], dtype=np.int64))
        store.dtype = dtype_name(weight)
        store._cols, store._shapes = {}, {}
        store._set(WEIGHT, weight, weight.shape[1:])
        store._set_rounding(rounding, seed)
        return store

    def adopt_column(self, name, array):
        """Hold ``array`` (shared, not copied; one row per key) as column ``name``,
        replacing any column of that name.

        Raises:
            StoreError: ``name`` is the weight, or ``array`` has another number of rows.
        """
        if name == WEIGHT:
            raise StoreError("column: 'weight' is the rows; it cannot be re-added")
        if array.ndim < 1 or array.shape[0] != self.num_rows:
            raise StoreError(f"column {name!r}: expected {self.num_rows} rows, got shape "
                             f"{array.shape}")
        self._set(name, array, array.shape[1:])

    def _new_array(self, name, row_shape, dtype, fill, keep):
        """A (num_rows,) + row_shape array of ``dtype`` filled with ``fill``."""
        return np.full((self.num_rows,) + tuple(row_shape), fill, dtype=storage_dtype(dtype))

    def _set(self, name, arr, row_shape):
        # rows are gathered and updated at random: on 2 MiB pages, not 4 KiB ones, in
        # every process (distemb/pages.py)
        back_with_huge_pages(arr)
        self._cols[name] = arr
        self._shapes[name] = (tuple(row_shape), dtype_name(arr))

    def slots(self, keys, insert=False):
        keys = keys_array(keys)
        if keys.size:
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
        self._cols.pop(name, None)
        self._shapes.pop(name, None)

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

    def export(self):
        # every key is its own slot: the columns are already in key order
        return self.keys(), {name: self.decode(arr) if name == WEIGHT else np.array(arr)
                             for name, arr in self._cols.items()}

    def close(self):
        self.flush()
        self._cols = {}
        self.closed = True
