"""DistTensor and DistEmbedding: lookups, traces, naming, and every bad input."""
import re
import warnings

import numpy as np
import pytest
import torch

from distemb.embedding import DistEmbedding
from distemb.errors import KVStoreError, PartitionError, TraceOverflowError
from distemb.partition import range_policy
from distemb.tensor import DistTensor


def test_dist_tensor_pull_push(ctx):
    t = DistTensor((10, 3), torch.float32, name="t", context=ctx,
                   init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
    assert t.shape == (10, 3) and t.dtype == torch.float32 and len(t) == 10
    t[torch.tensor([2, 4])] = torch.zeros(2, 3)
    assert t[torch.tensor([4, 5])].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert t[np.array([[2, 5]])].shape == (1, 2, 3)  # any id shape, like nn.Embedding


def test_dist_tensor_bad_input(ctx):
    t = DistTensor((10, 3), torch.float32, name="t", context=ctx)
    with pytest.raises(PartitionError, match="id 10 is out of range .*0 <= id < 10"):
        t[torch.tensor([1, 10])]
    with pytest.raises(PartitionError, match="id -1 is out of range"):
        t[torch.tensor([-1])]
    with pytest.raises(TypeError, match="ids: expected an integer tensor .* got float32"):
        t[torch.tensor([1.0])]
    with pytest.raises(TypeError, match="values: expected dtype float32 .* got float64"):
        t[torch.tensor([1])] = torch.zeros(1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="values: expected shape \\(2, 3\\)"):
        t[torch.tensor([1, 2])] = torch.zeros(2, 4)
    with pytest.raises(KVStoreError, match="'t' exists with shape \\(10, 3\\).*got shape \\(10, 4\\)"):
        DistTensor((10, 4), torch.float32, name="t", context=ctx)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        DistTensor((10, 3), "complex64", context=ctx)
    with pytest.raises(ValueError, match="shape: expected a non-empty tuple"):
        DistTensor((0, 3), torch.float32, context=ctx)
    # a shape is ints: never truncated (10.9 rows were 10) nor read as digits ("10" was
    # (1, 0)), as DistEmbedding refuses a float num_embeddings
    for shape, bad in (((10.9, 4.7), 10.9), ("10", "10"), ((10, 4.0), 4.0), ((True, 3), True),
                       ((10, None), None), ((np.bool_(True), 3), np.bool_(True)),
                       (10.0, 10.0)):
        said = re.escape(f"got {shape!r} ({type(bad).__name__} {bad!r} is not an int)")
        with pytest.raises(TypeError, match=rf"shape: expected an int or a tuple of ints, {said}"):
            DistTensor(shape, torch.float32, context=ctx)
    assert ctx.client.names() == ["t"]
    for shape in (np.int64(5), (np.int64(5), 2), torch.Size([5, 2]), (torch.tensor(5), 2)):
        assert DistTensor(shape, torch.float32, context=ctx).shape in ((5,), (5, 2))
    with pytest.raises(ValueError, match="part_policy: node~_N has 5 ids, but shape\\[0\\] is 10"):
        DistTensor((10, 3), torch.float32, context=ctx, part_policy=range_policy(5))


@pytest.mark.parametrize("kind", ["dense", "hash"])
def test_upsert_takes_rows_shaped_as_the_ids_and_never_reshapes_others(ctx, kind):
    """``emb.upsert(keys, rows)`` / ``weight[keys] = rows``: rows shaped as the keys +
    (dim,), or one row per key, as torch indexing and DGL's push take them. A transposed
    batch (as many elements) used to be reshaped into scrambled rows; torch refuses it."""
    emb = DistEmbedding(10 if kind == "dense" else None, 4, name="up", context=ctx)
    keys, rows = torch.tensor([1, 2]), torch.arange(8.0).view(2, 4)
    with pytest.raises(RuntimeError):
        torch.zeros(10, 4)[keys] = rows.T  # the oracle refuses it too
    with pytest.raises(ValueError, match=r"values: expected shape \(2, 4\) for 2 ids of "
                                         r"'up', got \(4, 2\)"):
        emb.upsert(keys, rows.T)
    with pytest.raises(ValueError, match=r"values: expected shape \(2, 4\) .* got \(8,\)"):
        emb.weight[keys] = torch.arange(8.0)
    if kind == "hash":
        assert emb.size() == 0  # nothing inserted
    else:
        assert emb.get(keys).tolist() == [[0.0] * 4] * 2  # nothing written
    emb.weight[keys.view(2, 1)] = rows.view(2, 1, 4)  # the keys' shape + the row shape
    assert torch.equal(emb.get(keys), rows)
    emb.weight[keys.view(1, 2)] = rows + 1  # one row per key
    assert torch.equal(emb.weight[keys.view(1, 2)], (rows + 1).view(1, 2, 4))


@pytest.mark.parametrize("make", ["DistTensor", "DistEmbedding", "keyed DistEmbedding",
                                  "DynamicEmbedding", "StoreEmbedding"])
def test_a_name_is_a_non_empty_str_or_none(ctx, make):
    """A name of another type was an AttributeError or TypeError naming neither the
    argument nor what it takes (a tuple was accepted), and "" made an anonymous table
    though only None means one; both refused by name, nothing made."""
    from distemb.dynamic import DynamicEmbedding, StoreEmbedding
    from distemb.stores import HashStore

    table = {"DistTensor": lambda name: DistTensor((10, 4), torch.float32, name=name,
                                                   context=ctx),
             "DistEmbedding": lambda name: DistEmbedding(10, 4, name=name, context=ctx),
             "keyed DistEmbedding": lambda name: DistEmbedding(None, 4, name=name,
                                                               context=ctx),
             "DynamicEmbedding": lambda name: DynamicEmbedding(4, name=name, context=ctx),
             "StoreEmbedding": lambda name: StoreEmbedding(HashStore(4), name=name,
                                                           context=ctx)}[make]
    for name, got in ((5, "int 5"), (("a", "b"), r"tuple \('a', 'b'\)"), (b"t", "bytes b't'")):
        with pytest.raises(TypeError, match=rf"name: expected a str \(or None for an anonymous "
                                            rf"table\), got {got}"):
            table(name)
    with pytest.raises(ValueError, match=r"name: expected a non-empty str \(None for an "
                                         r"anonymous table\), got ''"):
        table("")
    assert ctx.client.names() == []
    assert table(None).name and table("t").name == "t"


def test_a_closed_context_makes_no_table_and_its_tables_say_it_is_closed(tmp_path):
    """A closed context made tables (a file table made there kept its directory locked:
    closing the context again does nothing); every table kind is refused saying the
    context is closed, nothing made, and a table of it used afterwards says so too (it
    said its name was unknown)."""
    from distemb.context import DistContext
    from distemb.dynamic import DynamicEmbedding, StoreEmbedding
    from distemb.errors import DistEmbError
    from distemb.stores.spec import FileTableSpec

    ctx = DistContext.embedded()
    dense = DistEmbedding(10, 2, name="d", context=ctx)
    keyed = DynamicEmbedding(2, name="h", context=ctx)
    ctx.close()
    for make in (lambda: DistTensor((4, 2), torch.float32, name="t", context=ctx),
                 lambda: DistEmbedding(10, 2, name="e", context=ctx),
                 lambda: DistEmbedding(None, 2, name="k", context=ctx),
                 lambda: DynamicEmbedding(2, name="k", context=ctx),
                 lambda: StoreEmbedding(FileTableSpec(str(tmp_path / "f"), 10, 2),
                                        name="f", context=ctx)):
        with pytest.raises(DistEmbError, match=r"context: DistContext\(role='embedded'.*\) "
                                               r"is closed: it makes no tables"):
            make()
    assert not (tmp_path / "f").exists()
    ids = torch.tensor([1])
    for use in (lambda: dense(ids), lambda: dense.weight.__setitem__(ids, torch.ones(1, 2)),
                lambda: keyed(ids), lambda: keyed.size(),
                lambda: keyed.upsert(ids, torch.ones(1, 2))):
        with pytest.raises(KVStoreError, match=r"name '[dh]': this LocalKVClient is closed "
                                               r"\(its context was closed, and its tables "
                                               r"with it\)"):
            use()


def test_same_name_attaches_and_anonymous_is_freed(ctx):
    a = DistTensor((4, 2), torch.float32, name="shared", context=ctx, persistent=True)
    a[torch.tensor([1])] = torch.ones(1, 2)
    b = DistTensor((4, 2), torch.float32, name="shared", context=ctx)
    assert b[torch.tensor([1])].tolist() == [[1, 1]]
    anon = DistTensor((4, 2), torch.float32, context=ctx)
    name = anon.name
    assert ctx.client.data_meta(name) is not None
    del anon
    assert ctx.client.data_meta(name) is None


def test_embedding_properties_and_trace(ctx):
    emb = DistEmbedding(50, 4, name="e", context=ctx)
    assert (emb.num_embeddings, emb.embedding_dim, emb.name) == (50, 4, "e")
    assert emb.weight.shape == (50, 4) and emb.kvstore is ctx.client
    assert emb.part_policy.get_size() == 50 and emb.optm_state is None
    rows = emb(torch.tensor([1, 2], dtype=torch.int32))
    assert rows.requires_grad and len(emb.trace) == 1
    with torch.no_grad():
        emb(torch.tensor([3]))
    assert len(emb.trace) == 1, "lookups under no_grad must not be traced"
    emb.reset_trace()
    assert emb.trace == []


def test_embedding_not_tied_to_graph_size(ctx):
    emb = DistEmbedding(7, 3, context=ctx)
    assert emb.part_policy.get_size() == 7


def test_embedding_bad_input(ctx):
    with pytest.raises(ValueError, match="num_embeddings: expected a positive int, got 0"):
        DistEmbedding(0, 4, context=ctx)
    with pytest.raises(ValueError, match="embedding_dim: expected a positive int, got -1"):
        DistEmbedding(4, -1, context=ctx)
    emb = DistEmbedding(4, 2, context=ctx)
    with pytest.raises(PartitionError, match="out of range"):
        emb(torch.tensor([4]))


def test_forgotten_step_raises_instead_of_leaking(ctx):
    emb = DistEmbedding(10, 2, context=ctx, trace_limit=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            emb(torch.tensor([1]))
    assert any("4 lookups recorded" in str(w.message) for w in caught)
    with pytest.raises(TraceOverflowError, match="without an optimizer step\\(\\) or zero_grad"):
        emb(torch.tensor([1]))


def test_initialize_after_implicit_context_names_the_cause():
    import distemb

    distemb.shutdown()
    try:
        DistTensor((2, 2), torch.float32)  # creates the implicit embedded context
        with pytest.raises(distemb.DistEmbError, match="implicitly, by a table created before"):
            distemb.initialize()
        distemb.shutdown()
        ctx = distemb.initialize()
        with pytest.raises(distemb.DistEmbError, match="by an earlier initialize\\(\\)"):
            distemb.initialize()
        assert distemb.current_context() is ctx
    finally:
        distemb.shutdown()


def test_grouped_lookup_equals_lookups_table_by_table(ctx):
    """grouped_lookup traces each lookup in its table as emb(ids) does, so one optimizer
    step after it equals the step after separate lookups (a table may appear twice)."""
    from distemb import grouped_lookup
    from distemb.dynamic import DynamicEmbedding
    from distemb.optim import SparseAdagrad

    def model(grouped):
        init = lambda s, d: torch.arange(int(np.prod(s)), dtype=d).reshape(s) / 7  # noqa: E731
        a = DistEmbedding(10, 4, name=f"ga{grouped}", context=ctx, init_func=init)
        b = DistEmbedding(6, 2, name=f"gb{grouped}", context=ctx, init_func=init,
                          dtype=torch.bfloat16)
        k = DynamicEmbedding(3, name=f"gk{grouped}", context=ctx)
        opt = SparseAdagrad([a, b, k], lr=0.5)
        pairs = [(a, torch.tensor([[1, 9], [9, 9]])), (b, torch.tensor([5, 0])),
                 (a, torch.tensor([2])), (k, torch.tensor([2**40, -3]))]
        rows = grouped_lookup(pairs) if grouped else [e(i) for e, i in pairs]
        sum((r * (j + 1)).sum() for j, r in enumerate(rows)).backward()
        opt.step()
        return rows, [len(e.trace) for e in (a, b, k)], [
            a.weight[torch.arange(10)], b.weight[torch.arange(6)],
            k.weight[torch.tensor([2**40, -3])]]

    rows_g, traces_g, after_g = model(True)
    rows_s, _, after_s = model(False)
    assert [r.shape for r in rows_g] == [(2, 2, 4), (2, 2), (1, 4), (2, 3)]
    assert all(torch.equal(x, y) for x, y in zip(rows_g, rows_s))
    assert traces_g == [0, 0, 0]  # step() consumed every traced lookup
    assert all(torch.equal(x, y) for x, y in zip(after_g, after_s))
    assert not torch.equal(after_g[0], torch.arange(40).reshape(10, 4) / 7)  # it trained
    with pytest.raises(TypeError, match=r"lookups\[0\]: expected a \(DistEmbedding, ids\)"):
        grouped_lookup([(torch.zeros(2), torch.tensor([1]))])
