"""The generic config loader (distemb.schema) and the Enums of closed sets (distemb.enums)."""
import copy
import inspect
import json
import re
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest

from distemb import enums
from distemb.config import ClusterConfig, parse_cluster_config, parse_partition_config
from distemb.context import DistContext
from distemb.enums import Book, Choice, Consistency, PartitionKind, Role, Transport
from distemb.errors import ConfigError, DistEmbError, KVStoreError, PartitionError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import HashPartitionBook, PartitionPolicy
from distemb.schema import Schema, at_least, load, non_empty, option

CLUSTER = {"job_id": "j1", "num_trainers": 2, "trainer_machines": [0, 0],
           "servers": [{"host": "127.0.0.1", "port": 4000, "machine": 0},
                       {"host": "127.0.0.1", "port": 4001, "machine": 0}]}
POLICIES = {"num_partitions": 2, "policies": [
    {"kind": "node", "type": "user", "book": "range", "bounds": [0, 3, 7]},
    {"kind": "edge", "type": "follows", "book": "hash", "num_ids": 9}]}


def changed(raw, path, value):
    """A deep copy of ``raw`` with the item at ``path`` (keys/indices) set, or deleted."""
    raw = copy.deepcopy(raw)
    *parents, last = path
    node = raw
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return raw


DELETE = object()


@pytest.mark.parametrize("path,value,message", [
    (("servers", 1, "port"), "4001", r"^servers\[1\].port: must be an integer, got '4001'$"),
    (("servers", 1, "port"), 0, r"^servers\[1\].port: must be >= 1, got 0$"),
    (("servers", 1, "port"), 4000, r"^servers\[1\].port: 127.0.0.1:4000 is also servers\[0\]"),
    (("servers", 1, "host"), DELETE, r"^servers\[1\].host: missing$"),
    (("servers", 1, "host"), "", r"^servers\[1\].host: must be a non-empty string"),
    (("servers", 0, "rack"), 3, r"^servers\[0\].rack: unknown field \(allowed: \['host', "),
    (("servers", 1), 7, r"^servers\[1\]: must be a mapping, got int$"),
    (("servers",), "127.0.0.1", r"^servers: must be a list, got '127.0.0.1'$"),
    (("servers",), [], r"^servers: must be a non-empty list, got \[\]$"),
    (("trainer_machines", 1), -1, r"^trainer_machines\[1\]: must be >= 0, got -1$"),
    (("shared_memory",), "yes", r"^shared_memory: must be true or false, got 'yes'$"),
    (("timeout_s",), "soon", r"^timeout_s: must be a number, got 'soon'$"),
    (("transport",), "udp", r"^transport: must be one of \['tcp', 'mpi'\], got 'udp'$"),
    (("consistency",), "eventual",
     r"^consistency: must be one of \['sync', 'sync_exact', 'async'\], got 'eventual'$"),
    (("max_message_bytes",), 1024, r"^max_message_bytes: must be >= 1048576, got 1024$"),
    (("master_port",), 65536, r"^master_port: must be <= 65535, got 65536$"),
    (("part_config",), 3, r"^part_config: must be a string, got 3$"),
    (("version",), 2, r"^version: must be 1, got 2$"),
    (("job_id",), DELETE, r"^job_id: missing$"),
])
def test_cluster_loader_names_the_field_path(path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster_config(changed(CLUSTER, path, value))


@pytest.mark.parametrize("path,value,message", [
    (("policies", 1, "book"), "modulo",
     r"^policies\[1\].book: must be one of \['range', 'hash'\], got 'modulo'$"),
    (("policies", 0, "bounds", 0), 2, r"^policies\[0\].bounds\[0\]: must be 0, got 2$"),
    (("policies", 0, "bounds", 1), "3", r"^policies\[0\].bounds\[1\]: must be an integer"),
    (("policies", 0, "bounds"), DELETE, r"^policies\[0\].bounds: missing \(book 'range'"),
    (("policies", 1, "num_ids"), DELETE, r"^policies\[1\].num_ids: missing \(book 'hash'"),
    (("policies", 1, "bounds"), [0, 4, 9],
     r"^policies\[1\].bounds: only for book 'range' \(hash uses num_ids\)$"),
    (("policies", 0, "num_ids"), 7, r"^policies\[0\].num_ids: only for book 'hash'"),
    (("policies", 1, "type"), "", r"^policies\[1\].type: must be a non-empty string, got ''$"),
    (("policies", 1, "kind"), "vertex", r"^policies\[1\].kind: must be one of \['node', "),
    (("policies", 1), ["edge"], r"^policies\[1\]: must be a mapping, got list$"),
    (("num_partitions",), True, r"^num_partitions: must be an integer, got True$"),
])
def test_partition_loader_names_the_field_path(path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_partition_config(changed(POLICIES, path, value))


def test_root_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"^<root>: must be a mapping, got list$"):
        parse_cluster_config([CLUSTER])


def test_loaded_configs_hold_enums_and_round_trip_through_json():
    cfg = parse_cluster_config(dict(CLUSTER, consistency="sync_exact", transport="mpi"))
    assert cfg.consistency is Consistency.SYNC_EXACT and cfg.transport is Transport.MPI
    assert cfg.servers[1].port == 4001 and cfg.trainer_machines == (0, 0)
    raw = json.loads(json.dumps(cfg.to_dict()))
    assert raw["consistency"] == "sync_exact" and raw["servers"][0]["host"] == "127.0.0.1"
    assert parse_cluster_config(raw) == cfg
    parts = parse_partition_config(POLICIES)
    assert parts.policies[0].kind is PartitionKind.NODE and parts.policies[1].book is Book.HASH
    assert parse_partition_config(json.loads(json.dumps(parts.to_dict()))) == parts


def test_defaults_come_from_the_fields():
    cfg = parse_cluster_config(CLUSTER)
    for f in ("transport", "consistency", "shared_memory", "timeout_s", "master_port",
              "max_message_bytes", "part_config", "version"):
        assert getattr(cfg, f) == ClusterConfig.__dataclass_fields__[f].default, f


@dataclass(frozen=True)
class _Table(Schema):
    dim: int = option(help="row width", validator=at_least(1))
    name: str = option("t", help="table name", validator=non_empty)


@dataclass(frozen=True)
class _Job(Schema):
    tables: Tuple[_Table, ...] = option(help="tables")
    lr: Optional[float] = option(None, help="learning rate")

    def check(self):
        if len({t.name for t in self.tables}) != len(self.tables):
            raise ConfigError("tables: duplicate name")


def test_generic_loader_on_any_schema():
    job = load(_Job, {"tables": [{"dim": 4}, {"dim": 8, "name": "u"}], "lr": 1})
    assert job == _Job((_Table(4), _Table(8, "u")), 1.0) and isinstance(job.lr, float)
    with pytest.raises(ConfigError, match=r"^tables\[2\].dim: must be >= 1, got 0$"):
        load(_Job, {"tables": [{"dim": 1, "name": "a"}, {"dim": 1}, {"dim": 0}]})
    with pytest.raises(ConfigError, match=r"^jobs\[3\].tables\[0\].dim: must be an integer"):
        load(_Job, {"tables": [{"dim": 1.5}]}, "jobs[3]")
    with pytest.raises(ConfigError, match=r"^jobs\[3\].tables: duplicate name$"):
        load(_Job, {"tables": [{"dim": 1}, {"dim": 2}]}, "jobs[3]")
    with pytest.raises(ConfigError, match=r"^lr: must be a number, got '0.1'$"):
        load(_Job, {"tables": [], "lr": "0.1"})


# --- Enums ---------------------------------------------------------------------------

ENUMS = [Consistency, Role, Transport, PartitionKind, Book]


@pytest.mark.parametrize("cls", ENUMS)
def test_members_are_their_string_values(cls):
    for m in cls:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value
        assert {m.value: 1}[m] == 1 and json.dumps(m) == json.dumps(m.value)
        assert cls.parse(m.value, "f") is m and cls.parse(m, "f") is m


@pytest.mark.parametrize("cls", ENUMS)
def test_parse_error_names_field_value_and_choices(cls):
    choices = re.escape(str(cls.values()))
    with pytest.raises(ConfigError, match=rf"^some\.field: must be one of {choices}, got 'x'$"):
        cls.parse("x", "some.field")
    with pytest.raises(KVStoreError, match=r"^arg: must be one of .*, got None$"):
        cls.parse(None, "arg", KVStoreError)


def test_every_enum_member_has_a_comment():
    for cls in [c for c in vars(enums).values() if isinstance(c, type)
                and issubclass(c, Choice) and c is not Choice]:
        lines = inspect.getsource(cls).splitlines()
        for m in cls:
            i = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{m.name} ="))
            assert lines[i - 1].strip().startswith("#"), f"{cls.__name__}.{m.name}"


def test_callers_parse_their_enum_arguments():
    with pytest.raises(DistEmbError, match=r"^role: must be one of \['embedded', 'trainer', "
                                           r"'server', 'collective'\], got 'boss'$"):
        DistContext(LocalKVClient(), backend="numpy", role="boss", num_threads=1)
    ctx = DistContext(LocalKVClient(), backend="numpy", role="trainer", num_threads=1)
    assert ctx.role is Role.TRAINER and "role='trainer'" in repr(ctx)
    ctx.close()
    book = HashPartitionBook(1, node_counts={"_N": 3})
    with pytest.raises(PartitionError, match=r"^kind: must be one of \['node', 'edge'\], "
                                             r"got 'vertex'$"):
        PartitionPolicy("vertex", "_N", book)
    assert PartitionPolicy("node", "_N", book).kind is PartitionKind.NODE
    cfg = parse_cluster_config(CLUSTER)
    with pytest.raises(KVStoreError, match=r"^consistency: must be one of .*got 'eventual'$"):
        RemoteKVClient(cfg, 0, connections=[], consistency="eventual")
