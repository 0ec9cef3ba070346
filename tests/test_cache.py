"""The trainer cache's own guarantees, against the plain remote client as the oracle.

The KVClient suite runs with caches in front of the remote clients (tests/conftest.py);
these tests cover what the suite cannot see: another writer, staleness bounds, admission,
capacity and configuration errors.
"""
import json

import numpy as np
import pytest

from distemb.config import CacheConfig, parse_cache_config, parse_cluster_config
from distemb.context import DistContext
from distemb.enums import CachePolicy
from distemb.errors import ConfigError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.caches.trainer import CachedKVClient
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
    row_only = 3 * D * 4  # nothing held or kept: a plain pull, no state, no versions
    assert cached.stats()["bytes_pulled"] - bytes0 == row_only
    cached.pull("w", np.array([0, 13]))  # one held: versioned; 13 passes, without state
    assert cached.stats()["bytes_pulled"] - bytes0 == row_only + D * 4 + 8 + 8
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


@pytest.mark.parametrize("raw,match", [
    ({"rows": 3, "fraction": 0.5}, "cache.rows: give exactly one of rows, bytes, fraction"),
    ({"fraction": 1.5}, r"cache.fraction: must be in \(0, 1\], got 1.5"),
    ({"policy": "fifo", "rows": 3}, "cache.policy: must be one of"),
    ({"rows": 3, "staleness": -1}, "cache.staleness: must be >= 0"),
    ({"rows": 0}, "cache.rows: must be >= 1, got 0"),
    ({"size": 3}, "cache.size: unknown field"),
])
def test_cache_config_errors_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_cache_config(raw)


def test_cache_config_sizes_and_cluster_config_round_trip():
    assert parse_cache_config({"bytes": 1000}).capacity(100, 40) == 25
    assert parse_cache_config({"fraction": 0.1}).capacity(1000, 8) == 100
    raw = {"job_id": "j", "num_trainers": 1, "trainer_machines": [0],
           "servers": [{"host": "127.0.0.1", "port": 30050, "machine": 0}],
           "cache": {"policy": "lfu", "rows": 7, "staleness": 2}}
    cfg = parse_cluster_config(raw)
    assert cfg.cache.policy == "lfu" and cfg.cache.rows == 7
    assert parse_cluster_config(cfg.to_dict()) == cfg


def test_cache_needs_a_client_whose_servers_version_rows():
    with pytest.raises(TypeError, match="inner: expected a client whose servers version"):
        CachedKVClient(LocalKVClient(), CacheConfig(rows=3))


def test_a_cluster_config_with_a_cache_gives_trainers_a_cached_client(clusters, tmp_path):
    """What distemb-launch --cache-* writes: the trainer's context wraps its client."""
    cluster = clusters("tcp")
    path = tmp_path / "cached.json"
    path.write_text(json.dumps(dict(cluster.raw, cache={"policy": "lfu", "rows": 5})))
    ctx = DistContext.trainer(str(path), 0, backend="numpy")
    try:
        assert isinstance(ctx.client, CachedKVClient)
        assert ctx.client.config.policy == CachePolicy.LFU and ctx.client.config.rows == 5
    finally:
        ctx.client.close(goodbye=False)  # the module's servers serve the other tests


def test_a_cached_key_of_minus_one_is_not_a_free_slot():
    """-1 is a key of a keyed table like any other: the slot holding it is not free (it
    was, when free slots were those with id -1, so key -1's row was overwritten)."""
    from distemb.kvstore.caches.table import TableCache

    cache = TableCache(None, 2, 2)
    slots = cache.admit(np.array([-1, 5], np.int64), np.empty(0, np.int64))
    cache.values[slots] = [[1.0, 1.0], [2.0, 2.0]]
    cache.stamp[slots] = [2, 1]  # key 5 is the least recently used
    fresh = cache.admit(np.array([7], np.int64), np.empty(0, np.int64))
    assert fresh.tolist() == [slots[1]], "key 7 took the slot of key -1"
    assert cache.slot_of.get(np.array([-1, 5, 7])).tolist() == [slots[0], -1, slots[1]]


def test_a_pull_sends_each_row_once_and_returns_every_position(pair):
    """Duplicate ids of one pull cross the wire once; the rows come back per id."""
    cached, other = pair(CacheConfig(policy="lfu", rows=4))
    ids = np.array([9, 3, 9, 9, 3, 17, 3])
    bytes0 = cached.stats()["bytes_pulled"]
    np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
    assert cached.stats()["bytes_pulled"] - bytes0 == 3 * D * 4  # 3 rows, a plain pull
    assert cached.stats()["unique_rows"] == 3


def test_lfu_displaces_a_colder_cached_row_and_keeps_a_hotter_one():
    """Full cache: the new rows, hottest first, are paired with sampled cached rows,
    coldest first; a new row pulled more often than its partner takes its slot, one
    pulled less often does not."""
    from distemb.kvstore.caches.table import TableCache

    cache = TableCache(100, 2, 2)
    for _ in range(3):
        cache.count(np.array([1]))
    cache.count(np.array([2]))
    slots = cache.admit(np.array([1, 2]), np.empty(0, np.int64))
    for _ in range(5):
        cache.count(np.array([7]))  # hotter than row 2 (1 pull), colder than row 1 (3)
    cache.count(np.array([8]))
    cache.count(np.array([8]))  # 2 pulls: paired with row 1 (3 pulls), it stays out
    keep, victims = cache.worth_keeping(np.array([7, 8]), np.empty(0, np.int64))
    assert keep.tolist() == [True, False]
    assert victims.tolist() == [slots[1]]  # row 2's slot: the coldest of the sample
    fresh = cache.admit(np.array([7]), np.empty(0, np.int64), victims)
    assert fresh.tolist() == [slots[1]]
    assert cache.slot_of.get(np.array([1, 2, 7])).tolist() == [slots[0], -1, slots[1]]


def test_a_cache_that_serves_nothing_empties_itself_and_pulls_plainly(pair):
    """Every row pulled twice and never again: LFU keeps each at its second pull and no
    copy is ever used. After a window of DECAY pulls the cache empties itself and keeps
    nothing for IDLE pulls: its pulls are plain ones (rows only), still exact."""
    from distemb.kvstore.caches.table import DECAY, IDLE

    cached, other = pair(CacheConfig(policy="lfu", rows=8))
    for k in range(DECAY):
        ids = np.array([(k // 2) % N, (k // 2 + 20) % N])
        np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
        step(other, ids)  # another writer: copies would be stale anyway
    assert cached.stats()["hit_rows"] == 0
    bytes0 = cached.stats()["bytes_pulled"]
    for ids in ([16, 17], [18, 19], [36, 37]):  # new rows, each pulled twice: LFU would
        ids = np.array(ids)                      # keep them at the second pull
        np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
        np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
    assert cached.stats()["bytes_pulled"] - bytes0 == 6 * 2 * D * 4  # rows only
    assert IDLE > 6


def test_an_idle_cache_holding_nothing_passes_pulls_and_updates_through(pair):
    """Idle and empty, the cache adds no pass over a pull's ids: the wrapped client gets
    them as they are (duplicates too), the pull counts stand still, and the rows and
    every later step stay exact."""
    from distemb.kvstore.caches.table import DECAY

    cached, other = pair(CacheConfig(policy="lfu", rows=8))
    for k in range(DECAY):  # rows pulled twice each, never used again: the cache goes idle
        ids = np.array([(k // 2) % N, (k // 2 + 20) % N])
        np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
        step(other, ids)
    cache = cached._tables["w"]
    assert cache.idle and not cache.used
    counts = cache.seen.counts.copy()
    asked = []
    inner_pull = cached.inner.pull
    cached.inner.pull = lambda name, ids: asked.append(np.array(ids)) or inner_pull(name, ids)
    ids = np.array([5, 5, 9, 5])
    np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
    assert [a.tolist() for a in asked] == [[5, 5, 9, 5]]  # not made unique first
    np.testing.assert_array_equal(cache.seen.counts, counts)
    step(cached, ids)
    step(other, ids)
    np.testing.assert_array_equal(cached.pull("w", np.arange(N)), other.pull("w", np.arange(N)))


def test_the_payoff_idles_a_slower_cache_with_backoff_and_keeps_a_faster_one():
    """Windows judged by their time per pull: the first cached window refills and is not
    judged; with no plain figure the cache measures one plain window; slower than plain,
    it idles BACKOFF windows, twice as long at each loss in a row; faster, it stays and
    measures plain pulls again after REPROBE windows, then twice as long each time."""
    from distemb.payoff import BACKOFF, MAX_BACKOFF, REPROBE, Payoff

    def window(p, idle, cost):
        p.spend(cost)
        return p.window(idle, 1)

    slow = Payoff()
    assert window(slow, False, 2.0) == 0  # refilling: not judged
    assert window(slow, False, 2.0) == 1  # no plain figure yet: one plain window
    assert window(slow, True, 1.0) == 0 and slow.plain == 1.0
    assert window(slow, False, 2.0) == 0  # refilling again
    idle = []
    for _ in range(6):  # each trial loses: idle, then refill, then judged
        idle.append(window(slow, False, 2.0))
        for _ in range(idle[-1]):
            assert window(slow, True, 1.0) == 0
        assert window(slow, False, 2.0) == 0  # the refill after the idle period
    assert idle == [BACKOFF, 2 * BACKOFF, 4 * BACKOFF, 8 * BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    assert slow.losses == 6

    fast = Payoff()
    assert [window(fast, False, 0.5), window(fast, False, 0.5)] == [0, 1]
    assert window(fast, True, 1.0) == 0
    assert window(fast, False, 0.5) == 0  # refill
    for every in (REPROBE, 2 * REPROBE, 4 * REPROBE):  # measure plain again, ever rarer
        judged = [window(fast, False, 0.5) for _ in range(every)]
        assert judged[:-1] == [0] * (every - 1) and judged[-1] == 1, (every, judged)
        assert window(fast, True, 1.0) == 0 and window(fast, False, 0.5) == 0
    assert fast.losses == 0


def test_a_cache_slower_than_plain_pulls_goes_idle_and_stays_exact(pair, monkeypatch):
    """A clock under which a cached pull or update costs three times a plain one: after
    its refill window and a judged one, the cache measures a plain window, refills, loses
    and stays idle BACKOFF windows, holding nothing; under the opposite clock it keeps
    serving its copies. Every pull equals the plain client's throughout."""
    from distemb.kvstore.caches import trainer
    from distemb.payoff import BACKOFF
    from distemb.kvstore.caches.table import DECAY

    def run(cached_cost, plain_cost, windows):
        cached, other = pair(CacheConfig(policy="lru", rows=8))
        cache = cached._tables["w"]
        now = [0.0]

        def clock():  # each call costs what a pull or update costs in the cache's state
            now[0] += plain_cost if cache.idle else cached_cost
            return now[0]
        monkeypatch.setattr(trainer, "clock", clock)
        idle = []
        for k in range(windows * DECAY):
            ids = np.array([1, 2, 3, (k % 30) + 5])
            np.testing.assert_array_equal(cached.pull("w", ids), other.pull("w", ids))
            step(cached, ids)  # the only writer: its copies stay current
            if k % DECAY == 0:
                idle.append(cache.idle and not cache.used)
        np.testing.assert_array_equal(cached.pull("w", np.arange(N)),
                                      other.pull("w", np.arange(N)))
        return idle, cache, cached.stats()

    # windows: refill, judged (no plain figure), plain, refill, judged (loses), idle...
    idle, cache, _ = run(3.0, 1.0, 5 + BACKOFF + 1)
    assert idle == [False, False, True, False, False] + [True] * BACKOFF + [False], idle
    assert cache.payoff.losses == 1
    idle, cache, stats = run(1.0, 3.0, 8)
    assert idle == [False, False, True] + [False] * 5, idle
    assert cache.payoff.losses == 0 and stats["hit_rows"] > 3 * 6 * DECAY
