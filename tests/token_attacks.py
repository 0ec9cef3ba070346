"""The token holder's attacks (tests/test_token_holder.py): every request kind with
hostile fields, damaged checkpoints, hostile request slots. Every message is built to
be invalid: the server must refuse each and change nothing."""
import json
import math
import os
import shutil
import zlib

import numpy as np
import pytest

from test_hostile import SpecCreate
from test_shm_writes import HOSTILE_FDS, hostile_fd, sealed

from distemb import checkpoint
from distemb.stores.dense import DenseSpec
from distemb.kvstore import LocalKVClient
from distemb.kvstore.checkpoint import segments
from distemb.partition import range_policy
from distemb.stores import HashStore
from distemb.stores.spec import HashTableSpec
from distemb.transport.messages import (Barrier, Bye, Create, Drop, Hello, Load,
                                        OptInit, Pull, Push, Save, Service, ShmInfo,
                                        Export, Get, Info, Remove, Update, VersionedPull)
from distemb.transport.base import MAX_FDS, Frame
from distemb.transport.slots import RequestSlot

ROWS, DIM = 10, 4
KEYS = np.array([3, -7, 2 ** 40, 11, 12, 13, 14, 15], np.int64)  # the keyed table's keys
PER_KIND = 40  # messages per request kind (damaged checkpoints and slots: each one more)
NAN, INF = math.nan, math.inf


def ids(*v):
    return np.array(v, np.int64)


def grads(n, dim=DIM, dtype=np.float32):
    return np.ones((n, dim), dtype)


def dense_fields(**edit):
    """The spec fields of the dense table "keep", with ``edit``; a ``partition`` of None
    means one range over ``num_rows`` (a layout must cover the table's rows)."""
    fields = dict(DenseSpec((ROWS, DIM), "float32").fields(), **edit)
    if fields["partition"] is None:
        fields["partition"] = ["range", [0, fields["num_rows"]]]
    return fields


# Every request kind: a base that would be valid (against the tables "keep", "half" and
# the keyed "dyn"), and mutations each of which alone makes the request invalid.
BAD_NAMES = ["", "nope", "keep~opt~sum", "keep~opt~evil", "x" * 300, "\x00", "dyn~opt~sum"]
# Rows of a state ("keep~opt~sum") are read and written by name (a trainer's cache
# writes state back, a checkpoint of an earlier version restores it): not bad names there.
ROW_BAD_NAMES = [n for n in BAD_NAMES if n not in ("keep~opt~sum", "dyn~opt~sum")]
BAD_IDS = [ids(-1), ids(ROWS), ids(1 << 40), ids(-(1 << 62)), ids(0, ROWS + 5, 1),
           np.array([0, 1], np.int32), np.array([[0]], np.int64), np.array([0.0]),
           np.array([True]), np.zeros(0, np.uint8)]


def rows_mutations(n_values, values_key):
    """Mutations of a rows request (Pull, Push, Update, VersionedPull) on "keep"."""
    out = [{"name": n} for n in ROW_BAD_NAMES] + \
        [{"ids": i, "counts": [len(i)]} for i in BAD_IDS if i.ndim == 1] + \
        [{"ids": i} for i in BAD_IDS] + \
        [{"parts": [1]}, {"parts": [0, 0], "counts": [1, 0]}, {"parts": [1 << 40]},
         {"parts": [0, 1], "counts": [1, 1]}, {"counts": [1 << 30]}, {"counts": [0]},
         {"counts": [-1]}, {"parts": [-1]}, {"parts": "x"}, {"counts": None},
         {"parts": list(range(9000))}]
    if values_key:
        out += [{values_key: grads(n_values, DIM + 1)}, {values_key: grads(n_values + 1)},
                {values_key: grads(n_values, DIM, np.float64)}, {values_key: np.ones(n_values)},
                {values_key: grads(n_values, DIM, np.int32)},
                {values_key: np.zeros((n_values, DIM, 1 << 20), np.uint8)[:, :, :0]}]
    return out


KINDS = {
    Hello: (dict(rank=1, token=None),
            [{"rank": 0}, {"rank": 5}, {"rank": -1}, {"token": "0" * 32}, {"token": ""},
             {"rank": 1 << 62}, {"rank": "1"}]),
    Create: (dict(name="keep", spec=dense_fields()),
             [{"name": n} for n in BAD_NAMES[2:4] + ["", "x" * 300, "\x00"]] +
             [{"spec": dense_fields(dtype=d)} for d in ("float128", "object", "", "int64",
                                                        "<f4")] +
             [{"spec": dense_fields(row_shape=s)} for s in ([DIM + 1], [0], [1 << 30, 1 << 30],
                                                           [-1], [1] * 4)] +
             [{"spec": dense_fields(num_rows=r)} for r in (ROWS + 1, 1 << 40, 0, -1)] +
             [{"name": "new", "spec": dense_fields(num_rows=1 << 38, partition=None)},
              {"name": "new", "spec": dense_fields(row_shape=[1 << 20], num_rows=1 << 20,
                                                   partition=None)},
              {"name": "new", "spec": dense_fields(num_rows=(1 << 40) + 1,
                                                   partition=["range", [0, 1, (1 << 40) + 1]])},
              {"name": "new", "spec": dense_fields(partition=["range", [0, 4]])},
              {"name": "dyn"}, {"name": "half", "spec": dense_fields(dtype="float32")},
              {"spec": dense_fields(seed=-2)}, {"spec": dense_fields(seed=5)},
              {"spec": dense_fields(kind="nope")}, {"spec": dense_fields(capacity=5)}]),
    # (a state is dropped by its name: a client drops every tensor it lists, states too)
    Drop: (dict(name="nope"), [{"name": n} for n in ("", "x" * 300, "\x00", "a\nb")]),
    Pull: (dict(name="keep", parts=[0], counts=[2], ids=ids(0, 9)), rows_mutations(2, None)),
    Push: (dict(name="keep", parts=[0], counts=[2], ids=ids(0, 9), values=grads(2)),
           rows_mutations(2, "values") + [{"name": "half"}, {"name": "dyn", "ids": ids(1, 2),
                                                              "values": grads(2, DIM + 1)}]),
    OptInit: (dict(name="keep", rule="adagrad", options={"initial_accumulator_value": 0.1},
                   parts=[0]),
              [{"name": n} for n in BAD_NAMES] +
              [{"rule": r} for r in ("nope", "", "adagrad " * 40)] +
              [{"options": {"initial_accumulator_value": v}} for v in (NAN, INF, -INF)] +
              [{"options": {"initial_accumulator_value": "x"}}, {"options": [1]},
               {"parts": [1]}, {"parts": [0, 1]}, {"parts": [1 << 40]},
               {"name": "dyn", "options": {"initial_accumulator_value": NAN}},
               {"name": "dyn", "parts": [1]}]),
    Update: (dict(name="keep", rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10}, seq=1,
                  exact=False, parts=[0], counts=[2], ids=ids(0, 9), grads=grads(2)),
             rows_mutations(2, "grads") +
             [{"hyper": {"clr": v, "eps": 1e-10}} for v in (NAN, INF, -INF, "x", None)] +
             [{"hyper": {"clr": 0.1, "eps": NAN}}, {"hyper": {"clr": 0.1}},
              {"hyper": {"clr": 0.1, "eps": 1e-10, "x": 1}}, {"rule": "sgd"},
              {"rule": "nope"}, {"rule": "adam"}, {"exact": True, "ids": ids(-1, 3)},
              {"exact": True, "ids": ids(0, ROWS)}, {"exact": True, "name": "nope"},
              {"exact": "yes"}, {"seq": 1 << 63}, {"name": "half"}, {"name": "keep~opt~sum"},
              {"name": "dyn~opt~sum", "ids": ids(1, 2)},
              {"name": "dyn", "ids": ids(1, 2), "grads": grads(2, DIM + 1)}]),
    Barrier: (dict(rank=1), [{"rank": 0}, {"rank": -1}, {"rank": 2}, {"rank": 1 << 40},
                             {"rank": None}]),
    ShmInfo: (dict(name="keep", parts=[0]),
              [{"name": n} for n in BAD_NAMES[:2] + ["x" * 300]] +
              [{"parts": [1]}, {"parts": [1 << 40]}, {"parts": [-1]}, {"parts": [0, 3]}]),
    Bye: (dict(rank=1), [{"rank": 0}, {"rank": -1}, {"rank": 2}, {"rank": 1 << 40},
                         {"rank": True}]),
    Save: (dict(name="keep", directory="<tmp>", save_id="0123abcd", parts=[0]),
           [{"name": n} for n in BAD_NAMES[:2]] +
           [{"save_id": s} for s in ("../../x", "", "ZZZZZZZZ", "a" * 300, "/etc/x")] +
           [{"directory": d} for d in ("relative", "", "/proc/nope", "/dev/null")] +
           [{"parts": [1]}, {"parts": [0, 0]}, {"parts": [1 << 40]}, {"parts": [-1]},
            {"columns": ["nope"]}, {"columns": ["weight", "weight"]}, {"columns": "weight"},
            {"columns": ["~version"]}, {"columns": ["x" * 300]},
            {"name": "keep~opt~sum"}, {"name": "dyn", "parts": [1]},
            {"name": "dyn", "columns": ["nope"]}]),
    VersionedPull: (dict(name="keep", parts=[0], counts=[2], ids=ids(0, 9), have=ids(-2, -2),
                         states=["sum"]),
                    rows_mutations(2, "have") +
                    [{"states": s} for s in (["evil"], ["sum", "nope"], ["~opt~sum"],
                                             ["x" * 300], "sum", ["sum"] * 9)] +
                    [{"have": np.zeros(2, np.int32)}, {"have": np.zeros(2)},
                     {"name": "half", "states": ["sum"]}]),
    SpecCreate: (dict(name="dyn", **HashTableSpec(DIM).fields()),
                  [{"name": n} for n in ("keep", "dyn~opt~x", "", "x" * 300)] +
                  [{"dim": d} for d in (0, -1, 1 << 40, 1 << 20, DIM + 1)] +
                  [{"capacity": c} for c in (-1, 1 << 62, 1 << 40)] +
                  [{"kind": k} for k in ("nope", "", "file")] +
                  [{"dtype": d} for d in ("float128", "int8", "")] +
                  [{"init": i} for i in ("nope", "")] +
                  [{"init_args": {"std": NAN}}, {"init_args": {"x": 1}},
                   {"low_water": 2.0}, {"low_water": -1.0}, {"evict": "nope"},
                   {"rounding": "nope"}, {"num_rows": -1}, {"preallocate": -1},
                   {"preallocate": 1 << 40}, {"path": "/etc"},
                   {"name": "new", "capacity": 1 << 40, "preallocate": 1 << 40},
                   {"name": "new", "kind": "dense", "num_rows": 1 << 40},
                   {"name": "new", "dim": 1 << 16, "preallocate": 1 << 30}]),
    Get: (dict(name="dyn", mode="get", column="weight", parts=[0], counts=[2], ids=KEYS[:2]),
                [{"name": n} for n in BAD_NAMES] +
                [{"mode": m} for m in ("nope", "", None)] +
                [{"column": c} for c in ("nope", "~version", "", "x" * 300)] +
                [{"ids": i} for i in BAD_IDS[5:] + [ids(999, 998), ids(-5, -6)]] +
                [{"parts": [1]}, {"parts": [0, 1], "counts": [1, 1]}, {"counts": [3]}]),
    Remove: (dict(name="dyn", parts=[0], counts=[1], ids=ids(1 << 50)),
                  [{"name": n} for n in BAD_NAMES] +
                  [{"ids": i} for i in BAD_IDS[5:]] + [{"name": "keep", "ids": ids(1)},
                                                       {"parts": [1]}, {"counts": [2]}]),
    Info: (dict(name="dyn", evict_to=-1, policy=""),
                [{"name": n} for n in BAD_NAMES] +
                [{"name": "keep", "evict_to": 0}, {"evict_to": "x"},
                 {"evict_to": 0, "policy": "nope"}, {"evict_to": 1 << 62, "policy": "x"}]),
    Export: (dict(name="dyn", part=0, start=0, count=10, columns=[]),
                  [{"name": n} for n in BAD_NAMES] +
                  [{"start": -1}, {"count": 0}, {"count": -1}, {"columns": ["nope"]},
                   {"columns": ["weight", "x" * 300]}, {"columns": "weight"},
                   {"part": 1}, {"part": -1}, {"part": 1 << 40}]),
    Load: (dict(name="keep", directory="<ck_keep:crc_last>", parts=[0]),
           [{"name": n} for n in BAD_NAMES] +
           [{"directory": "<ck_keep>", "parts": [1]}, {"directory": "<ck_keep>", "parts": [-1]},
            {"directory": "<ck_keep>", "parts": [0, 0]},
            {"directory": "<ck_keep>", "parts": [1 << 40]},
            {"directory": "<ck_keep>", "name": "half"},
            {"directory": "<ck_keep>", "name": "dyn"},
            {"directory": "<ck_keep>", "columns": ["sum"]},
            {"directory": "<ck_keep>", "columns": ["nope"]},
            {"directory": "<ck_keep>", "columns": ["~version"]},
            {"directory": "<ck_dyn>", "name": "dyn", "parts": [1]}]),
}


INT64_MIN = np.iinfo(np.int64).min
# Requests each refused for one reason, which its error must name (issue 37): a server
# took them, refused them only by accident, or only after it had queued them.
NAMED = {
    Update: [({"name": "dyn", "exact": True, "ids": ids(3, INT64_MIN)},
              f"{INT64_MIN} is reserved by the hash table"),
             ({"name": "dyn", "exact": True, "ids": ids(3, INT64_MIN + 1)},
              f"{INT64_MIN + 1} is reserved by the hash table")],
    OptInit: [({"options": {"initial_accumulator_value": 0.1, "bogus": 1.0}},
               "options.bogus: unknown option of rule 'adagrad'"),
              ({"rule": "sgd"}, "options.initial_accumulator_value: unknown option"),
              ({"name": "dyn", "options": {"initial_accumulator_value": 0.1, "lr": 0.1}},
               "options.lr: unknown option of rule 'adagrad'")],
    SpecCreate: [({"init_args": {"dim": DIM + 1}}, f"init_args.dim: {DIM + 1}, the table's "
                                                   f"dim is {DIM}"),
                 ({"init": "normal", "init_args": {"dim": DIM + 1, "std": 1.0, "seed": 0}},
                  f"init_args.dim: {DIM + 1}, the table's dim is {DIM}")],
    Push: [({"name": "dyn~opt~sum", "ids": ids(1, 2)}, "key(s) not in the store, e.g. [1, 2]"),
           ({"name": "dyn~opt~sum", "ids": ids(int(KEYS[0]), 5)},
            "key(s) not in the store, e.g. [5]")],
    VersionedPull: [({"have": np.zeros((2, 1), np.int64)}, "VersionedPull.have: expected "
                                                           "int64 of shape (2,)"),
                    ({"name": "dyn", "ids": ids(3, 11), "have": np.zeros((2, 3), np.int64)},
                     "VersionedPull.have")],
    Load: [({"directory": "<ck_dyn>", "name": "dyn", "columns": ["sum"]},
            "loads the weight too")],
}
#: What the refusal of a load of each of these damaged checkpoints must name.
NAMED_DAMAGE = {
    "<ck_keep:entry_shape>": f"the table's entry says rows of ({DIM + 1},)",
    "<ck_dyn:entry_shape>": f"the table's entry says rows of ({DIM + 1},)",
    "<ck_dyn:v2_dim>": f"the table's entry says rows of ({DIM + 1},)",
    "<ck_dyn:keys_reserved>": f"{INT64_MIN} is reserved by the hash table",
    "<ck_dyn:keys_marker>": f"{INT64_MIN + 1} is reserved by the hash table",
    "<ck_dyn:state_alone>": "holds state ['sum'] without the weight",
}


# --- damaged checkpoints ------------------------------------------------------------


def _edit_manifest(directory, edit):
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _flip_last_block(directory, seg):
    path = directory / seg["file"]
    assert len(seg["crc32"]) >= 2, "the test needs segments of several blocks"
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(bytes([f.read(1)[0] ^ 0x5A]))


def _shards(m):
    return m["tensors"]["keep"]["shards"]


def _keep_segments(m):
    return [r["columns"]["weight"]["segment"] for r in _shards(m)]


def _dyn_shard(m):
    return m["tensors"]["dyn"]["shards"][0]


def _seg(m, i):
    return _shards(m)[i]["columns"]["weight"]["segment"]


def _columns(m, **edit):
    for r in _shards(m):
        r["columns"]["weight"].update(edit)


def _set_key(directory, m, index, key):
    """Make saved key ``index`` of "dyn" ``key``, its block's CRC-32 right again."""
    seg = _dyn_shard(m)["keys"]
    path = directory / seg["file"]
    keys = np.fromfile(path, np.int64)
    keys[index] = key
    keys.tofile(path)
    step = seg["block_rows"]
    crcs = [zlib.crc32(keys[lo:lo + step].tobytes()) for lo in range(0, len(keys), step)]
    _edit_manifest(directory, lambda x: _dyn_shard(x)["keys"].update(crc32=crcs))


KEEP_DAMAGE = {
    "crc_last": lambda d, m: _flip_last_block(d, _keep_segments(m)[-1]),
    "crc_first": lambda d, m: _flip_last_block(d, _keep_segments(m)[0]),
    "half": lambda d, m: _edit_manifest(d, lambda x: _shards(x).pop()),
    "twice": lambda d, m: _edit_manifest(d, lambda x: _shards(x).append(_shards(x)[0])),
    "column_missing": lambda d, m: _edit_manifest(
        d, lambda x: _shards(x)[1]["columns"].pop("weight")),
    "keys_bogus": lambda d, m: _edit_manifest(
        d, lambda x: _shards(x)[1].update(keys=_seg(x, 1))),
    "block_rows": lambda d, m: _edit_manifest(
        d, lambda x: _seg(x, 1).update(block_rows=1 << 40, crc32=[0])),
    "crc_count": lambda d, m: _edit_manifest(d, lambda x: _seg(x, 1).update(crc32=[0])),
    "crc_type": lambda d, m: _edit_manifest(
        d, lambda x: _seg(x, 1).update(crc32=["x"] * len(_seg(x, 1)["crc32"]))),
    "count": lambda d, m: _edit_manifest(d, lambda x: _seg(x, 1).update(count=1 << 40)),
    "record_count": lambda d, m: _edit_manifest(
        d, lambda x: _shards(x)[1].update(count=1 << 40)),
    "negative": lambda d, m: _edit_manifest(d, lambda x: _seg(x, 1).update(start=-5)),
    "step_bool": lambda d, m: _edit_manifest(d, lambda x: _seg(x, 1).update(step=True)),
    "traversal": lambda d, m: _edit_manifest(
        d, lambda x: _seg(x, 1).update(file="../../../etc/passwd")),
    "absolute": lambda d, m: _edit_manifest(d, lambda x: _seg(x, 1).update(file="/etc/passwd")),
    "truncated": lambda d, m: os.truncate(d / _keep_segments(m)[1]["file"], 8),
    "missing": lambda d, m: os.unlink(d / _keep_segments(m)[1]["file"]),
    "fifo": lambda d, m: (os.unlink(d / _keep_segments(m)[1]["file"]),
                          os.mkfifo(d / _keep_segments(m)[1]["file"])),
    "shape": lambda d, m: _edit_manifest(d, lambda x: _columns(x, shape=[DIM + 1])),
    "dtype": lambda d, m: _edit_manifest(d, lambda x: _columns(x, dtype="int64")),
    "dtype_junk": lambda d, m: _edit_manifest(d, lambda x: _columns(x, dtype="object")),
    "segments_type": lambda d, m: _edit_manifest(
        d, lambda x: x["tensors"]["keep"].update(shards="x")),
    "record_type": lambda d, m: _edit_manifest(d, lambda x: _shards(x).__setitem__(0, [1])),
    "manifest_junk": lambda d, m: (d / "manifest.json").write_text("{"),
    "manifest_list": lambda d, m: (d / "manifest.json").write_text("[1, 2]"),
    "manifest_gone": lambda d, m: os.unlink(d / "manifest.json"),
    "manifest_link": lambda d, m: (os.unlink(d / "manifest.json"),
                                   os.symlink("/dev/zero", d / "manifest.json")),
    "format": lambda d, m: _edit_manifest(d, lambda x: x.update(format=99)),
    "no_tensor": lambda d, m: _edit_manifest(d, lambda x: x["tensors"].pop("keep")),
    # every CRC right, the entry's shape contradicting its records' rows (issue 37)
    "entry_shape": lambda d, m: _edit_manifest(
        d, lambda x: x["tensors"]["keep"].update(shape=[ROWS, DIM + 1])),
}
DYN_DAMAGE = {
    "crc_weight": lambda d, m: _flip_last_block(d, _dyn_shard(m)["columns"]["weight"]["segment"]),
    "crc_state": lambda d, m: _flip_last_block(d, _dyn_shard(m)["columns"]["sum"]["segment"]),
    "crc_keys": lambda d, m: _flip_last_block(d, _dyn_shard(m)["keys"]),
    "shards_type": lambda d, m: _edit_manifest(
        d, lambda x: x["tensors"]["dyn"].update(shards="x")),
    "shard_empty": lambda d, m: _edit_manifest(
        d, lambda x: x["tensors"]["dyn"].update(shards=[{}])),
    "column_shape": lambda d, m: _edit_manifest(
        d, lambda x: _dyn_shard(x)["columns"]["weight"].update(shape=[DIM + 1])),
    "column_dtype": lambda d, m: _edit_manifest(
        d, lambda x: _dyn_shard(x)["columns"]["weight"].update(dtype="int8")),
    "column_renamed": lambda d, m: _edit_manifest(
        d, lambda x: _dyn_shard(x)["columns"].update(
            nope=_dyn_shard(x)["columns"].pop("sum"))),
    "count": lambda d, m: _edit_manifest(d, lambda x: _dyn_shard(x).update(count=1 << 40)),
    "count_less": lambda d, m: _edit_manifest(d, lambda x: _dyn_shard(x).update(count=3)),
    "keys_missing": lambda d, m: os.unlink(d / _dyn_shard(m)["keys"]["file"]),
    "state_truncated": lambda d, m: os.truncate(
        d / _dyn_shard(m)["columns"]["sum"]["segment"]["file"], 4),
    "keys_type": lambda d, m: _edit_manifest(d, lambda x: _dyn_shard(x).update(keys="x")),
    "kind": lambda d, m: _edit_manifest(d, lambda x: x["tensors"]["dyn"].update(kind="array")),
    # checkpoints a save never writes, every CRC right (issue 37): a key the hash index
    # reserves, an entry whose shape (v3) or dim (v2) contradicts its records' rows, and
    # a record of state without its weight
    "keys_reserved": lambda d, m: _set_key(d, m, 5, INT64_MIN),
    "keys_marker": lambda d, m: _set_key(d, m, 0, INT64_MIN + 1),
    "entry_shape": lambda d, m: _edit_manifest(
        d, lambda x: x["tensors"]["dyn"].update(shape=[None, DIM + 1])),
    "v2_dim": lambda d, m: _edit_manifest(d, lambda x: x["tensors"].update(dyn={
        "kind": "store", "dim": DIM + 1, "dtype": "float32",
        "shards": x["tensors"]["dyn"]["shards"]})),
    "state_alone": lambda d, m: _edit_manifest(d, lambda x: x["tensors"]["dyn"]["shards"].append(
        dict(_dyn_shard(x), columns={"sum": _dyn_shard(x)["columns"]["sum"]}))),
}


def damaged_checkpoints(tmp_path, monkeypatch):
    """{"<ck_keep:damage>": directory, ...}: checkpoints of "keep" and "dyn" (rows other
    than the server's, segments of several small blocks), each damaged one way."""
    monkeypatch.setattr(segments, "BLOCK_BYTES", 2 * DIM * 4)  # 2 rows a block
    rng = np.random.default_rng(7)
    kv = LocalKVClient()
    kv.init_data("keep", (ROWS, DIM), "float32", range_policy(ROWS, 2))
    kv.push("keep", np.arange(ROWS), rng.standard_normal((ROWS, DIM)).astype(np.float32))
    checkpoint.save(tmp_path / "ck_keep", kv, ["keep"], {})
    skv = LocalKVClient()
    skv.add_table("dyn", HashStore(DIM))
    skv.init_optimizer("dyn", "adagrad", {"initial_accumulator_value": 0.5})
    skv.push("dyn", KEYS, rng.standard_normal((len(KEYS), DIM)).astype(np.float32))
    checkpoint.save(tmp_path / "ck_dyn", skv, ["dyn", "dyn~opt~sum"], {})
    out = {"<ck_keep>": str(tmp_path / "ck_keep"), "<ck_dyn>": str(tmp_path / "ck_dyn")}
    for table, damages in (("keep", KEEP_DAMAGE), ("dyn", DYN_DAMAGE)):
        for what, damage in damages.items():
            d = tmp_path / f"ck_{table}_{what}"
            shutil.copytree(tmp_path / f"ck_{table}", d)
            damage(d, json.loads((d / "manifest.json").read_text()))
            out[f"<ck_{table}:{what}>"] = str(d)
    return out


# --- request slots ------------------------------------------------------------------


def in_shm(size, layout, fds=(), service=Service.PUSH, name="keep", fields=None, **extra):
    """An InShm frame (built by hand: hostile fields too) carrying descriptors ``fds``."""
    push = Push(name="keep", parts=[0], counts=[2], ids=ids(0, 9), values=grads(2))
    body = {"service": int(service), "fields": push.encode().fields if fields is None
            else fields, "size": size, "layout": layout, **extra}
    return Frame(int(Service.IN_SHM), name, body, [], 0, list(fds))


def in_shm_messages(job, tmp_path):
    """InShm frames through hostile descriptors and layouts; each wraps a request that
    would be valid if its arrays were read, so only the slot checks refuse it (or an
    invalid request in a valid slot)."""
    layout = [[4, [2], 0], [1, [2, DIM], 64]]  # int64 ids, float32 values (dtype codes)
    yield in_shm(1 << 20, layout)  # no slot handed over on this connection yet
    # The old protocol: a path to open, no descriptor (nothing is ever opened by name).
    for path in (f"/dev/shm/distemb-p{os.getpid()}-{job}-t1-s0-0123456789ab-0",
                 "/etc/passwd", "relative"):
        yield in_shm(1 << 20, layout, path=path)
        body = in_shm(1 << 20, layout, path=path)
        del body.fields["size"]
        yield body
    # Every kind of descriptor that is not a sealed memory file of its declared size.
    for kind in sorted(HOSTILE_FDS):
        fd, size = hostile_fd(kind, str(tmp_path))
        yield in_shm(max(size, 1), layout, [fd])
    size = 1 << 16
    yield in_shm(size, layout, [sealed(size), sealed(size)])  # two slots in one frame
    yield in_shm(size, layout, [sealed(size) for _ in range(MAX_FDS + 1)])  # truncated
    # Descriptors on frames that take none: closed unused (the leak check sees them).
    bad_push = Push(name="nope", parts=[0], counts=[2], ids=ids(0, 9), values=grads(2))
    yield Frame(**{**vars(bad_push.encode()), "fds": [sealed(size)]})
    yield Frame(**{**vars(Hello(rank=0, token="0" * 32).encode()), "fds": [sealed(size)]})
    # A real sealed slot holding a bad id: mapped, then refused by the id check; its
    # trainer cannot shrink or grow it (the SIGBUS race of old cannot be set up).
    slot = RequestSlot(job, 1, 0)
    lay = slot.write([ids(0, ROWS + 1), grads(2)])
    fd = slot.take_fd()
    rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    for n in (0, 4096, 2 * slot.size):
        with pytest.raises(PermissionError):
            os.ftruncate(rw, n)
    os.close(rw)

    def with_slot(*args, **kw):  # a copy of the slot's descriptor for each frame
        return in_shm(*args, **kw, fds=[os.dup(fd)])
    yield with_slot(slot.size, lay)
    yield in_shm(slot.size, lay)  # the same, from the slot this connection handed over
    yield in_shm(slot.size + 64, lay)  # a size that is not the slot's
    yield with_slot(slot.size + 64, lay)
    yield with_slot(slot.size - 64, lay)
    # Hostile layouts and wrapped requests in the valid slot.
    upd = Update(name="keep", rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10}, seq=1,
                 exact=False, parts=[0], counts=[2], ids=ids(0, 9), grads=grads(2))
    lay = slot.write([ids(0, ROWS), grads(2)])  # any request it wraps is refused
    bad_layouts = [[[4, [2], 1 << 62], lay[1]], [[4, [1 << 40], 0], lay[1]],
                   [[4, [-1], 0], lay[1]], [[99, [2], 0], lay[1]], [lay[0], [1, [2, DIM], 3]],
                   [lay[0]], "x", [[4, [2], 0]] * 9, [[4, [2, 2, 2, 2, 2], 0], lay[1]],
                   [[4, [2], True], lay[1]], [[4, [2], 0], [1, [2, DIM + 1], 64]],
                   [[4, [2], 0], [2, [2, DIM], 64]], [[5, [2], 0], lay[1]],
                   [[4, [2], 0], [1, [2, 1 << 40, 1 << 40], 64]]]
    for bad in bad_layouts:
        yield with_slot(slot.size, bad)
    for fields in ({"parts": [0], "counts": [3]}, {"parts": [1], "counts": [2]},
                   {"parts": "x"}, {}, dict(upd.encode().fields, hyper={"clr": NAN,
                                                                          "eps": 1e-10})):
        for svc in (Service.PUSH, Service.UPDATE):
            yield with_slot(slot.size, lay, service=svc, fields=fields)
    for svc in (Service.PULL, Service.CREATE, Service.IN_SHM, 999):
        yield with_slot(slot.size, lay, service=svc)
    lay = slot.write([ids(0, 99), grads(2)])  # a bad id read from the slot
    yield with_slot(slot.size, lay, service=Service.UPDATE, fields=upd.encode().fields)
    yield with_slot(slot.size, lay, name="keep~opt~sum")
    yield with_slot(slot.size, [lay[0], [1, [2, DIM + 1], 64]], name="dyn")
    os.close(fd)
    slot.close()
