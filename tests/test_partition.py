"""Partition books and policies, the policy config file, and DGL partition configs."""
import json
import os

import numpy as np
import pytest

from distemb.config import load_partition_config
from distemb.errors import ConfigError, PartitionError
from distemb.layouts import json_layout, layout_json, layout_policy, policy_layout
from distemb.partition import (EdgePartitionPolicy, HashPartitionBook, NodePartitionPolicy,
                               RangePartitionBook, load_dgl_partition_config,
                               load_policies, load_policy_config, range_policy)


def test_range_book_maps_ids():
    book = RangePartitionBook(3, node_bounds={"_N": [0, 4, 4, 10]})
    pol = NodePartitionPolicy(book)
    ids = np.arange(10)
    assert pol.to_partid(ids).tolist() == [0] * 4 + [2] * 6
    assert pol.to_local(ids).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert [pol.get_part_size(p) for p in range(3)] == [4, 0, 6]
    assert pol.get_size() == 10 and pol.policy_str == "node~_N"


def test_hash_book_maps_ids():
    pol = EdgePartitionPolicy(HashPartitionBook(3, edge_counts={"_E": 10}))
    ids = np.arange(10)
    assert pol.to_partid(ids).tolist() == (ids % 3).tolist()
    assert pol.to_local(ids).tolist() == (ids // 3).tolist()
    assert [pol.get_part_size(p) for p in range(3)] == [4, 3, 3]


class ReversedBook(RangePartitionBook):
    """One partition whose local ids run backwards, and that does not say its
    progression: split must ask it per id."""

    def to_local(self, kind, type_name, ids):
        return self.num_ids(kind, type_name) - 1 - ids

    def id_progression(self, kind, type_name, part):
        raise NotImplementedError


@pytest.mark.parametrize("pol", [range_policy(50, 4),
                                 NodePartitionPolicy(HashPartitionBook(3, node_counts={"_N": 50})),
                                 range_policy(50, 1),  # one partition: no sort, no search
                                 NodePartitionPolicy(HashPartitionBook(1, node_counts={"_N": 50})),
                                 NodePartitionPolicy(ReversedBook(1, node_bounds={"_N": [0, 50]}))],
                         ids=["range4", "hash3", "range1", "hash1", "reversed1"])
def test_split_covers_every_id_once(pol):
    ids = np.random.default_rng(0).integers(0, 50, 200)
    seen = np.zeros(200, bool)
    for part, pos, local in pol.split(ids):
        assert (pol.to_partid(ids[pos]) == part).all() and (pol.to_local(ids[pos]) == local).all()
        assert local.dtype == np.int64 and not seen[pos].any()
        seen[pos] = True
    assert seen.all()
    assert pol.split(np.empty(0, np.int64)) == []


def test_policy_errors():
    book = RangePartitionBook(2, node_bounds={"user": [0, 5, 9]})
    with pytest.raises(PartitionError, match="node type: expected one of \\['user'\\], got 'item'"):
        NodePartitionPolicy(book, "item")
    with pytest.raises(PartitionError, match="part_id: expected 0..1, got 2"):
        NodePartitionPolicy(book, "user", part_id=2)
    with pytest.raises(PartitionError, match="out of range"):
        NodePartitionPolicy(book, "user").check_ids(np.array([9]))
    with pytest.raises(PartitionError, match="ascending"):
        RangePartitionBook(2, node_bounds={"x": [0, 5]})


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_policy_config_yaml(tmp_path):
    path = _write(tmp_path, "p.yaml", """
num_partitions: 2
policies:
  - {kind: node, type: user, book: range, bounds: [0, 6, 10]}
  - {kind: edge, type: follows, book: hash, num_ids: 7}
""")
    pols = load_policy_config(path)
    assert set(pols) == {"node~user", "edge~follows"}
    assert pols["node~user"].to_partid(np.array([5, 6])).tolist() == [0, 1]
    assert pols["edge~follows"].get_part_size(1) == 3
    assert load_policies(path).keys() == pols.keys()


@pytest.mark.parametrize("body,message", [
    ('{"policies": []}', "num_partitions: missing"),
    ('{"num_partitions": 0, "policies": []}', "num_partitions: must be >= 1, got 0"),
    ('{"num_partitions": 1, "policies": []}', "policies: must be a non-empty list"),
    ('{"num_partitions": 1, "policies": [{"kind": "vertex", "type": "a", "book": "hash", '
     '"num_ids": 3}]}', "policies\\[0\\].kind: must be one of"),
    ('{"num_partitions": 2, "policies": [{"kind": "node", "type": "a", "book": "range", '
     '"bounds": [0, 3]}]}', "policies\\[0\\].bounds: must be a list of num_partitions\\+1 = 3"),
    ('{"num_partitions": 2, "policies": [{"kind": "node", "type": "a", "book": "range", '
     '"bounds": [0, 5, 3]}]}', "policies\\[0\\].bounds\\[2\\]: must be >= bounds\\[1\\] = 5"),
    ('{"num_partitions": 1, "policies": [{"kind": "node", "type": "a", "book": "hash", '
     '"num_ids": 0}]}', "policies\\[0\\].num_ids: must be >= 1, got 0"),
    ('{"num_partitions": 1, "policies": [{"kind": "node", "type": "a", "book": "hash", '
     '"num_ids": 3, "colour": 1}]}', "policies\\[0\\].colour: unknown field"),
    ('{"num_partitions": 1, "policies": [{"kind": "node", "type": "a", "book": "hash", '
     '"num_ids": 3}, {"kind": "node", "type": "a", "book": "hash", "num_ids": 3}]}',
     "policies\\[1\\].type: duplicate node type 'a'"),
    ('{not json', "not valid JSON"),
])
def test_policy_config_errors_name_the_field(tmp_path, body, message):
    path = _write(tmp_path, "p.json", body)
    with pytest.raises(ConfigError, match=message):
        load_partition_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_policy_config(str(tmp_path / "nope.yaml"))


def test_dgl_config_formats_parsed_without_dgl(tmp_path):
    hetero = {"graph_name": "g", "num_parts": 2, "part_method": "random",
              "node_map": {"user": [[0, 3], [7, 12]], "item": [[3, 7], [12, 14]]},
              "edge_map": {"user:buys:item": [[0, 10], [10, 15]]},
              "ntypes": {"user": 0, "item": 1}, "etypes": {"user:buys:item": 0}}
    book, pols = load_dgl_partition_config(_write(tmp_path, "h.json", json.dumps(hetero)))
    user = pols["node~user"]
    assert user.get_size() == 8 and [user.get_part_size(p) for p in (0, 1)] == [3, 5]
    assert user.to_partid(np.array([2, 3])).tolist() == [0, 1]
    assert user.to_local(np.array([3, 7])).tolist() == [0, 4]
    assert pols["edge~user:buys:item"].get_size() == 15
    old = {"num_parts": 2, "node_map": [4, 9], "edge_map": [10, 20]}
    _, pols = load_dgl_partition_config(_write(tmp_path, "o.json", json.dumps(old)))
    assert pols["node~_N"].get_part_size(1) == 5
    bad = dict(old, node_map=[[0, 4]])
    with pytest.raises(ConfigError, match="1 ranges, but num_parts is 2"):
        load_dgl_partition_config(_write(tmp_path, "b.json", json.dumps(bad)))


def test_dgl_partition_graph_output_matches_dgl_partition_book(tmp_path):
    """Write a real partition with DGL, then compare every id's mapping with DGL's book."""
    dgl = pytest.importorskip("dgl", reason="DGL is an optional extra (pip install .[dgl])")
    import torch

    g = dgl.heterograph({
        ("user", "follows", "user"): (torch.randint(0, 40, (120,)), torch.randint(0, 40, (120,))),
        ("user", "buys", "item"): (torch.randint(0, 40, (90,)), torch.randint(0, 25, (90,)))},
        num_nodes_dict={"user": 40, "item": 25})
    dgl.distributed.partition_graph(g, "g", 2, str(tmp_path), part_method="random",
                                    balance_edges=False)
    cfg = os.path.join(str(tmp_path), "g.json")
    _, pols = load_dgl_partition_config(cfg)
    gpb = dgl.distributed.load_partition_book(cfg, 0)[0]
    for ntype in ("user", "item"):
        ids = torch.arange(g.num_nodes(ntype))
        pol = pols[f"node~{ntype}"]
        assert pol.to_partid(ids.numpy()).tolist() == gpb.nid2partid(ids, ntype).tolist()
    for cet in g.canonical_etypes:
        key = [k for k in pols if k.startswith("edge~") and cet[1] in k][0]
        ids = torch.arange(g.num_edges(cet))
        assert pols[key].to_partid(ids.numpy()).tolist() == gpb.eid2partid(ids, cet).tolist()


class BackwardsBook(RangePartitionBook):
    """One partition whose local ids run backwards (as a graph partitioner may number a
    partition's nodes): the shard's row of id g is N - 1 - g."""

    def to_local(self, kind, type_name, ids):
        return self.num_ids(kind, type_name) - 1 - ids

    def id_progression(self, kind, type_name, part):
        return self.num_ids(kind, type_name) - 1, -1


def test_a_one_partition_policy_maps_ids_by_its_book(client):
    """On every placement of the client suite (tests/conftest.py), as the servers do:
    every placement stores id g at the shard row the policy's book gives it, one
    partition or many (the rows an initialiser made, by shard row, tell)."""
    policy = NodePartitionPolicy(BackwardsBook(1, node_bounds={"_N": [0, 10]}))
    client.init_data("t", (10, 2), "float32", policy,
                     lambda shape, dtype: np.repeat(np.arange(shape[0], dtype=dtype)[:, None],
                                                    shape[1], axis=1))
    ids = np.array([0, 9, 4, 4], np.int64)
    np.testing.assert_array_equal(client.pull("t", ids)[:, 0], 9 - ids)
    client.push("t", ids[:1], np.full((1, 2), -1.0, np.float32))
    np.testing.assert_array_equal(client.pull("t", np.array([0, 9]))[:, 0], [-1.0, 0.0])


def test_a_policy_of_any_book_travels_as_its_progressions_and_maps_ids_alike():
    """A book other than ranges or id % P reaches servers as its partitions' id
    progressions: the rebuilt policy gives every id the partition and local id the book
    gives it (two partitions, one backwards); a book that gives no progressions is
    refused naming what it lacks."""
    class TwoWays(RangePartitionBook):
        def to_local(self, kind, type_name, ids):
            part = self.to_partid(kind, type_name, ids)
            return np.where(part == 0, ids, self.num_ids(kind, type_name) - 1 - ids)

        def id_progression(self, kind, type_name, part):
            return (0, 1) if part == 0 else (self.num_ids(kind, type_name) - 1, -1)

    book = TwoWays(2, node_bounds={"_N": [0, 4, 10]})
    policy = NodePartitionPolicy(book)
    layout = policy_layout(policy)
    assert layout == ("progressions", ((0, 1, 4), (9, -1, 6)))
    rebuilt = layout_policy(json_layout(layout_json(layout)), 10)
    ids = np.arange(10)
    assert rebuilt.to_partid(ids).tolist() == policy.to_partid(ids).tolist()
    assert rebuilt.to_local(ids).tolist() == [0, 1, 2, 3, 5, 4, 3, 2, 1, 0]
    assert rebuilt.to_local(ids).tolist()[4:] == (9 - ids[4:]).tolist()

    class Silent(RangePartitionBook):
        def id_progression(self, kind, type_name, part):
            raise NotImplementedError

    with pytest.raises(ValueError, match="id progressions"):
        policy_layout(NodePartitionPolicy(Silent(1, node_bounds={"_N": [0, 3]})))
    with pytest.raises(ValueError, match="progressions hold 10 ids, the table has 11"):
        layout_policy(layout, 11)
