"""Multi-process jobs on 127.0.0.1: 2 servers x 2 trainers against single-process oracles,
consistency modes, launch, and failures (dead/hung/unreachable servers, busy ports)."""
import os
import signal
import socket
import sys
import time

import numpy as np
import pytest

import cluster_trainer as job
from mp_helper import ProcessGroup, child_env, cluster_dict, free_port, write_json

from distemb.config import parse_cluster_config
from distemb.errors import ServerUnavailableError
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy
from distemb.rules import SGDHyper

pytestmark = pytest.mark.multiprocess
TRAINER = os.path.join(os.path.dirname(__file__), "cluster_trainer.py")


def launch(tmp_path, consistency, extra=(), steps=20, servers=2, trainers=2, expect=0,
           launcher="local", env=None):
    """Run cluster_trainer.py under distemb-launch; return the launcher's output."""
    ip = tmp_path / "ip.txt"
    ip.write_text(f"# one machine\n127.0.0.1 {free_port()}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip),
            "--launcher", launcher,
            "--num-servers", str(servers), "--num-trainers", str(trainers),
            "--consistency", consistency, "--config-out", str(tmp_path / "cluster.json"),
            "--timeout", "30", "--", sys.executable, TRAINER, str(tmp_path),
            "--steps", str(steps), *extra]
    with ProcessGroup() as group:
        group.spawn(argv, env=env, expect=expect)
        return next(iter(group.wait_all(timeout=100).values()))


@pytest.mark.timeout(120)
def test_two_by_two_sync_exact_equals_one_trainer_on_whole_batch(tmp_path):
    launch(tmp_path, "sync_exact")
    want = job.oracle_whole_batch(20)
    assert not np.allclose(want, 0.5), "the oracle did not train"
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), want, rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
def test_sync_exact_with_a_table_one_trainer_does_not_touch(tmp_path):
    """Rank 1 never looks up 'side': its empty pushes keep the servers' steps complete."""
    launch(tmp_path, "sync_exact", extra=["--side"], steps=6)
    want, want_side = job.oracle_whole_batch(6, side=True)
    assert not np.allclose(want_side, 0.5), "the side table did not train"
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "side.npy"), want_side, rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
def test_two_by_two_sync_equals_sequential_application(tmp_path):
    launch(tmp_path, "sync", extra=["--disjoint"])
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), job.oracle_sequential(20),
                               rtol=0, atol=1e-5)


@pytest.mark.timeout(60)
def test_servers_never_import_torch(clusters):
    kv = clusters("tcp").client()
    try:
        assert [i["torch_imported"] for i in kv.server_info] == [False, False]
        assert "torch" in sys.modules  # this process did: the check is about the servers
    finally:
        kv.close(goodbye=False)


def _cluster(tmp_path, group, num_servers=2, **fields):
    raw = cluster_dict(num_servers, **{"timeout_s": 2.0, **fields})
    path = write_json(tmp_path / "c.json", raw)
    servers = group.spawn_servers(path, num_servers)
    cfg = parse_cluster_config(raw)
    group.wait_listening([(s.host, s.port) for s in cfg.servers])
    return cfg, servers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_dead_or_hung_server_raises_within_timeout(tmp_path, how):
    with ProcessGroup() as group:
        cfg, servers = _cluster(tmp_path, group, shared_memory=False)
        kv = RemoteKVClient(cfg, 0)
        kv.init_data("w", (10, 2), "float32", range_policy(10, 2))
        victim = servers[1]
        victim.expect = None  # its exit code is the test's doing
        if how == "killed":
            victim.kill()
            victim.wait()
        else:
            victim.send_signal(signal.SIGSTOP)
            time.sleep(0.2)  # let the stop land before the request does
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="server 1"):
            kv.pull("w", np.arange(10, dtype=np.int64))
        with pytest.raises(ServerUnavailableError, match="server 1"):
            kv.push("w", np.array([9]), np.ones((1, 2), np.float32))
        assert time.monotonic() - start < 2 * cfg.timeout_s + 2
        if how == "hung":
            victim.send_signal(signal.SIGKILL)
        kv.close()
        group.wait_all(20)


@pytest.mark.timeout(30)
def test_unreachable_server_raises_within_timeout():
    raw = cluster_dict(1, timeout_s=1.0)  # nobody listens on that fresh port
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="could not connect within 1.0 s"):
        RemoteKVClient(parse_cluster_config(raw), 0)
    assert time.monotonic() - start < 3


@pytest.mark.timeout(30)
def test_port_in_use_is_named(tmp_path):
    with socket.socket() as busy, ProcessGroup() as group:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        raw = cluster_dict(1)
        raw["servers"][0]["port"] = busy.getsockname()[1]
        path = write_json(tmp_path / "c.json", raw)
        group.spawn([sys.executable, "-m", "distemb.server", "--config", path,
                     "--server-id", "0"], expect=2)
        out = next(iter(group.wait_all(20).values()))
    assert f"port {raw['servers'][0]['port']} on 127.0.0.1 is already in use" in out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shm", [False, True])
def test_async_mode_staleness(tmp_path, shm):
    """Async: over one connection a trainer reads its own updates (the connection is
    ordered); through shared memory it may read rows before its updates land."""
    with ProcessGroup() as group:
        cfg, _ = _cluster(tmp_path, group, 1, shared_memory=shm)
        kv = RemoteKVClient(cfg, 0, consistency="async")
        kv.init_data("w", (4, 2), "float32", range_policy(4))
        kv.init_optimizer("w", "sgd", {})
        for _ in range(3):
            kv.push_update("w", np.array([1], dtype=np.int64), np.ones((1, 2), np.float32),
                           "sgd", SGDHyper(lr=1.0))
        row = kv.pull("w", np.array([1], dtype=np.int64))
        if shm:
            deadline = time.monotonic() + 5
            while row[0, 0] != -3.0 and time.monotonic() < deadline:
                time.sleep(0.01)
                row = kv.pull("w", np.array([1], dtype=np.int64))
        assert row.tolist() == [[-3.0, -3.0]]
        kv.close()
        group.wait_all(20)


@pytest.mark.timeout(60)
def test_initialize_reads_distemb_config(tmp_path):
    """A trainer started with $DISTEMB_CONFIG gets a remote context from initialize()."""
    with ProcessGroup() as group:
        raw = cluster_dict(1)
        path = write_json(tmp_path / "c.json", raw)
        group.spawn_servers(path, 1)
        code = ("import distemb; ctx = distemb.initialize(backend='numpy'); "
                "print(ctx.role, ctx.rank, ctx.num_trainers, type(ctx.client).__name__); "
                "distemb.shutdown()")
        group.spawn([sys.executable, "-c", code],
                    env=child_env(DISTEMB_CONFIG=path, DISTEMB_RANK=0, DISTEMB_ROLE="trainer"))
        outs = list(group.wait_all(30).values())
    assert "trainer 0 1 RemoteKVClient" in outs[1]
