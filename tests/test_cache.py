"""The trainer cache's own guarantees, against the plain remote client as the oracle.

The KVClient suite runs with caches in front of the remote clients (tests/conftest.py);
these tests cover what the suite cannot see: another writer, staleness bounds, admission,
capacity and configuration errors.
"""
import numpy as np
import pytest

from distemb.config import CacheConfig, parse_cache_config
from distemb.errors import ConfigError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.cache import CachedKVClient
from distemb.partition import range_policy
from distemb.rules import AdagradHyper

pytestmark = [pytest.mark.timeout(60), pytest.mark.multiprocess]

N, D = 40, 4
HYPER = AdagradHyper(clr=0.1, eps=1e-10)


@pytest.fixture
def pair(clusters):
    """A cached client and a plain one (another writer) on the same two servers."""
    cluster = clusters("tcp")
    made = []

    def make(config):
        cached, other = CachedKVClient(cluster.client(), config), cluster.client()
        made.extend([cached, other])
        for kv in (cached, other):  # the second attaches to the first one's table
            kv.init_data("w", (N, D), "float32", range_policy(N, 2))
        cached.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.0})
        other.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.0})
        return cached, other

    yield make
    made[1].delete_data("w")
    for kv in made:
        kv.close(goodbye=False)


def step(kv, ids):
    kv.push_update("w", np.asarray(ids, np.int64), np.ones((len(ids), D), np.float32),
                   "adagrad", HYPER)


def test_exact_cache_sees_another_writer_at_once(pair):
    cached, other = pair(CacheConfig(rows=8))
    cached.pull("w", np.array([1, 2]))
    step(cached, [1, 2])
    before = cached.stats()["hit_rows"]
    np.testing.assert_array_equal(cached.pull("w", np.array([1, 2])),
                                  other.pull("w", np.array([1, 2])))
    assert cached.stats()["hit_rows"] == before + 2  # both replicas confirmed current
    other.push("w", np.array([2]), np.full((1, D), 9.0, np.float32))
    step(other, [1])
    got = cached.pull("w", np.array([1, 2]))
    np.testing.assert_array_equal(got, other.pull("w", np.array([1, 2])))
    assert (got[1] == 9.0).all()


def test_bounded_staleness_serves_rows_at_most_s_steps_old(pair):
    cached, other = pair(CacheConfig(rows=8, staleness=2))
    first = cached.pull("w", np.array([5]))
    other.push("w", np.array([5]), np.full((1, D), 3.0, np.float32))
    np.testing.assert_array_equal(cached.pull("w", np.array([5])), first)  # stale, allowed
    step(cached, [7])
    np.testing.assert_array_equal(cached.pull("w", np.array([5])), first)  # 1 step old
    step(cached, [7])
    assert (cached.pull("w", np.array([5])) == 3.0).all()  # 2 steps: validated again


def test_staleness_keeps_own_updates_and_refetches_rows_others_updated(pair):
    cached, other = pair(CacheConfig(rows=8, staleness=3))
    cached.pull("w", np.array([3]))
    step(cached, [3])
    np.testing.assert_array_equal(cached.pull("w", np.array([3])),
                                  other.pull("w", np.array([3])))  # its own update is in
    step(other, [3])
    step(cached, [3])  # the owner applied both: this replica is marked unknown
    for _ in range(3):
        step(cached, [0])
    np.testing.assert_array_equal(cached.pull("w", np.array([3])),
                                  other.pull("w", np.array([3])))


def test_lfu_admits_rows_seen_more_often_and_fetches_no_state_for_others(pair):
    cached, _ = pair(CacheConfig(policy="lfu", rows=2))
    for _ in range(3):
        cached.pull("w", np.array([0, 1]))  # hot
    bytes0 = cached.stats()["bytes_pulled"]
    cached.pull("w", np.array([10, 11, 12]))  # cold, seen once: passed through
    row_only = 3 * (D * 4 + 8 + 8)  # rows, versions, positions: no Adagrad state
    assert cached.stats()["bytes_pulled"] - bytes0 == row_only
    hits = cached.stats()["hit_rows"]
    cached.pull("w", np.array([0, 1]))
    assert cached.stats()["hit_rows"] == hits + 2  # the hot rows stayed


def test_lru_never_holds_more_than_its_capacity(pair):
    cached, other = pair(CacheConfig(policy="lru", rows=3))
    rng = np.random.default_rng(0)
    for _ in range(10):
        ids = np.unique(rng.integers(0, N, 6))
        np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
        step(cached, ids)
    assert cached.stats()["hit_rows"] > 0


def test_cache_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="exactly one of rows, bytes, fraction"):
        CacheConfig(rows=3, fraction=0.5)
    with pytest.raises(ConfigError, match=r"cache.fraction: must be a number in \(0, 1\]"):
        CacheConfig(fraction=1.5)
    with pytest.raises(ConfigError, match="cache.policy: must be one of"):
        CacheConfig(policy="fifo", rows=3)
    with pytest.raises(ConfigError, match="cache.staleness: must be >= 0"):
        CacheConfig(rows=3, staleness=-1)
    with pytest.raises(ConfigError, match="cache.size: unknown field"):
        parse_cache_config({"size": 3})
    assert CacheConfig(bytes=1000).capacity(100, 40) == 25


def test_cache_needs_a_client_whose_servers_version_rows():
    with pytest.raises(TypeError, match="inner: expected a client whose servers version"):
        CachedKVClient(LocalKVClient(), CacheConfig(rows=3))
