"""Routers (distemb/routers.py): a partition policy folded onto any number of shards.

The oracle is the definition: every key on exactly one shard, partition q's keys on
shard q % S; a shard's store keys are 0..size-1, each once; to_global inverts to_local.
"""
import numpy as np
import pytest

from distemb.errors import PartitionError
from distemb.partition import (HashPartitionBook, NodePartitionPolicy, RangePartitionBook,
                               range_policy)
from distemb.routers import PolicyRouter

N = 37


def policies():
    yield "range2", range_policy(N, 2)
    yield "uneven ranges, an empty one", NodePartitionPolicy(
        RangePartitionBook(4, node_bounds={"_N": [0, 5, 5, 30, N]}))
    for p in (1, 3, 5):
        yield f"hash{p}", NodePartitionPolicy(HashPartitionBook(p, node_counts={"_N": N}))


@pytest.mark.parametrize("shards", [None, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("what, policy", list(policies()), ids=[w for w, _ in policies()])
def test_every_key_on_one_shard_once_and_back(what, policy, shards):
    r = PolicyRouter(policy, shards)
    S = policy.num_partitions if shards is None else shards
    keys = np.arange(N, dtype=np.int64)
    shard = r.part_of(keys)
    np.testing.assert_array_equal(shard, policy.to_partid(keys) % S)
    assert sum(r.part_size(s) for s in range(S)) == N
    for s in range(S):
        mine = keys[shard == s]
        local = r.to_local(s, mine)
        assert sorted(local.tolist()) == list(range(r.part_size(s))), (what, s)
        np.testing.assert_array_equal(r.to_global(s, local), mine)
        np.testing.assert_array_equal(r.owns(s, keys), shard == s)
        span = r.key_range(s)  # where given: exactly the shard's keys, store key k - start
        if span is not None:
            assert mine.tolist() == list(range(*span)), (what, s)
            np.testing.assert_array_equal(r.to_local(s, mine), mine - span[0])
    got = np.zeros(N, bool)
    for s, (pos, ks) in r.split(keys[::-1]).items():
        assert (r.part_of(ks) == s).all() and not got[ks].any()
        got[ks] = True
    assert got.all()


def test_keys_outside_and_shard_counts_are_refused():
    r = PolicyRouter(range_policy(N, 3), 2)
    with pytest.raises(PartitionError, match=f"id {N} is out of range"):
        r.part_of(np.array([0, N]))
    assert not r.owns(0, np.array([-1, N])).any()
    with pytest.raises(ValueError, match="num_shards: expected >= 1, got 0"):
        PolicyRouter(range_policy(N, 3), 0)


@pytest.mark.parametrize("what, policy", list(policies()), ids=[w for w, _ in policies()])
def test_a_shard_maps_and_refuses_keys_as_its_router_does(what, policy):
    """ShardTable.local_keys (a range partition's one-pass path, or the router's):
    the store keys of its own keys, and the router's error for a key outside the key
    space or on another shard."""
    from distemb.kvstore.server.shard import ShardTable
    from distemb.stores.dense import DenseStore

    r = PolicyRouter(policy, 2)
    keys = np.arange(N, dtype=np.int64)
    for s in range(2):
        table = ShardTable(DenseStore(max(r.part_size(s), 1), 2), r, part=s)
        mine = keys[r.part_of(keys) == s]
        if not len(mine):  # one partition folded onto two shards: the second holds none
            continue
        np.testing.assert_array_equal(table.local_keys(mine[::-1], "t"),
                                      r.to_local(s, mine[::-1]))
        for bad in (-1, N, 1 << 62):
            with pytest.raises(PartitionError, match=f"id {bad} is out of range"):
                table.local_keys(np.array([mine[0], bad]), "t")
        other = keys[r.part_of(keys) != s]
        if len(other):
            with pytest.raises(Exception, match="belongs to shard"):
                table.local_keys(np.array([mine[0], other[0]]), "t")
