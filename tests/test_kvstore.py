"""KVServer and the embedded LocalKVClient through the KVClient interface."""
import numpy as np
import pytest

from distemb.errors import KVStoreError
from distemb.kvstore import KVServer, LocalKVClient
from distemb.partition import HashPartitionBook, NodePartitionPolicy, range_policy
from distemb.rules import RULES, state_name

POLICIES = {
    "one-part": lambda n: range_policy(n, 1),
    "range-3": lambda n: range_policy(n, 3),
    "hash-2": lambda n: NodePartitionPolicy(HashPartitionBook(2, node_counts={"_N": n})),
}


@pytest.fixture(params=sorted(POLICIES))
def policy(request):
    return POLICIES[request.param](20)


@pytest.fixture
def client():
    c = LocalKVClient(num_threads=2)
    yield c
    c.close()


def test_init_pull_push(client, policy):
    client.init_data("t", (20, 3), "float32", policy,
                     lambda shape, dtype: np.full(shape, 7, dtype))
    ids = np.array([19, 0, 5, 5], dtype=np.int64)
    assert (client.pull("t", ids) == 7).all()
    client.push("t", np.array([5, 19]), np.array([[1, 2, 3], [4, 5, 6]], np.float32))
    assert client.pull("t", ids).tolist() == [[4, 5, 6], [7, 7, 7], [1, 2, 3], [1, 2, 3]]
    meta = client.data_meta("t")
    assert meta.shape == (20, 3) and meta.dtype == "float32" and meta.policy is policy
    assert client.names() == ["t"]


def test_integer_tensors(client, policy):
    client.init_data("labels", (20,), "int64", policy)
    client.push("labels", np.arange(20), np.arange(20) * 10)
    assert client.pull("labels", np.array([3, 17])).tolist() == [30, 170]


def test_errors(client, policy):
    client.init_data("t", (20, 2), "float32", policy)
    with pytest.raises(KVStoreError, match="already exists"):
        client.init_data("t", (20, 2), "float32", policy)
    with pytest.raises(KVStoreError, match="'nope' is not in the KVStore"):
        client.pull("nope", np.array([0]))
    with pytest.raises(KVStoreError, match="returned shape"):
        client.init_data("u", (20, 2), "float32", policy, lambda s, d: np.zeros((1, 1), d))
    client.delete_data("t")
    assert client.data_meta("t") is None


@pytest.mark.parametrize("rule", sorted(RULES))
def test_optimizer_state_lives_beside_rows(client, policy, rule):
    client.init_data("w", (20, 4), "float32", policy)
    names = client.init_optimizer("w", rule, {"initial_accumulator_value": 0.5})
    assert set(names) == {s.name for s in RULES[rule].states}
    for sname, kvname in names.items():
        assert kvname == state_name("w", sname) and client.data_meta(kvname).shape[0] == 20
    hyper = {"lr": 0.1, "clr": 0.1, "eps": 1e-10, "beta1": 0.9, "beta2": 0.999, "step": 1}
    client.push_update("w", np.array([2, 11]), np.ones((2, 4), np.float32), rule, hyper)
    w = client.pull("w", np.arange(20))
    assert (w[[2, 11]] < 0).all() and (np.delete(w, [2, 11], axis=0) == 0).all()


def test_server_rejects_unknown_rule_and_shard():
    srv = KVServer()
    srv.create("w", 0, np.zeros((2, 2), np.float32))
    with pytest.raises(KVStoreError, match="rule: expected one of"):
        srv.update("w", 0, np.array([0]), np.ones((1, 2), np.float32), "lion", {})
    with pytest.raises(KVStoreError, match="no shard 1 of 'w'"):
        srv.pull("w", 1, np.array([0]))
    with pytest.raises(KVStoreError, match="already exists"):
        srv.create("w", 0, np.zeros((2, 2), np.float32))
