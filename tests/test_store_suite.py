"""The RowStore suite: every test runs on every store (dense, hash with the compiled index
and with its dict twin, file-backed), through the RowStore interface only.

The ``store`` fixture gives a factory ``make(num_rows, dim, init=None)`` and ``key_of``,
the key each store uses for oracle row i: row i itself for the dense stores, an
arbitrary int64 (negative and huge ones included) for the hash store, so the same
oracle checks that keys, not slots, address rows. The whole suite runs again under
``DISTEMB_NO_EXT=1`` on the kernels' numpy twins.

What every kind of table does through a client (rows round-trip with the last duplicate
winning, every update rule against torch.optim, on every placement) is the client suite's
(tests/test_kvclient_suite.py, over the same stores); this suite keeps what only the
RowStore interface has: columns, initialisers per key, export/import into a fresh store,
sizes, and its own errors.
"""
import os

import numpy as np
import pytest

from distemb import kernels
from distemb.kernels import half
from distemb.errors import MissingKeyError, StoreError
from distemb.stores import DenseStore, FileStore, HashStore, RowStore, key_normal

KINDS = ["dense", "hash", "hash_twin", "file", "dense_bf16", "hash_bf16", "file_fp16"]
#: Half-precision stores: weights rounded to nearest-even on every store, so comparisons
#: with float32 oracles use this relative tolerance (and exact ones round the oracle).
HALF_RTOL = {"bfloat16": 3e-2, "float16": 4e-3}


class StoreFactory:
    def __init__(self, kind, tmp_path):
        self.kind, self.tmp_path, self.made = kind, tmp_path, []
        self.dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(kind.split("_")[-1],
                                                                 "float32")
        rng = np.random.default_rng(123)
        self._hash_keys = np.unique(np.concatenate([
            rng.integers(-2 ** 62, 2 ** 62, 4000), [0, -1, 2 ** 63 - 1]]))
        rng.shuffle(self._hash_keys)

    def key_of(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        return self._hash_keys[rows] if self.kind.startswith("hash") else rows

    def make(self, num_rows, dim, init=None):
        if self.kind.startswith("dense"):
            s = DenseStore(num_rows, dim, init=init, dtype=self.dtype)
        elif self.kind.startswith("file"):
            s = FileStore(os.path.join(self.tmp_path, f"fs{len(self.made)}"), num_rows, dim,
                          init=init, dtype=self.dtype)
        else:
            # the dense stores hold rows 0..N-1 from the start; the hash store gets its keys
            # on first use, with the init of the key the oracle row maps to
            key_init = None if init is None else (lambda k: init(self._row_of(k)))
            s = HashStore(dim, init=key_init, native=(self.kind != "hash_twin"),
                          dtype=self.dtype)
        self.made.append(s)
        return s

    def rounded(self, rows):
        """float32 ``rows`` as this store keeps them (rounded to its weight dtype)."""
        return rows if self.dtype == "float32" else half.decode(half.encode(rows, self.dtype))

    def _row_of(self, keys):
        order = np.argsort(self._hash_keys)
        return order[np.searchsorted(self._hash_keys, keys, sorter=order)]


@pytest.fixture(params=KINDS)
def store(request, tmp_path):
    if request.param in ("hash", "hash_bf16") and not kernels.HAS_EXT:
        pytest.skip("compiled hash index not loaded (DISTEMB_NO_EXT set or not built)")
    factory = StoreFactory(request.param, tmp_path)
    yield factory
    for s in factory.made:
        s.close()


def test_is_a_row_store_with_a_weight_column(store):
    s = store.make(10, 3)
    assert isinstance(s, RowStore)
    assert s.columns()["weight"] == ((3,), store.dtype) and s.dim == 3
    assert s.dtype == store.dtype and s.ops is (kernels if store.dtype == "float32" else half)


def test_initial_rows_come_from_init_per_key(store):
    init = key_normal(5, seed=3)
    s = store.make(50, 5, init=init)
    rows = np.array([49, 0, 7, 7])
    np.testing.assert_array_equal(s.gather(store.key_of(rows)), store.rounded(init(rows)))


def test_columns_add_fill_keep_and_drop(store):
    s = store.make(8, 2)
    s.add_column("sum", (2,), "float32", fill=0.5)
    s.add_column("step", (), "int64")
    keys = store.key_of([1, 6])
    np.testing.assert_array_equal(s.gather(keys, "sum"), np.full((2, 2), 0.5, np.float32))
    s.scatter(keys, np.array([4, 9]), "step")
    s.add_column("step", (), "int64", keep=True)  # same shape: kept
    assert s.gather(keys, "step").tolist() == [4, 9]
    s.add_column("step", (), "int64")  # replaced
    assert s.gather(keys, "step").tolist() == [0, 0]
    s.drop_column("sum")
    assert list(s.columns()) == ["weight", "step"]
    with pytest.raises(StoreError, match="no column 'sum'"):
        s.column("sum")
    with pytest.raises(StoreError, match="weight"):
        s.drop_column("weight")


def test_export_import_round_trip_into_a_fresh_store(store):
    s = store.make(30, 3, init=key_normal(3, seed=9))
    s.add_column("sum", (3,), "float32")
    keys = store.key_of([2, 29, 11])
    s.gather(keys)  # the hash store holds only keys it has seen
    s.scatter(keys, np.ones((3, 3), np.float32) * 7, "sum")
    exported_keys, cols = s.export()
    assert sorted(cols) == ["sum", "weight"] and len(exported_keys) == s.size()
    assert np.all(np.diff(exported_keys) > 0)
    t = store.make(30, 3)
    t.add_column("sum", (3,), "float32")
    t.import_(exported_keys, cols)
    for name in ("weight", "sum"):
        np.testing.assert_array_equal(t.gather(keys, name), s.gather(keys, name))
    with pytest.raises(StoreError, match="no column 'nope'"):
        t.import_(exported_keys, {"nope": cols["sum"]})


def test_size_keys_nbytes(store):
    s = store.make(12, 2)
    s.gather(store.key_of([4, 4, 9]))
    assert set(store.key_of([4, 9]).tolist()) <= set(s.keys().tolist())
    row_bytes = 2 * (4 if store.dtype == "float32" else 2)
    assert s.size() == len(s.keys()) and s.nbytes() >= s.size() * row_bytes


def test_bad_keys_raise_clear_errors(store):
    s = store.make(10, 2)
    with pytest.raises(TypeError, match="keys: expected integer keys"):
        s.gather(np.array([1.5]))
    if store.kind.startswith("hash"):
        with pytest.raises(MissingKeyError, match="not in the store"):
            s.gather(store.key_of([3]), insert=False)
    else:
        with pytest.raises(StoreError, match="key 10 is out of range"):
            s.gather(np.array([10]))
        with pytest.raises(StoreError, match="fixed keys"):
            s.remove(np.array([1]))
    with pytest.raises(StoreError, match="values: expected shape"):
        s.scatter(store.key_of([1]), np.ones((1, 3), np.float32))


def test_a_refused_scatter_inserts_no_key(store):
    """Issue 18: values of the wrong shape used to be refused after their keys were
    inserted (a hash store grew by keys with initial rows)."""
    s = store.make(10, 2)
    s.scatter(store.key_of([1]), np.ones((1, 2), np.float32))
    keys, size = s.keys().copy(), s.size()
    with pytest.raises(StoreError, match="values: expected shape"):
        s.scatter(store.key_of([4, 5]), np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(s.keys(), keys)
    assert s.size() == size
