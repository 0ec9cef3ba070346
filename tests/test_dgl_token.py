"""The job token of a DGL job under ``distemb.dgl.patch()``: made for the processes that
inherit it, still required of the processes started separately (DGL's launcher's).

The end-to-end cases are DGL's own tests in tests/test_dgl_upstream.py (no token set by
hand); these check the rule itself, in real processes.
"""
import sys

import pytest

from mp_helper import ProcessGroup, child_env

pytest.importorskip("dgl")

# What a process started by the parent (a child of patch()) prints: its token, or error.
CHILD = ("from distemb.dgl import job\n"
         "try:\n    print('token', job.job_token())\n"
         "except job.DistEmbError as e:\n    print('refused', e)\n")

PARENT = """
import subprocess, sys
import distemb.dgl
from distemb.dgl import job
distemb.dgl.patch()
try:
    job.job_token()
    print("parent: token")
except job.DistEmbError as e:
    print("parent: refused", e)
import os
print("parent made", os.environ.get(job.TOKEN_VAR, ""))
sys.stdout.flush()
subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)
"""


def _run(env_extra, timeout=120):
    env = child_env(DGLBACKEND="pytorch", **env_extra)
    for var in ("DISTEMB_JOB_TOKEN", "DISTEMB_JOB_TOKEN_MADE_BY", "DGL_ROLE"):
        if var not in env_extra:
            env.pop(var, None)
    with ProcessGroup() as group:
        group.spawn([sys.executable, "-c", PARENT, CHILD], env=env)
        (out,) = group.wait_all(timeout=timeout).values()
    return out


@pytest.mark.multiprocess
def test_patch_makes_a_token_its_children_share_and_it_cannot_use():
    out = _run({})
    made = out.split("parent made ", 1)[1].split()[0]
    assert len(made) == 32, out
    assert "parent: refused $DISTEMB_JOB_TOKEN is not set" in out, out
    assert f"token {made}" in out, out  # the child holds the parent's token


@pytest.mark.multiprocess
def test_a_process_of_dgls_launcher_gets_no_token_made():
    """DGL's launcher gives every process its role ($DGL_ROLE) and starts each on its
    own: no token is made there, and neither the process nor its children have one."""
    out = _run({"DGL_ROLE": "client"})
    assert "parent made \n" in out, out
    assert "parent: refused $DISTEMB_JOB_TOKEN is not set" in out, out
    assert "refused $DISTEMB_JOB_TOKEN is not set" in out.split("parent made", 1)[1], out


@pytest.mark.multiprocess
def test_a_given_token_is_kept_and_used_everywhere():
    out = _run({"DISTEMB_JOB_TOKEN": "given-by-the-launcher"})
    assert "parent: token" in out, out
    assert "token given-by-the-launcher" in out.split("parent made", 1)[1], out


@pytest.mark.multiprocess
def test_a_distemb_server_that_cannot_listen_fails_dgls_server_naming_port_and_variable(
        tmp_path, monkeypatch):
    """DGL's server start (here a stand-in that returns at once: the wrapper is what is
    checked) starts distemb's server on DGL's port + offset; when another process holds
    that port, the start fails naming the port and the variable that moves it."""
    import importlib
    import secrets
    import socket
    from types import SimpleNamespace

    from distemb.dgl import job
    patch = importlib.import_module("distemb.dgl.patch")  # the module: patch() shadows it

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        (tmp_path / "ip.txt").write_text(f"127.0.0.1 {taken - 1000}\n")
        monkeypatch.setenv(job.TOKEN_VAR, secrets.token_hex(16))
        monkeypatch.setenv(job.PORT_OFFSET_VAR, "1000")
        monkeypatch.delenv("DGL_NUM_SAMPLER", raising=False)
        server = SimpleNamespace(server_id=0, ip_config=str(tmp_path / "ip.txt"),
                                 num_servers=1, num_clients=1)
        ran = []
        start = patch._server_start(lambda self: ran.append(self))
        with pytest.raises(job.DistEmbError) as e:
            start(server)
        assert ran == [server]  # DGL's own start ran, then distemb's failure was raised
        assert f"port {taken})" in str(e.value) and "exited with 2" in str(e.value)
        assert job.PORT_OFFSET_VAR in str(e.value)
    finally:
        holder.close()
