"""The KVClient suite: every test runs on LocalKVClient and on RemoteKVClient (tcp, tcp+shm).

The ``client`` fixture (tests/conftest.py) supplies each implementation; the tests use
only the KVClient interface, so any difference between embedded and remote is a bug.
"""
import numpy as np
import pytest
import torch

from distemb.context import DistContext
from distemb.embedding import DistEmbedding
from distemb.errors import KVStoreError
from distemb.kernels import reference
from distemb.optim import SparseAdagrad, SparseAdam
from distemb.partition import HashPartitionBook, PartitionPolicy, range_policy
from distemb.rules import RULES, AdagradHyper, FtrlHyper, SGDHyper, rule_of, state_name

pytestmark = pytest.mark.timeout(60)


def policies():
    return {"range1": range_policy(11), "range2": range_policy(11, 2),
            "hash3": PartitionPolicy("node", "_N", HashPartitionBook(3, node_counts={"_N": 11}))}


@pytest.mark.parametrize("pol", ["range1", "range2", "hash3"])
def test_init_zeros_then_push_pull_round_trip(client, pol):
    policy = policies()[pol]
    client.init_data("t", (11, 3), "float32", policy)
    ids = np.array([10, 0, 5, 3], dtype=np.int64)
    assert client.pull("t", ids).tolist() == [[0.0] * 3] * 4
    vals = np.arange(12, dtype=np.float32).reshape(4, 3)
    client.push("t", ids, vals)
    np.testing.assert_array_equal(client.pull("t", ids), vals)
    np.testing.assert_array_equal(client.pull("t", ids[::-1]), vals[::-1])
    assert client.pull("t", np.array([1], dtype=np.int64)).tolist() == [[0.0] * 3]


def test_init_func_fills_each_shard_with_its_shape(client):
    shapes = []

    def init(shape, dtype):
        shapes.append(shape)
        return np.full(shape, float(len(shapes)), dtype=dtype)

    client.init_data("t", (10, 2), "float32", range_policy(10, 2), init)
    assert sorted(shapes) == [(5, 2), (5, 2)]
    got = client.pull("t", np.arange(10, dtype=np.int64))
    assert sorted(set(got[:, 0].tolist())) == [1.0, 2.0]
    assert len(set(got[:5, 0].tolist())) == 1 and len(set(got[5:, 0].tolist())) == 1


def test_meta_names_and_delete(client):
    policy = range_policy(6, 2)
    client.init_data("a", (6, 4), "float32", policy)
    client.init_data("b", (6,), "int64", policy)
    meta = client.data_meta("a")
    assert (meta.shape, meta.dtype, meta.policy) == ((6, 4), "float32", policy)
    assert sorted(client.names()) == ["a", "b"]
    client.delete_data("a")
    assert client.names() == ["b"] and client.data_meta("a") is None


def test_one_dim_int_table(client):
    client.init_data("n", (7,), "int64", range_policy(7, 2))
    client.push("n", np.array([6, 1], dtype=np.int64), np.array([-3, 9], dtype=np.int64))
    out = client.pull("n", np.array([1, 6, 0], dtype=np.int64))
    assert out.dtype == np.int64 and out.tolist() == [9, -3, 0]


def test_empty_pull(client):
    client.init_data("t", (4, 2), "float32", range_policy(4, 2))
    assert client.pull("t", np.array([], dtype=np.int64)).shape == (0, 2)


def test_duplicate_name_and_unknown_name_raise(client):
    client.init_data("t", (4, 2), "float32", range_policy(4))
    with pytest.raises(KVStoreError, match="already exists"):
        client.init_data("t", (4, 2), "float32", range_policy(4))
    with pytest.raises(KVStoreError, match="'nope' is not in the KVStore"):
        client.pull("nope", np.array([0], dtype=np.int64))


@pytest.mark.parametrize("rule,hyper", [
    ("sgd", SGDHyper(lr=0.5)),
    ("adagrad", AdagradHyper(clr=0.1, eps=1e-10)),
    ("ftrl", FtrlHyper(lr=0.1, lr_power=-0.5, l1=0.05, l2=0.01, l2_shrinkage=0.02, beta=0.1)),
])
def test_push_update_matches_reference_rule(client, rule, hyper):
    n, d = 9, 4
    rng = np.random.default_rng(0)
    init = rng.standard_normal((n, d)).astype(np.float32)
    client.init_data("w", (n, d), "float32", range_policy(n, 2))
    client.push("w", np.arange(n, dtype=np.int64), init)
    names = client.init_optimizer("w", rule, {"initial_accumulator_value": 0.0})
    weight, state, linear = init.copy(), np.zeros((n, d), np.float32), np.zeros((n, d), np.float32)
    for _ in range(5):
        ids = np.unique(rng.integers(0, n, 6)).astype(np.int64)
        grads = rng.standard_normal((len(ids), d)).astype(np.float32)
        client.push_update("w", ids, grads, rule, hyper)
        if rule == "sgd":
            reference.sgd_update(weight, ids, grads, hyper.lr)
        elif rule == "ftrl":
            reference.ftrl_update(weight, state, linear, ids, grads, *hyper.fields().values())
        else:
            reference.adagrad_update(weight, state, ids, grads, hyper.clr, hyper.eps)
    all_ids = np.arange(n, dtype=np.int64)
    np.testing.assert_allclose(client.pull("w", all_ids), weight, rtol=1e-5, atol=1e-6)
    if rule == "adagrad":
        np.testing.assert_allclose(client.pull(names["sum"], all_ids), state, rtol=1e-5)
    if rule == "ftrl":
        np.testing.assert_allclose(client.pull(names["accum"], all_ids), state, rtol=1e-5)
        np.testing.assert_allclose(client.pull(names["linear"], all_ids), linear, rtol=1e-5,
                                   atol=1e-6)


def test_new_optimizer_starts_from_fresh_state(client):
    client.init_data("w", (4, 2), "float32", range_policy(4, 2))
    names = client.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.0})
    client.push_update("w", np.array([1], dtype=np.int64), np.ones((1, 2), np.float32),
                       "adagrad", AdagradHyper(clr=0.1, eps=1e-10))
    assert client.pull(names["sum"], np.array([1], dtype=np.int64)).tolist() == [[1.0, 1.0]]
    client.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.5})
    assert client.pull(names["sum"], np.array([1], dtype=np.int64)).tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_dist_embedding_training_matches_torch(client, opt):
    """Whole stack on this client: DistEmbedding + sparse optimizer vs the torch oracle."""
    ctx = DistContext(client, backend="pytorch", num_threads=1)
    n, d = 20, 5
    init = torch.randn(n, d, generator=torch.Generator().manual_seed(1))
    emb = DistEmbedding(n, d, name="emb", part_policy=range_policy(n, 2), context=ctx)
    emb.weight[torch.arange(n)] = init
    ref = torch.nn.Embedding(n, d, sparse=True)
    ref.weight.data.copy_(init)
    if opt == "adagrad":
        mine, theirs = SparseAdagrad([emb], lr=0.1), torch.optim.Adagrad(ref.parameters(), 0.1)
    else:
        mine, theirs = SparseAdam([emb], lr=0.05), torch.optim.SparseAdam(ref.parameters(), 0.05)
    gen = torch.Generator().manual_seed(2)
    for _ in range(8):
        ids = torch.randint(0, n, (12,), generator=gen)  # duplicate-heavy
        for model, o in ((emb, mine), (ref, theirs)):
            o.zero_grad()
            (model(ids) ** 2).sum().backward()
            o.step()
    all_ids = torch.arange(n)
    torch.testing.assert_close(emb.weight[all_ids], ref.weight.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_optimizer_state_lives_beside_rows(client, rule):
    client.init_data("w", (20, 4), "float32", range_policy(20, 2))
    names = client.init_optimizer("w", rule, {"initial_accumulator_value": 0.5})
    assert set(names) == {s.name for s in RULES[rule].states}
    for sname, kvname in names.items():
        assert kvname == state_name("w", sname) and client.data_meta(kvname).shape[0] == 20
    hyper = rule_of(rule).hyper_from({k: v for k, v in {
        "lr": 0.1, "clr": 0.1, "eps": 1e-10, "beta1": 0.9, "beta2": 0.999, "step": 1,
        "lr_power": -0.5, "l1": 0.0, "l2": 0.0, "l2_shrinkage": 0.0, "beta": 0.0}.items()
        if k in rule_of(rule).hyper_type.__dataclass_fields__})
    client.push_update("w", np.array([2, 11]), np.ones((2, 4), np.float32), rule, hyper)
    w = client.pull("w", np.arange(20))
    assert (w[[2, 11]] < 0).all() and (np.delete(w, [2, 11], axis=0) == 0).all()


def test_row_store_tables_work_or_are_refused_by_name(client, request):
    """Every placement either holds row-store (hash-keyed) tables or refuses them with
    an error naming itself: never a silent bypass. Which do what is the capability table
    in docs/stores.md: the host clients and the trainer caches hold them; GPU placements
    refuse them."""
    from conftest import HostView
    from distemb.stores.spec import HashTableSpec

    kind = request.node.callspec.params["client"]
    real = client.inner if isinstance(client, HostView) else client
    refuses = "device" in kind
    if refuses:
        with pytest.raises(KVStoreError, match=rf"{type(real).__name__}: tables on row "
                                               r"stores .* cannot be placed|row stores"):
            real.store_client()
        return
    stores = real.store_client()
    assert stores is real.store_client()  # one per client: a name is one table
    spec = HashTableSpec(2)
    if getattr(getattr(real, "config", None), "fraction", None) is not None:
        # a cache sized as a share of a table's rows cannot size one without bound
        with pytest.raises(KVStoreError, match="'fraction' is a share .* without bound"):
            stores.create_table("rs", spec)
        assert "rs" not in stores.names()
        spec = HashTableSpec(2, capacity=100)
    stores.create_table("rs", spec)
    try:
        assert stores.pull("rs", np.array([2 ** 40, -1, 2 ** 40])).shape == (3, 2)
        assert stores.size("rs") == 2
    finally:
        stores.delete_data("rs")


@pytest.mark.parametrize("ids", [[3, 7, 19], [19, 3, 7], [7, 3, 7, 19, 3]],
                         ids=["ascending-unique", "unique-unsorted", "duplicates"])
def test_coalesce_sums_each_ids_gradient_whatever_the_order(client, ids):
    """The oracle is torch's coalesce of the sparse gradient. One lookup of ascending
    unique ids (a fused loss's rows) is already coalesced: it must come back as it is,
    without the sort, and equal the oracle as the other orders do."""
    from distemb.backend import pytorch as F

    client.init_data("co", (20, 4), "float32", range_policy(20, client.num_servers))
    grads = torch.arange(len(ids) * 4, dtype=torch.float32).reshape(-1, 4) - 5
    flat, _ = client.ids_in("co", torch.tensor(ids), F)
    got = client.coalesce("co", [flat], [grads], F)
    want = torch.sparse_coo_tensor(torch.tensor([ids]), grads, (20, 4)).coalesce()
    np.testing.assert_array_equal(np.asarray(client.to_host(got[0])),
                                  want.indices()[0].numpy())
    np.testing.assert_array_equal(np.asarray(client.to_host(got[1])), want.values().numpy())
    client.delete_data("co")
