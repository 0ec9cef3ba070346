"""What one request can make a server allocate is bounded (issue 18): a pull, versioned
pull, get or export whose reply would exceed the job's ``max_message_bytes``, a lookup
that would insert that much, a file table preallocating more than its disk holds, a frame
claiming 2**40 ids, and any frame with a payload before the connection's Hello, are all
refused before the server allocates, with the numbers, and change nothing."""
import json
import os
import shutil
import uuid

import numpy as np
import pytest

from mp_helper import ProcessGroup
from test_hostile import Server, SpecCreate, ask, closed

from distemb.stores.dense import DenseSpec
from distemb.kvstore.limits import check_request
from distemb.stores.spec import FileTableSpec, HashTableSpec
from distemb.transport.base import HEADER, MAGIC, VERSION
from distemb.transport.messages import (Create, Export, Get, Hello, Info, Load, Pull, Push,
                                        Service, VersionedPull)
from distemb.transport.tcp import MAX_HELLO_BYTES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SHM = "/dev/shm"
MIB = 1 << 20
WIDE = 1 << 16  # floats per row: 256 KiB rows, 4 of them are the limit


def refused(frame, match="would make this server allocate"):
    return frame is not None and frame.service == Service.ERROR and \
        match in frame.fields["message"]


def test_check_request_names_both_numbers():
    check_request(MIB, MIB, "pull")
    with pytest.raises(Exception, match=r"pull: would make this server allocate 1,048,577 "
                                        r"bytes, over the limit of 1,048,576"):
        check_request(MIB + 1, MIB, "pull")


def test_requests_over_the_limit_are_refused_before_the_server_allocates(tmp_path):
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, max_message_bytes=MIB)
        conn = srv.connect()
        assert ask(conn, Create.of_spec("wide", DenseSpec((8, WIDE), "float32"))).service == Service.REPLY  # 2 MiB: a table
        ids = np.arange(5, dtype=np.int64)  # 5 rows of 256 KiB: 1.25 MiB
        for msg in (Pull(name="wide", parts=[0], counts=[5], ids=ids),
                    VersionedPull(name="wide", parts=[0], counts=[5], ids=ids,
                                  have=np.full(5, -2, np.int64), states=[])):
            frame = ask(conn, msg)
            assert refused(frame), frame.fields
            assert "1,310,720 bytes" in frame.fields["message"] or \
                "1,310,800 bytes" in frame.fields["message"], frame.fields
        ok = ask(conn, Pull(name="wide", parts=[0], counts=[3], ids=ids[:3]))
        assert ok.service == Service.REPLY and ok.arrays[0].shape == (3, WIDE)
        # A cache's validation of 5 rows it holds fresh: only stale rows are sent (none).
        have = np.concatenate([ask(conn, VersionedPull(
            name="wide", parts=[0], counts=[len(k)], ids=k, have=np.full(len(k), -2, np.int64),
            states=[])).arrays[1] for k in (ids[:3], ids[3:])])
        fresh = ask(conn, VersionedPull(name="wide", parts=[0], counts=[5], ids=ids, have=have,
                                        states=[]))
        assert fresh.service == Service.REPLY and fresh.arrays[2].shape == (0, WIDE)
        # A lookup in a dynamic table would insert 1.25 MiB of rows: refused, none inserted.
        assert ask(conn, SpecCreate(name="dyn", **HashTableSpec(WIDE).fields())
                   ).service == Service.REPLY
        assert refused(ask(conn, Pull(name="dyn", parts=[0], counts=[5], ids=ids)))
        assert ask(conn, Info(name="dyn")).fields["size"] == 0
        for k in range(5):  # 5 keys, pushed one at a time (each frame under the limit)
            ask(conn, Push(name="dyn", parts=[0], counts=[1], ids=ids[k:k + 1],
                           values=np.full((1, WIDE), k, np.float32)))
        assert ask(conn, Info(name="dyn")).fields["size"] == 5
        assert refused(ask(conn, Get(name="dyn", mode="get", column="weight", parts=[0],
                                     counts=[5], ids=ids)))
        assert refused(ask(conn, Export(name="dyn", part=0, start=0, count=10, columns=[])))
        part = ask(conn, Export(name="dyn", part=0, start=2, count=10, columns=[]))
        assert part.service == Service.REPLY and part.arrays[1].shape == (3, WIDE)
        assert part.arrays[1][:, 0].tolist() == [2.0, 3.0, 4.0]
        # A file table whose shard the disk cannot hold, preallocated: refused up front.
        spec = FileTableSpec(str(tmp_path / "ft"), 1 << 40, 4)
        frame = ask(conn, SpecCreate(name="ft", **spec.fields()))
        assert refused(frame, "bytes on disk"), frame.fields
        assert not (tmp_path / "ft").exists()
        # A header claiming 2**40 ids: refused by the frame limit, the connection closed.
        conn.sock.sendall(HEADER.pack(MAGIC, VERSION, Service.PULL, 0, 0, 1, 0, 8 << 40))
        frame = conn.recv()
        assert frame.service == Service.ERROR and "over the limit of 1048576" in \
            frame.fields["message"], frame.fields
        assert closed(conn)
        srv.finish(group)


def test_a_connection_sends_no_payload_before_its_hello(tmp_path):
    with ProcessGroup() as group:
        srv = Server(tmp_path, group)
        conn = srv.connect(hello_rank=None)
        n = MAX_HELLO_BYTES // 8 + 1
        frame = ask(conn, Pull(name="w", parts=[0], counts=[n], ids=np.zeros(n, np.int64)))
        assert frame.service == Service.ERROR and "over the limit" in frame.fields["message"]
        assert closed(conn)
        conn = srv.connect(hello_rank=None)  # a Hello still gets in, then big frames do
        assert ask(conn, Hello(rank=1, token=srv.cfg.job_token)).service == Service.REPLY
        frame = ask(conn, Pull(name="w", parts=[0], counts=[n], ids=np.zeros(n, np.int64)))
        assert frame.service == Service.ERROR and "no shard" in frame.fields["message"]
        srv.finish(group)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_a_keyed_checkpoint_bigger_than_the_machine_is_refused_before_it_is_read(tmp_path):
    """A dynamic table's checkpoint of 2**37 keys (sparse files of the right sizes, 5 TiB
    in all): refused with the numbers before any block is read (a real one would be read
    for hours, its CRCs all right, and then fail to insert)."""
    from distemb import checkpoint
    from distemb.kvstore import LocalKVClient
    from distemb.stores import HashStore
    kv = LocalKVClient()
    kv.add_table("dyn", HashStore(4))
    kv.push("dyn", np.array([1, 2], np.int64), np.ones((2, 4), np.float32))
    checkpoint.save(tmp_path / "ck", kv, ["dyn"], {})
    path = tmp_path / "ck" / "manifest.json"
    manifest = json.loads(path.read_text())
    n = 1 << 37
    rec = manifest["tensors"]["dyn"]["shards"][0]
    for seg, row_bytes in [(rec["keys"], 8)] + [(c["segment"], 16)
                                                for c in rec["columns"].values()]:
        seg.update(count=n, block_rows=n // 256, crc32=[0] * 256)
        os.truncate(tmp_path / "ck" / seg["file"], n * row_bytes)
    rec["count"] = n
    path.write_text(json.dumps(manifest))
    with ProcessGroup() as group:
        srv = Server(tmp_path, group)
        conn = srv.connect()
        assert ask(conn, SpecCreate(name="dyn", **HashTableSpec(4).fields())
                   ).service == Service.REPLY
        frame = ask(conn, Load(name="dyn", directory=str(tmp_path / "ck"), parts=[0]))
        assert refused(frame, "load of 137,438,953,472 keys into 'dyn': needs"), frame.fields
        assert ask(conn, Info(name="dyn")).fields["size"] == 0
        srv.finish(group)


def test_a_segment_whose_blocks_exceed_the_machine_is_refused_before_one_is_read(tmp_path):
    """An array table's checkpoint whose segment claims 2**46 rows (a sparse 1 PiB file
    in a tmpfs, blocks of 4 TiB as a save of that many rows would make them): loading
    the table's 10 rows must not allocate the block holding them."""
    from distemb import checkpoint
    from distemb.kvstore import LocalKVClient
    from distemb.partition import range_policy
    kv = LocalKVClient()
    kv.init_data("w", (10, 4), "float32", range_policy(10))
    checkpoint.save(tmp_path / "ck", kv, ["w"], {})
    ck = f"{SHM}/test-harden-ck-{uuid.uuid4().hex}"  # a tmpfs: files of any sparse size
    shutil.copytree(tmp_path / "ck", ck)
    try:
        manifest = json.loads(open(f"{ck}/manifest.json", encoding="utf-8").read())
        (rec,) = manifest["tensors"]["w"]["shards"]
        seg = rec["columns"]["weight"]["segment"]
        n = 1 << 46
        seg.update(count=n, block_rows=n // 256, crc32=[0] * 256)
        rec["count"] = n
        os.truncate(f"{ck}/{seg['file']}", n * 16)
        with open(f"{ck}/manifest.json", "w", encoding="utf-8") as f:
            json.dump(manifest, f)
        with ProcessGroup() as group:
            srv = Server(tmp_path, group)
            srv.init_data("w", 10, 4)
            srv.real.push("w", np.arange(10), np.full((10, 4), 3.0, np.float32))
            conn = srv.connect()
            frame = ask(conn, Load(name="w", directory=ck, parts=[0]))
            assert refused(frame, "a block of 274,877,906,944 rows: needs 4,398,046,511,104 "
                                  "bytes"), frame.fields
            np.testing.assert_array_equal(srv.real.pull("w", np.arange(10)),
                                          np.full((10, 4), 3.0, np.float32))
            srv.finish(group)
    finally:
        shutil.rmtree(ck)
