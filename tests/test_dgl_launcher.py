"""A job started by DGL 1.1.3's real tools/launch.py gets distemb's servers.

DGL's launcher (tests/dgl_upstream/launch.py, unedited) runs every server and trainer
through ssh; here an sshd from Debian's openssh-server listens on 127.0.0.1 on a free
port, with its own host key and an authorized key made for the test (a ``ssh`` wrapper
first on PATH points DGL's ``ssh`` commands at that key). The script
(tests/dgl_launch_trainer.py) is DGL code plus ``distemb.dgl.patch()``: distemb's
servers start inside DGL's server-role processes, trainers join with DGL's variables,
and the job token comes through DGL's ``--extra_envs``.

Oracle: every trainer looks up its own nodes with ``sum`` as the loss,
so each row gets gradient 1 per step from one trainer: torch's Adagrad on an
``nn.Embedding(sparse=True)`` with all nodes as one batch is the single-process job.
"""
import os
import signal
import sys

import numpy as np
import pytest
import torch

from mp_helper import ROOT, ProcessGroup, child_env, free_port
from ssh_helper import ssh_wrapper, start_sshd

dgl = pytest.importorskip("dgl")

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(HERE, "dgl_upstream", "launch.py")
TRAINER = os.path.join(HERE, "dgl_launch_trainer.py")


@pytest.fixture
def sshd(tmp_path):
    """An sshd on 127.0.0.1:<free port> admitting one key; yields (port, PATH prefix)."""
    with ProcessGroup() as group:
        port, key = start_sshd(tmp_path, group, "DGL's launcher starts every process "
                                                "through ssh")
        yield port, ssh_wrapper(tmp_path / "bin", key)


def _partition(tmp_path, machines):
    g = dgl.rand_graph(1000, 4000)
    dgl.distributed.partition_graph(g, "g", machines, str(tmp_path / "parts"))
    return str(tmp_path / "parts" / "g.json"), g.num_nodes()


def _launch(tmp_path, sshd, ip_config, part_config, servers, trainers, mode, token,
            timeout=300):
    port, bindir = sshd
    env = child_env(PATH=bindir + os.pathsep + os.environ["PATH"], DGLBACKEND="pytorch")
    extra = [f"DISTEMB_JOB_TOKEN={token}"] if token else []
    # --extra_envs takes every word up to the next option: it goes first
    argv = [sys.executable, LAUNCH, *(["--extra_envs", *extra] if extra else []),
            "--workspace", str(tmp_path), "--ssh_port", str(port),
            "--num_trainers", str(trainers), "--num_servers", str(servers),
            "--num_omp_threads", "1", "--ip_config", ip_config, "--part_config", part_config,
            f"{sys.executable} {TRAINER} --ip_config {ip_config} --part_config {part_config} "
            f"--mode {mode} --out {tmp_path}"]
    with ProcessGroup() as group:
        group.spawn(argv, env=env, cwd=str(tmp_path), session=True, expect=None)
        (out,) = group.wait_all(timeout=timeout).values()
    return out


def _adagrad_oracle(n, steps, lr=0.1):
    emb = torch.nn.Embedding(n, 4, sparse=True)
    torch.nn.init.constant_(emb.weight, 0.5)
    opt = torch.optim.Adagrad(emb.parameters(), lr=lr, eps=1e-10)
    for _ in range(steps):
        opt.zero_grad()
        emb(torch.arange(n)).sum().backward()
        opt.step()
    return emb.weight.detach().numpy(), opt.state[emb.weight]["sum"].numpy()


@pytest.mark.multiprocess
# Each count of 1 is in a case (one machine; one server per machine): no (1, 1) case of its
# own, which cost ~35 s of CPU; DGL's own tests (test_dgl_upstream.py) run 1 x 1 jobs.
@pytest.mark.parametrize("machines,servers", [(1, 2), (2, 1)])
@pytest.mark.timeout(900)
def test_dgl_launcher_job_trains_and_saves_4_loads_2(tmp_path, sshd, machines, servers):
    """M machines' worth of processes on 127.0.0.1 (one ip_config line each, as many
    partitions), S servers per machine: 4 trainers in all train and save, then 2 load."""
    part_config, n = _partition(tmp_path, machines)
    ip_config = str(tmp_path / "ip_config.txt")
    with open(ip_config, "w") as f:
        f.writelines(f"127.0.0.1 {free_port(4)}\n" for _ in range(machines))
    token = os.urandom(16).hex()
    out = _launch(tmp_path, sshd, ip_config, part_config, servers, 4 // machines, "train",
                  token, timeout=400)
    for r in range(4):
        assert f"rank {r} of 4: train ok, node~_N in {machines} partition(s)" in out, \
            out[-4000:]
    ids = np.concatenate([np.load(tmp_path / f"ids-{r}.npy") for r in range(4)])
    assert sorted(ids.tolist()) == list(range(n))  # the trainers split every node, once
    rows, state = _adagrad_oracle(n, 3)
    np.testing.assert_allclose(np.load(tmp_path / "train-rows.npy"), rows, rtol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "train-state.npy"), state, rtol=1e-6)

    out = _launch(tmp_path, sshd, ip_config, part_config, servers, 2 // machines, "load",
                  token, timeout=400)
    for r in range(2):
        assert f"rank {r} of 2: load ok" in out, out[-4000:]
    np.testing.assert_array_equal(np.load(tmp_path / "load-rows.npy"),
                                  np.load(tmp_path / "train-rows.npy"))
    np.testing.assert_array_equal(np.load(tmp_path / "load-state.npy"),
                                  np.load(tmp_path / "train-state.npy"))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dgl_launcher_without_token_is_refused_clearly(tmp_path, sshd):
    part_config, _ = _partition(tmp_path, 1)
    ip_config = str(tmp_path / "ip_config.txt")
    with open(ip_config, "w") as f:
        f.write(f"127.0.0.1 {free_port(4)}\n")
    out = _launch(tmp_path, sshd, ip_config, part_config, 1, 1, "train", None, timeout=200)
    assert "DISTEMB_JOB_TOKEN is not set" in out and "--extra_envs" in out, out[-4000:]
    assert "train ok" not in out
