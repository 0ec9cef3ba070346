"""Consistent reads: a pull never sees a row half-updated, over TCP (the server's
reader/writer locks) or from /dev/shm (the shards' seqlock), while another trainer's
updates run concurrently. Every update keeps all elements of a row equal, so a torn
row is one whose elements differ."""
import threading

import numpy as np
import pytest

from mp_helper import ProcessGroup, cluster_dict, write_json

from distemb.config import parse_cluster_config
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy
from distemb.rules import SGDHyper
from distemb.stores.file import FileTableSpec

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
ROWS, DIM, UPDATES = 64, 4096, 150


def both(clients, fn):
    """Run ``fn(client)`` on every client at once (collective calls)."""
    threads = [threading.Thread(target=fn, args=(c,)) for c in clients[1:]]
    for t in threads:
        t.start()
    fn(clients[0])
    for t in threads:
        t.join(60)


@pytest.mark.parametrize("table", ["array", "file"])
@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_pulls_never_see_a_torn_row_during_concurrent_updates(tmp_path, shm, table):
    """``file``: a file table's rows, which a co-located reader maps from the file under
    a seqlock counter in shared memory."""
    raw = cluster_dict(1, num_trainers=2, shared_memory=shm, timeout_s=20.0)
    cfg = parse_cluster_config(raw)
    with ProcessGroup() as group:
        group.spawn_servers(write_json(tmp_path / "c.json", raw), 1)
        writer = RemoteKVClient(cfg, 0)
        reader = RemoteKVClient(cfg, 1)
        if table == "file":
            spec = FileTableSpec(str(tmp_path / "w"), num_rows=ROWS, dim=DIM,
                                 preallocate=False)
            both([writer, reader], lambda c: c.create_table("w", spec))
            assert (("w", 0) in reader.servers.mapped) == shm  # read in place where co-located
        else:
            both([writer, reader], lambda c: c.init_data("w", (ROWS, DIM), "float32",
                                                        range_policy(ROWS)))
        both([writer, reader], lambda c: c.init_optimizer("w", "sgd", {}))
        ids = np.arange(ROWS, dtype=np.int64)
        rng = np.random.default_rng(0)
        done = threading.Event()

        def write():
            try:
                for _ in range(UPDATES):
                    grads = np.repeat(rng.integers(1, 100, (ROWS, 1)).astype(np.float32),
                                      DIM, axis=1)  # one value per row: rows stay equal
                    writer.push_update("w", ids, grads, "sgd", SGDHyper(lr=1.0))
            finally:
                done.set()

        t = threading.Thread(target=write)
        t.start()
        pulls, torn, seen = 0, 0, set()
        while not done.is_set() or pulls < 10:
            rows = reader.pull("w", ids)
            torn += int((rows != rows[:, :1]).any(axis=1).sum())
            seen.add(float(rows[0, 0]))
            pulls += 1
        t.join(60)
        print(f"{pulls} pulls during {UPDATES} updates, {len(seen)} versions of row 0 seen, "
              f"{torn} torn rows")
        assert torn == 0
        assert len(seen) > 2, "the pulls did not overlap the updates: the test proves nothing"
        want = reader.pull("w", ids)
        assert (want == want[:, :1]).all() and (want < 0).all()
        writer.close()
        reader.close()
        group.wait_all(30)
