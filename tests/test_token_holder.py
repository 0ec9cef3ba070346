"""A token holder cannot crash a server or change a row with a refused request (issue 18).

A fuzzer that has said a valid Hello (it holds the job token, as any trainer or any bug
in one does) sends every request kind with hostile fields: wrong dtypes and ranks,
negative and huge ids, huge shapes and counts, NaN and infinite hyperparameters and
initial values, bad and reserved names, mismatched lengths, request slots that are
links, FIFOs, directories, files truncated after the server mapped them or another
job's, and loads of damaged checkpoints (a corrupt late block, half or double coverage,
missing, truncated or renamed segments, lying manifests). Every message is built to be
invalid, so the oracle is exact: each must be answered with an error, the server process
must stay up, and every row and optimizer state of the tables it attacks must be the
same, bit for bit, afterwards (checked after each kind). The seed is fixed."""
import json
import math
import os
import shutil
import uuid

import numpy as np
import pytest

from mp_helper import ProcessGroup
from test_hostile import Server, SpecCreate, ask

from distemb import checkpoint
from distemb.kernels.half import BFLOAT16
from distemb.kvstore import LocalKVClient, segments
from distemb.partition import range_policy
from distemb.stores import HashStore
from distemb.stores.spec import HashTableSpec
from distemb.transport.messages import (Barrier, Bye, Create, Drop, Hello, InShm, Load,
                                        OptInit, Pull, Push, Save, Service, ShmInfo,
                                        Export, Get, Info, Remove, Update, VersionedPull)
from distemb.transport.shm import RequestSlot

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SHM = "/dev/shm"
ROWS, DIM = 10, 4
KEYS = np.array([3, -7, 2 ** 40, 11, 12, 13, 14, 15], np.int64)  # the keyed table's keys
PER_KIND = 40  # messages per request kind (damaged checkpoints and slots: each one more)
NAN, INF = math.nan, math.inf


def ids(*v):
    return np.array(v, np.int64)


def grads(n, dim=DIM, dtype=np.float32):
    return np.ones((n, dim), dtype)


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
    Create: (dict(name="keep", dtype="float32", row_shape=[DIM], parts=[0], part_rows=[ROWS]),
             [{"name": n} for n in BAD_NAMES[2:4] + ["", "x" * 300, "\x00"]] +
             [{"dtype": d} for d in ("float128", "object", "", "int64", "<f4")] +
             [{"row_shape": s} for s in ([DIM + 1], [0], [1 << 30, 1 << 30], [-1], [1] * 4)] +
             [{"part_rows": r} for r in ([ROWS + 1], [1 << 40], [0, 1], [-1])] +
             [{"name": "new", "part_rows": [1 << 38]}, {"name": "new", "row_shape": [1 << 20],
                                                      "part_rows": [1 << 20]},
              {"name": "new", "parts": [0, 1], "part_rows": [1, 1 << 40]},
              {"name": "dyn"}, {"name": "half", "dtype": "float32"},
              {"rounding_seed": -2}, {"rounding_seed": 5}]),
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
    Save: (dict(name="keep", directory="<tmp>", save_id="0123abcd", parts=[0], starts=[0],
                steps=[1]),
           [{"name": n} for n in BAD_NAMES[:2]] +
           [{"save_id": s} for s in ("../../x", "", "ZZZZZZZZ", "a" * 300, "/etc/x")] +
           [{"directory": d} for d in ("relative", "", "/proc/nope", "/dev/null")] +
           [{"parts": [1]}, {"steps": [0]}, {"steps": [-1]}, {"starts": [0, 1]},
            {"parts": [0, 0], "starts": [0, 0], "steps": [1, 1, 1]},
            {"columns": ["nope"]}, {"columns": ["weight", "weight"]}, {"columns": "weight"},
            {"columns": ["~version"]}, {"columns": ["x" * 300]}, {"name": "dyn"},
            {"starts": [], "steps": []}, {"name": "keep~opt~sum"},
            {"name": "dyn", "starts": [], "steps": [], "parts": [1]},
            {"name": "dyn", "starts": [], "steps": [], "columns": ["nope"]}]),
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
    Get: (dict(name="dyn", mode="get", column="weight", ids=KEYS[:2]),
                [{"name": n} for n in BAD_NAMES] +
                [{"mode": m} for m in ("nope", "", None)] +
                [{"column": c} for c in ("nope", "~version", "", "x" * 300)] +
                [{"ids": i} for i in BAD_IDS[5:] + [ids(999), ids(-5)]]),
    Remove: (dict(name="dyn", ids=ids(1 << 50)),
                  [{"name": n} for n in BAD_NAMES] +
                  [{"ids": i} for i in BAD_IDS[5:]] + [{"name": "keep", "ids": ids(1)}]),
    Info: (dict(name="dyn", evict_to=-1, policy=""),
                [{"name": n} for n in BAD_NAMES] +
                [{"name": "keep"}, {"name": "keep", "evict_to": 0}, {"evict_to": "x"},
                 {"evict_to": 0, "policy": "nope"}, {"evict_to": 1 << 62, "policy": "x"}]),
    Export: (dict(name="dyn", start=0, count=10, columns=[]),
                  [{"name": n} for n in BAD_NAMES] +
                  [{"start": -1}, {"count": 0}, {"count": -1}, {"columns": ["nope"]},
                   {"columns": ["weight", "x" * 300]}, {"columns": "weight"},
                   {"name": "keep"}]),
    Load: (dict(name="keep", directory="<ck_keep:crc_last>", parts=[0], starts=[0], steps=[1]),
           [{"name": n} for n in BAD_NAMES] +
           [{"directory": "<ck_keep>", "parts": [1]}, {"directory": "<ck_keep>", "steps": [0]},
            {"directory": "<ck_keep>", "starts": [1]},
            {"directory": "<ck_keep>", "steps": [2]},
            {"directory": "<ck_keep>", "parts": [0, 1], "starts": [0, 10], "steps": [1, 1]},
            {"directory": "<ck_keep>", "name": "half"},
            {"directory": "<ck_keep>", "name": "dyn"},
            {"directory": "<ck_keep>", "starts": [1 << 62]},
            {"directory": "<ck_keep>", "columns": ["sum"]},
            {"directory": "<ck_keep>", "columns": ["nope"]},
            {"directory": "<ck_keep>", "columns": ["~version"]},
            {"directory": "<ck_keep>", "starts": [], "steps": []},
            {"directory": "<ck_dyn>", "name": "dyn", "starts": [], "steps": [],
             "parts": [1]},
            {"directory": "<ck_keep>", "name": "dyn", "starts": [], "steps": []}]),
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


# --- request slots -------------------------------------------------------------------


class Slots:
    """Files named as request slots of the server's job (and of another job), each made
    hostile: a link to a file outside /dev/shm, a FIFO, a directory, a file of another
    job, and a real slot truncated after the server mapped it."""

    def __init__(self, job, tmp_path):
        self.job, self.made = job, []
        self.slot = RequestSlot(job, 1, 0)
        self.made.append(self.slot)
        outside = tmp_path / "outside.bin"
        outside.write_bytes(np.arange(1 << 16, dtype=np.int64).tobytes())
        self.link = self._name()
        os.symlink(outside, self.link)
        self.fifo = self._name()
        os.mkfifo(self.fifo)
        self.dir = self._name()
        os.mkdir(self.dir)
        other = RequestSlot(f"x{job}", 1, 0)
        self.made.append(other)
        self.other, _ = other.write([np.zeros(4096, np.uint8)])
        self.plain_outside = str(tmp_path / os.path.basename(self._name()))
        with open(self.plain_outside, "wb") as f:
            f.write(bytes(1 << 16))

    def _name(self):
        return f"{SHM}/distemb-p{os.getpid()}-{self.job}-t1-s0-{uuid.uuid4().hex[:12]}-0"

    def close(self):
        for s in self.made:
            s.close()
        for p in (self.link, self.fifo):
            if os.path.lexists(p):
                os.unlink(p)
        if os.path.isdir(self.dir):
            os.rmdir(self.dir)


def in_shm_messages(slots, rng):
    """InShm requests through hostile slot files; each names a Push or Update that
    would be valid if its arrays were read, so only the slot checks refuse it."""
    push = Push(name="keep", parts=[0], counts=[2], ids=ids(0, 9), values=grads(2))
    layout = [[4, [2], 0], [1, [2, DIM], 64]]  # int64 ids, float32 values (dtype codes)
    for path in (slots.link, slots.fifo, slots.dir, slots.other, slots.plain_outside,
                 "relative", f"{SHM}/../tmp/x", slots.link + "/x"):
        yield InShm(name="keep", service=int(Service.PUSH), fields=push.encode().fields,
                    path=path, layout=layout)
    # A real slot holding a bad id: mapped by the server (and refused by the id check);
    # then truncated to nothing, and named again with arrays past the new end (SIGBUS
    # if the server trusted its old mapping).
    path, lay = slots.slot.write([ids(0, ROWS + 1), grads(2)])
    yield InShm(name="keep", service=int(Service.PUSH), fields=push.encode().fields,
                path=path, layout=lay)
    for size in (4096, 4096, 0):  # smaller than mapped; the same, remapped; empty
        os.truncate(path, size)
        yield InShm(name="keep", service=int(Service.PUSH), fields=push.encode().fields,
                    path=path, layout=[[4, [2], 8192], [1, [2, DIM], 8192 + 64]])
    # Hostile layouts and wrapped requests in a valid slot of the same trainer.
    fresh = RequestSlot(slots.job, 1, 0)
    slots.made.append(fresh)
    path, lay = fresh.write([ids(0, ROWS), grads(2)])  # any request it wraps is refused
    upd = Update(name="keep", rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10}, seq=1,
                 exact=False, parts=[0], counts=[2], ids=ids(0, 9), grads=grads(2))
    bad_layouts = [[[4, [2], 1 << 62], lay[1]], [[4, [1 << 40], 0], lay[1]],
                   [[4, [-1], 0], lay[1]], [[99, [2], 0], lay[1]], [lay[0], [1, [2, DIM], 3]],
                   [lay[0]], "x", [[4, [2], 0]] * 9, [[4, [2, 2, 2, 2, 2], 0], lay[1]],
                   [[4, [2], True], lay[1]], [[4, [2], 0], [1, [2, DIM + 1], 64]],
                   [[4, [2], 0], [2, [2, DIM], 64]], [[5, [2], 0], lay[1]],
                   [[4, [2], 0], [1, [2, 1 << 40, 1 << 40], 64]]]
    for bad in bad_layouts:
        yield InShm(name="keep", service=int(Service.PUSH), fields=push.encode().fields,
                    path=path, layout=bad)
    for fields in ({"parts": [0], "counts": [3]}, {"parts": [1], "counts": [2]},
                   {"parts": "x"}, {}, dict(upd.encode().fields, hyper={"clr": NAN,
                                                                          "eps": 1e-10})):
        for svc in (Service.PUSH, Service.UPDATE):
            yield InShm(name="keep", service=int(svc), fields=fields, path=path, layout=lay)
    for svc in (Service.PULL, Service.CREATE, Service.IN_SHM, 999):
        yield InShm(name="keep", service=int(svc), fields=push.encode().fields, path=path,
                    layout=lay)
    path, lay = fresh.write([ids(0, 99), grads(2)])  # a bad id read from the slot
    yield InShm(name="keep", service=int(Service.UPDATE), fields=upd.encode().fields,
                path=path, layout=lay)
    yield InShm(name="keep~opt~sum", service=int(Service.PUSH), fields=push.encode().fields,
                path=path, layout=lay)
    yield InShm(name="dyn", service=int(Service.PUSH), fields=push.encode().fields,
                path=path, layout=[lay[0], [1, [2, DIM + 1], 64]])


# --- the test ------------------------------------------------------------------------


class Holder:
    """A connection of a token holder (Hello as rank 1), remade when the server hangs up."""

    def __init__(self, srv):
        self.srv, self.conn = srv, srv.connect(hello_rank=1)

    def ask(self, msg):
        frame = ask(self.conn, msg)
        if frame is None or (frame.service == Service.ERROR and frame.fields.get("kind") in
                             ("TransportError", "RefusedError")):
            self.conn.close()
            self.conn = self.srv.connect(hello_rank=1)
        return frame

    def ok(self, msg):
        frame = self.ask(msg)
        assert frame is not None and frame.service == Service.REPLY, \
            (type(msg).__name__, frame and frame.fields)
        return frame

    def state(self):
        """Every row, state row and key of the attacked tables, as bytes."""
        out = {}
        for name in ("keep", "keep~opt~sum", "half"):
            rows = self.ok(Pull(name=name, parts=[0], counts=[ROWS], ids=np.arange(ROWS)))
            out[name] = (rows.arrays[0].dtype, rows.arrays[0].tobytes())
        exp = self.ok(Export(name="dyn", start=0, count=1000, columns=[]))
        order = np.argsort(exp.arrays[0])
        out["dyn"] = [exp.fields["columns"]] + [a[order].tobytes() for a in exp.arrays]
        info = self.ok(Info(name="dyn"))
        out["dyn_info"] = (info.fields["size"], info.fields["columns"])
        vp = self.ok(VersionedPull(name="keep", parts=[0], counts=[ROWS], ids=np.arange(ROWS),
                                   have=np.full(ROWS, -2, np.int64), states=["sum"]))
        out["versions"] = [a.tobytes() for a in vp.arrays]
        return out


def short(msg):
    """A message, for an assertion's text (fields cut to 80 characters)."""
    return f"{type(msg).__name__}({ {k: str(v)[:80] for k, v in vars(msg).items()} })"


def _resolve(kw, paths, tmp_path):
    for k, v in kw.items():
        if isinstance(v, str) and v.startswith("<") and v.endswith(">"):
            kw[k] = str(tmp_path / "saves") if v == "<tmp>" else paths[v]
    return kw


def messages_of(cls, rng, paths, tmp_path, token):
    """PER_KIND invalid messages of ``cls``: its base with 1 to 3 distinct mutations."""
    base, mutations = KINDS[cls]
    for _ in range(PER_KIND):
        kw = dict(base)
        picks = rng.choice(len(mutations), size=min(len(mutations), int(rng.integers(1, 4))),
                           replace=False)
        touched = set()
        for i in picks:  # mutations of distinct fields: a later one never undoes another
            if touched.isdisjoint(mutations[i]):
                kw.update(mutations[i])
                touched.update(mutations[i])
        if cls is Hello and kw["token"] is None:
            kw["token"] = token
        yield cls(**_resolve(kw, paths, tmp_path))
    if cls is Load:  # every damaged checkpoint of "keep" and of "dyn", as it is
        for key in sorted(k for k in paths if k.startswith("<ck_keep:")):
            yield cls(**dict(base, directory=paths[key]))
        for key in sorted(k for k in paths if k.startswith("<ck_dyn:")):
            yield cls(**dict(base, name="dyn", directory=paths[key], starts=[], steps=[]))


def test_a_token_holder_cannot_crash_the_server_or_change_a_row(tmp_path, monkeypatch):
    rng = np.random.default_rng(20261126)
    paths = damaged_checkpoints(tmp_path, monkeypatch)
    (tmp_path / "saves").mkdir()
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, shared_memory=True, timeout_s=2.0)
        holder = Holder(srv)
        # The attacked tables, made by the holder itself (valid requests).
        holder.ok(Create(name="keep", dtype="float32", row_shape=[DIM], parts=[0],
                         part_rows=[ROWS]))
        holder.ok(Push(name="keep", parts=[0], counts=[ROWS], ids=np.arange(ROWS),
                       values=rng.standard_normal((ROWS, DIM)).astype(np.float32)))
        holder.ok(OptInit(name="keep", rule="adagrad",
                          options={"initial_accumulator_value": 0.1}, parts=[0]))
        holder.ok(Update(name="keep", rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10},
                         seq=1, exact=False, parts=[0], counts=[3], ids=ids(0, 4, 9),
                         grads=rng.standard_normal((3, DIM)).astype(np.float32)))
        holder.ok(Create(name="half", dtype="bfloat16", row_shape=[DIM], parts=[0],
                         part_rows=[ROWS]))
        holder.ok(Push(name="half", parts=[0], counts=[ROWS], ids=np.arange(ROWS),
                       values=np.arange(ROWS * DIM, dtype=np.uint16).reshape(ROWS, DIM)
                       .view(BFLOAT16)))
        holder.ok(SpecCreate(name="dyn", **HashTableSpec(DIM).fields()))
        holder.ok(OptInit(name="dyn", rule="adagrad",
                          options={"initial_accumulator_value": 0.25}, parts=[0]))
        holder.ok(Push(name="dyn", parts=[0], counts=[len(KEYS)], ids=KEYS,
                       values=rng.standard_normal((len(KEYS), DIM)).astype(np.float32)))
        before = holder.state()
        slots = Slots(srv.cfg.job_id, tmp_path)
        sent, errors = {}, {}
        try:
            kinds = [(cls.__name__, messages_of(cls, rng, paths, tmp_path, srv.cfg.job_token))
                     for cls in KINDS] + [("InShm", in_shm_messages(slots, rng))]
            for kind, msgs in kinds:
                for msg in msgs:
                    frame = holder.ask(msg)
                    sent[kind] = sent.get(kind, 0) + 1
                    assert srv.proc.poll() is None, f"server died on {short(msg)}"
                    assert frame is not None, f"no answer to {short(msg)}"
                    assert frame.service == Service.ERROR, \
                        f"accepted: {short(msg)} -> {str(frame.fields)[:200]}"
                    errors[kind] = errors.get(kind, 0) + 1
                after = holder.state()
                assert after == before, \
                    f"refused {kind}s changed {[k for k in before if after[k] != before[k]]}"
        finally:
            slots.close()
        print(f"token-holder fuzz: {sum(sent.values())} messages, {sum(errors.values())} "
              f"errors; per kind {sent}")
        assert sent == errors and len(sent) == len(KINDS) + 1
        # Legitimate requests of both real trainers still work afterwards.
        srv.init_data("w", 4, 2)
        srv.real.push("w", np.array([1]), np.ones((1, 2), np.float32))
        assert srv.real.pull("w", np.array([1])).tolist() == [[1.0, 1.0]]
        holder.conn.close()
        srv.finish(group)
