"""One table class for every storage (issue 21, item 5): the oracle is the dense
DistEmbedding (itself tested against torch.optim).

``DistEmbedding(None or N, dim, storage=...)`` over each storage (a hash table, a file
table spec, a dense or a file store object) trains as the dense table bit for bit; a
dense table's key management, the storage arguments checked by name, slices of
``weight``, a store object backing one table, and ``export``/``import_`` of the states
given. (Split from tests/test_dynamic_embedding.py, whose sizes it shares; the twin
pass runs it as that module: tests/conftest.py's ``TWIN_MODULES``.)
"""
import numpy as np
import pytest
import torch

from distemb.embedding import DistEmbedding
from distemb.dynamic import DynamicEmbedding
from distemb.errors import StoreError
from distemb.optim import SparseAdagrad
from distemb.stores import key_normal
from tests.conftest import zipf_ids
from tests.test_dynamic_embedding import BATCH, DIM, ROWS


# --- one table class for every storage (issue 21, item 5) -------------------------------

def _dense_init(shape, dtype):
    return torch.from_numpy(key_normal(DIM, seed=11)(np.arange(shape[0])))


@pytest.mark.parametrize("storage", ["hash", "file spec", "dense store", "file store"])
def test_one_table_class_trains_every_storage_as_the_dense_table(ctx, tmp_path, storage):
    """DistEmbedding(None or N, dim, storage=...) over each storage equals the dense
    DistEmbedding (itself tested against torch.optim) bit for bit on zipf ids."""
    from distemb.stores import DenseStore, FileStore
    from distemb.stores.spec import FileTableSpec

    init = key_normal(DIM, seed=11)
    table = {
        "hash": lambda: DistEmbedding(None, DIM, name="t", context=ctx, init_func=init),
        "file spec": lambda: DistEmbedding(ROWS, DIM, name="t", context=ctx, storage=(
            FileTableSpec(str(tmp_path / "spec"), ROWS, DIM, init=init, preallocate=False))),
        "dense store": lambda: DistEmbedding(ROWS, DIM, name="t", context=ctx,
                                             storage=DenseStore(ROWS, DIM, init=init)),
        "file store": lambda: DistEmbedding(None, DIM, name="t", context=ctx, storage=(
            FileStore(tmp_path / "store", ROWS, DIM, init=init, preallocate=False))),
    }[storage]()
    dense = DistEmbedding(ROWS, DIM, name="dense", context=ctx, init_func=_dense_init)
    assert type(table) is DistEmbedding and table.part_policy is None
    opts = [SparseAdagrad([table], lr=0.1), SparseAdagrad([dense], lr=0.1)]
    rng = np.random.default_rng(3)
    for _ in range(20):
        ids = torch.from_numpy(zipf_ids(rng, ROWS, BATCH))
        for emb, opt in zip((table, dense), opts):
            (emb(ids) * torch.linspace(-1, 1, DIM)).sum().backward()
            opt.step()
    every = torch.arange(ROWS)
    assert torch.equal(table.get(every), dense.get(every))
    assert not torch.equal(dense.get(every), _dense_init((ROWS, DIM), None))
    got, want = table.export(), dense.export()
    assert sorted(got) == sorted(want) == ["keys", "sum", "weight"]
    assert np.array_equal(got["sum"][np.searchsorted(got["keys"], want["keys"])], want["sum"])


def test_a_dense_table_answers_key_management_or_refuses_by_name(ctx):
    emb = DistEmbedding(10, 2, name="dense-keys", context=ctx)
    opt = SparseAdagrad([emb], lr=0.5)
    emb(torch.tensor([3, 3, 9])).sum().backward()
    opt.step()
    assert emb.size() == emb.capacity == 10
    assert emb.contains(torch.tensor([0, 9, 10, -1])).tolist() == [True, True, False, False]
    emb.upsert(torch.tensor([4]), torch.full((1, 2), 7.0))
    assert emb.get(torch.tensor([4])).tolist() == [[7.0, 7.0]]
    data = emb.export()
    assert data["keys"].tolist() == list(range(10)) and sorted(data) == ["keys", "sum",
                                                                          "weight"]
    assert data["sum"][3].tolist() == [4.0, 4.0] and data["sum"][9].tolist() == [1.0, 1.0]
    copy = DistEmbedding(10, 2, name="dense-copy", context=ctx)
    with pytest.raises(StoreError, match=r"'sum'.*create the optimizer first"):
        copy.import_(data)
    SparseAdagrad([copy], lr=0.5)
    copy.import_(data)
    for col in ("weight", "sum"):
        assert np.array_equal(copy.export()[col], data[col])
    with pytest.raises(StoreError, match="fixed keys 0..9"):
        emb.remove(torch.tensor([1]))
    with pytest.raises(StoreError, match="fixed keys 0..9"):
        emb.evict(5)
    assert emb.store.fixed_keys and emb.store.size() == 10  # one shard: its DenseStore
    from distemb.partition import range_policy
    sharded = DistEmbedding(10, 2, name="two-parts", part_policy=range_policy(10, 2),
                            context=ctx)
    with pytest.raises(AttributeError, match="2 shards"):
        sharded.store


def test_storage_arguments_are_checked_by_name(ctx, tmp_path):
    from distemb.partition import range_policy
    from distemb.stores import DenseStore
    from distemb.stores.spec import FileTableSpec, HashTableSpec

    with pytest.raises(ValueError, match="part_policy: a hash store takes no partition policy"):
        DistEmbedding(None, 2, context=ctx, part_policy=range_policy(4))
    with pytest.raises(ValueError, match="device: a GPU holds dense and hash tables; a "
                                         "file table's rows live in host memory"):
        DistEmbedding(None, 2, context=ctx, device="cuda",
                      storage=FileTableSpec(str(tmp_path), 4, 2, preallocate=False))
    with pytest.raises(ValueError, match="device: a GPU holds dense and hash tables; a "
                                         "DenseStore table"):
        DistEmbedding(None, 2, context=ctx, device="cuda", storage=DenseStore(4, 2))
    with pytest.raises(ValueError, match="storage: holds rows of dim 3, embedding_dim is 2"):
        DistEmbedding(None, 2, context=ctx, storage=DenseStore(4, 3))
    with pytest.raises(ValueError, match=r"num_embeddings: the storage holds the keys "
                                         r"0\.\.3; expected 4, got 5"):
        DistEmbedding(5, 2, context=ctx, storage=DenseStore(4, 2))
    with pytest.raises(ValueError, match="num_embeddings: the storage holds any int64 key"):
        DistEmbedding(5, 2, context=ctx, storage=HashTableSpec(2))
    with pytest.raises(ValueError, match="init_func: a table on a given storage"):
        DistEmbedding(None, 2, context=ctx, storage=HashTableSpec(2),
                      init_func=key_normal(2))
    with pytest.raises(ValueError, match="dtype: the storage holds float32 rows"):
        DistEmbedding(None, 2, context=ctx, storage=FileTableSpec(
            str(tmp_path), 4, 2, preallocate=False), dtype="bfloat16")
    with pytest.raises(TypeError, match="storage: expected a RowStore, or a table spec"):
        DistEmbedding(None, 2, context=ctx, storage="hash")


@pytest.mark.parametrize("storage", ["file spec", "dense store", "hash"])
def test_a_slice_of_weight_selects_the_fixed_keys_and_is_refused_for_a_hash_table(ctx,
                                                                                 tmp_path,
                                                                                 storage):
    """``weight[a:b]`` on a table of the fixed keys 0..N-1 is the rows a..b-1, as a dense
    table's DistTensor takes it (it failed with 'expected integer keys ... dtype=object');
    a hash table's keys are not a range: refused, saying to pass the keys."""
    from distemb.stores import DenseStore
    from distemb.stores.spec import FileTableSpec

    emb = {"file spec": lambda: DistEmbedding(None, 2, name="s", context=ctx, storage=(
               FileTableSpec(str(tmp_path), 10, 2, preallocate=False))),
           "dense store": lambda: DistEmbedding(None, 2, name="s", context=ctx,
                                                storage=DenseStore(10, 2)),
           "hash": lambda: DynamicEmbedding(2, name="s", context=ctx)}[storage]()
    if storage == "hash":
        for use in (lambda: emb.weight[0:3],
                    lambda: emb.weight.__setitem__(slice(0, 3), torch.ones(3, 2))):
            with pytest.raises(TypeError, match=r"ids: 's' is a hash table, whose keys are not "
                                                r"a range: a slice selects nothing; pass the "
                                                r"keys \(an integer tensor\), got slice\(0, 3"):
                use()
        assert emb.size() == 0
        return
    dense = DistEmbedding(10, 2, name="dense", context=ctx)
    rows = torch.arange(6.0).view(3, 2)
    for table in (emb, dense):
        table.weight[2:5] = rows
        table.weight[8:] = rows[:2] + 10
    for sl in (slice(0, 10), slice(2, 5), slice(None, None, 3), slice(-2, None)):
        assert torch.equal(emb.weight[sl], dense.weight[sl]), sl
    assert torch.equal(emb.weight[2:5], rows)


@pytest.mark.parametrize("kind", ["hash", "dense", "file"])
def test_a_store_object_backs_one_table_and_a_closed_one_none(ctx, tmp_path, kind):
    """"The table owns it now": a second table on the same store object shared its rows
    and optimizer-state columns (closing one table left the other on a closed store),
    and a closed store was taken; both refused where a store becomes a table, naming the
    table that holds it."""
    from distemb.dynamic import StoreEmbedding
    from distemb.stores import DenseStore, FileStore, HashStore

    def make(i):
        return {"hash": lambda: HashStore(2), "dense": lambda: DenseStore(4, 2),
                "file": lambda: FileStore(tmp_path / str(i), num_rows=4, dim=2)}[kind]()

    store = make(0)
    a = StoreEmbedding(store, name="a", context=ctx)
    cls = type(store).__name__
    with pytest.raises(StoreError, match=rf"store: the {cls} given to table 'b' already "
                                         rf"holds table 'a' \(a store backs one table"):
        StoreEmbedding(store, name="b", context=ctx)
    assert ctx.client.names() == ["a"]
    a.upsert(torch.tensor([1]), torch.ones(1, 2))  # a's own, untouched by the refusal
    assert a.get(torch.tensor([1])).tolist() == [[1.0, 1.0]]
    a.close()
    closed = make(1)
    closed.close()
    for s in (store, closed):  # closed with its table, or by its user
        assert s.closed
        with pytest.raises(StoreError, match=rf"store: the {cls} given to table 'c' is "
                                             r"closed"):
            StoreEmbedding(s, name="c", context=ctx)
    assert ctx.client.names() == []


def test_closing_one_store_table_leaves_the_others(ctx, tmp_path):
    from distemb.dynamic import StoreEmbedding
    from distemb.stores import FileStore

    a = StoreEmbedding(FileStore(tmp_path / "a", 4, 2), name="a", context=ctx)
    b = StoreEmbedding(FileStore(tmp_path / "b", 4, 2), name="b", context=ctx)
    a.upsert(torch.tensor([1]), torch.ones(1, 2))
    a.close()  # flushed, unlocked, gone from the context
    b.upsert(torch.tensor([2]), torch.ones(1, 2))
    assert b.get(torch.tensor([2])).tolist() == [[1.0, 1.0]]
    assert FileStore(tmp_path / "a").gather(np.array([1])).tolist() == [[1.0, 1.0]]


def test_a_tables_export_and_import_take_the_states_they_are_given(ctx):
    """``weight.export(states)`` gives the weight and the states named, and
    ``weight.import_(keys, columns, states)`` refuses a column it was not given, for every
    table (a table on row stores exported every column and imported any, whatever
    ``states`` said)."""
    for emb in (DynamicEmbedding(2, name="ex-hash", context=ctx),
                DistEmbedding(10, 2, name="ex-dense", context=ctx)):
        opt = SparseAdagrad([emb], lr=0.1)
        emb(torch.tensor([1, 3])).sum().backward()
        opt.step()
        keys, cols = emb.weight.export({})
        assert sorted(cols) == ["weight"], emb.name
        keys, cols = emb.weight.export(emb.optm_state)
        assert sorted(cols) == ["sum", "weight"] and cols["sum"].shape == (len(keys), 2)
        with pytest.raises(StoreError, match=r"\['sum'\] not in table .* create the "
                                             "optimizer first"):
            emb.weight.import_(keys, {"sum": cols["sum"]}, {})
        emb.weight.import_(keys, {"sum": cols["sum"] + 1}, emb.optm_state)
        np.testing.assert_array_equal(emb.weight.export(emb.optm_state)[1]["sum"],
                                      cols["sum"] + 1)
