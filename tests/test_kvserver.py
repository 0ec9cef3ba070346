"""KVServer on its own: shard ownership and request errors (clients: test_kvclient_suite)."""
import numpy as np
import pytest

from distemb.errors import KVStoreError
from distemb.kvstore import KVServer
from distemb.rules import SGDHyper


def test_server_pull_push_update_in_place():
    srv = KVServer(num_threads=2)
    w = np.zeros((4, 2), np.float32)
    srv.create("w", 0, w)
    srv.push("w", 0, np.array([3]), np.ones((1, 2), np.float32))
    srv.update("w", 0, np.array([3]), np.ones((1, 2), np.float32), "sgd", SGDHyper(lr=0.5))
    assert w[3].tolist() == [0.5, 0.5], "the server must update its shard in place"
    assert srv.pull("w", 0, np.array([3, 0])).tolist() == [[0.5, 0.5], [0, 0]]
    srv.drop("w")
    assert not srv.has("w", 0)


def test_server_rejects_unknown_rule_and_shard():
    srv = KVServer()
    srv.create("w", 0, np.zeros((2, 2), np.float32))
    with pytest.raises(KVStoreError, match="rule: expected one of"):
        srv.update("w", 0, np.array([0]), np.ones((1, 2), np.float32), "lion", SGDHyper(lr=0.5))
    with pytest.raises(KVStoreError, match="no shard 1 of 'w'"):
        srv.pull("w", 1, np.array([0]))
    with pytest.raises(KVStoreError, match="already exists"):
        srv.create("w", 0, np.zeros((2, 2), np.float32))
