"""No orphans: a launcher killed by SIGKILL takes its servers and trainers with it, and
nothing of the job is left when its processes die however they die: its shared memory is
sealed memory files (no /dev/shm file), freed with the last process that maps them."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

import numpy as np

from mp_helper import (ProcessGroup, child_env, cluster_dict, free_port, memory_files,
                       shm_files, write_json)
from ssh_helper import ssh_wrapper, start_sshd

from distemb.config import parse_cluster_config
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
TRAINER = """
import os, time, numpy as np, distemb
from distemb.partition import range_policy
ctx = distemb.initialize(backend="numpy")
ctx.client.init_data("t", (100, 4), "float32", range_policy(100, 2))
ctx.client.push("t", np.arange(100), np.ones((100, 4), np.float32))  # via request slots
print("READY", os.getpid(), *[i["pid"] for i in ctx.client.server_info], flush=True)
time.sleep(300)
"""


def gone(pid):
    """True when ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or the read
        return True


def what_runs(pid):
    """What process ``pid`` is and where it waits (its command line, state, parent,
    kernel wait channel and threads' states), for the message of a process that should
    be gone."""
    def read(name):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                return f.read().decode("ascii", "replace")
        except OSError as e:
            return f"({e.strerror})"
    fields = read("stat").rsplit(")", 1)[-1].split()
    threads = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            state = read(f"task/{tid}/stat").rsplit(")", 1)[-1].split()[:1]
            # each thread's state, kernel wait channel and system call (number and
            # arguments: a futex's address tells which threads wait on the same lock)
            threads.append((*state, read(f"task/{tid}/wchan"),
                            read(f"task/{tid}/syscall").strip()[:80]))
    except OSError:
        pass
    return {"cmdline": read("cmdline").replace("\0", " ").strip()[:200],
            "state": fields[:1], "ppid": fields[1:2], "wchan": read("wchan"),
            "threads": sorted(threads)}


def lines_of(stream):
    q = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


def start_job(group, tmp_path, extra=(), env=None):
    """Start a 2 servers x 2 trainers job with distemb-launch (``extra`` arguments) and
    wait until both trainers pushed (through their request slots).

    Returns:
        (the launcher, the job id, {pid: "server"|"trainer"} of its four processes).
    """
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    cfg_path = tmp_path / "cluster.json"
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip), "--num-servers",
            "2", "--num-trainers", "2", "--config-out", str(cfg_path), "--timeout", "30",
            *extra, "--", sys.executable, "-c", TRAINER]
    launcher = group.spawn(argv, env=env, expect=None)
    out, ready, seen = lines_of(launcher.stdout), {}, []
    # Until both trainers are ready or the launcher gives up (bounded by the test's
    # timeout): a start-up is slow on a loaded machine (four Python processes took over
    # 60 s at load 20), which is not what these tests are about.
    while len(ready) < 2:
        try:
            line = out.get(timeout=0.5)
        except queue.Empty:
            assert launcher.poll() is None, (f"the launcher exited {launcher.returncode} "
                                             f"before both trainers were ready:\n"
                                             + "".join(seen[-40:]))
            continue
        seen.append(line)
        if "READY" in line:
            prefix, _, rest = line.partition(": READY ")
            ready[prefix] = [int(w) for w in rest.split()]
    assert sorted(ready) == ["[trainer0]", "[trainer1]"]  # lines carry role and rank
    roles = {pids[0]: "trainer" for pids in ready.values()}
    roles.update({pid: "server" for pids in ready.values() for pid in pids[1:]})
    assert len(roles) == 4  # two trainers, two servers
    job = json.loads(cfg_path.read_text())["job_id"]
    # The job's shared memory is memory files: each server holds its shards, each
    # trainer maps them and a request slot per server; /dev/shm has nothing of it (issue
    # 18: named files there stayed behind when their processes were SIGKILLed).
    for pid, role in roles.items():
        mine = memory_files(pid, job)
        assert any("-s" in m and "-t" not in m for m in mine), (role, mine)  # shards
        if role == "trainer":
            assert len({m.rsplit("-", 1)[0] for m in mine if "-t" in m}) == 2, mine
    assert shm_files(job) == [], shm_files(job)
    return launcher, job, roles


def wait_gone(group, pids, job, what):
    """Wait up to 30 s until every pid and every file of ``job`` is gone; kill what is
    left (the test started it); assert it took less than 10 s."""
    start = time.monotonic()
    while (not all(gone(p) for p in pids) or shm_files(job)) and \
            time.monotonic() - start < 30:
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    files = shm_files(job)
    running = [p for p in pids if not gone(p)]
    seen = {p: what_runs(p) for p in running}  # before the kill: why it is still there
    for p in running:  # ours (the test started their launcher): do not leak them
        os.kill(p, signal.SIGKILL)
    print(f"{what}: {elapsed:.2f} s after the SIGKILL, {len(running)} of the job's "
          f"{len(pids)} processes running and {len(files)} of its files in /dev/shm")
    assert not running, f"still running {elapsed:.1f} s after the SIGKILL: {seen}"
    assert elapsed < 10 and files == [], (elapsed, files)


def kill_launcher_and_check(group, tmp_path, extra=(), env=None):
    """SIGKILL the launcher of a running 2x2 job: every server and trainer (by the PIDs
    they printed) is gone within 10 s, and nothing of the job is in /dev/shm."""
    launcher, job, roles = start_job(group, tmp_path, extra, env)
    launcher.kill()
    wait_gone(group, list(roles), job, f"{' '.join(extra) or 'local'} launcher")


def test_sigkill_of_the_launcher_stops_every_child_within_10_s(tmp_path):
    with ProcessGroup() as group:
        kill_launcher_and_check(group, tmp_path)


def test_sigkill_of_an_ssh_launcher_stops_the_remote_processes_within_10_s(tmp_path):
    """Every process starts through an sshd on 127.0.0.1 (its own session, not a child
    of the launcher): each runs under distemb.session_guard, which stops it when its
    ssh session's stdin closes."""
    with ProcessGroup() as group:
        port, key = start_sshd(tmp_path, group, "the ssh launcher starts every process "
                                                "through ssh")
        bindir = ssh_wrapper(tmp_path / "bin", key, port)
        kill_launcher_and_check(group, tmp_path, ["--launcher", "ssh"],
                                child_env(PATH=bindir + os.pathsep + os.environ["PATH"]))


def test_sigkill_of_every_process_of_a_job_at_once_leaves_nothing(tmp_path):
    """The launcher, both servers and both trainers SIGKILLed at the same moment: no
    process gets to clean anything up, and nothing of the job is left (named files in
    /dev/shm used to stay until another job's launch removed them)."""
    with ProcessGroup() as group:
        launcher, job, roles = start_job(group, tmp_path)
        for pid in [launcher.pid, *roles]:
            os.kill(pid, signal.SIGKILL)
        wait_gone(group, list(roles), job, "every process")


def test_a_killed_trainers_slot_is_released_by_its_server(tmp_path):
    """A trainer killed by SIGKILL cannot say goodbye: the server drops its mapping of
    the trainer's request slot when the connection ends, so the slot's memory goes."""
    raw = cluster_dict(1, shared_memory=True, timeout_s=20.0)
    code = ("import json, os, sys, time, numpy as np\n"
            "from distemb.config import parse_cluster_config\n"
            "from distemb.kvstore.remote import RemoteKVClient\n"
            "from distemb.partition import range_policy\n"
            "kv = RemoteKVClient(parse_cluster_config(json.load(open(sys.argv[1]))), 0)\n"
            "kv.init_data('t', (10, 2), 'float32', range_policy(10))\n"
            "kv.push('t', np.arange(10), np.ones((10, 2), np.float32))\n"
            "print('READY', flush=True)\ntime.sleep(300)\n")
    with ProcessGroup() as group:
        path = write_json(tmp_path / "c.json", raw)
        server = group.spawn_servers(path, 1)[0]
        trainer = group.spawn([sys.executable, "-c", code, path], expect=None)
        assert trainer.stdout.readline().strip() == "READY"
        slot = f"distemb-{raw['job_id']}-t0-s0-0"
        assert slot in memory_files(server.pid, raw["job_id"])  # the server maps it
        trainer.kill()
        start = time.monotonic()
        while slot in memory_files(server.pid, raw["job_id"]) and \
                time.monotonic() - start < 10:
            time.sleep(0.02)
        assert slot not in memory_files(server.pid, raw["job_id"])
        # the server serves on: the table, in its own memory file, is intact
        kv = RemoteKVClient(parse_cluster_config(raw), 0)
        kv.init_data("t", (10, 2), "float32", range_policy(10))
        assert (kv.pull("t", np.arange(10)) == 1).all()
        kv.close()
        assert group.wait_all(30)[server.pid] is not None


def test_the_session_guard_stops_its_command_when_stdin_closes_and_passes_its_exit_code():
    """distemb.session_guard (what --launcher ssh runs remotely) on its own: its command
    runs until the guard's stdin reads end-of-file, then dies with its own children."""
    code = ("import os, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            "print(os.getpid(), c.pid, flush=True); time.sleep(300)")
    with ProcessGroup() as group:
        guard = group.spawn([sys.executable, "-m", "distemb.session_guard", sys.executable,
                             "-c", code], stdin=subprocess.PIPE, expect=None)
        pids = [int(w) for w in guard.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        guard.stdin.close()  # the ssh session ended
        assert guard.wait(10) == 128 + signal.SIGTERM
        start = time.monotonic()
        while not all(gone(p) for p in pids) and time.monotonic() - start < 10:
            time.sleep(0.02)
        assert all(gone(p) for p in pids), pids
        ok = group.spawn([sys.executable, "-m", "distemb.session_guard", sys.executable, "-c",
                          "raise SystemExit(3)"], stdin=subprocess.PIPE, expect=3)
        assert ok.wait(30) == 3


def test_a_job_launched_over_ssh_runs_to_completion_under_its_guards(tmp_path):
    """The guards change nothing for a job that ends: trainers push and pull through the
    servers, say goodbye, and the launcher exits 0 with every remote process gone."""
    trainer = ("import numpy as np, distemb\n"
               "from distemb.partition import range_policy\n"
               "ctx = distemb.initialize(backend='numpy')\n"
               "ctx.client.init_data('t', (10, 2), 'float32', range_policy(10, 2))\n"
               "ctx.client.push('t', np.array([ctx.rank]), np.full((1, 2), 5.0, np.float32))\n"
               "ctx.client.barrier()\n"
               "print('ROWS', ctx.client.pull('t', np.array([0, 1])).sum(), flush=True)\n"
               "ctx.close()\n")
    with ProcessGroup() as group:
        port, key = start_sshd(tmp_path, group, "the ssh launcher starts every process "
                                                "through ssh")
        bindir = ssh_wrapper(tmp_path / "bin", key, port)
        ip = tmp_path / "ip.txt"
        ip.write_text(f"127.0.0.1 {free_port()}\n")
        launcher = group.spawn(
            [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip), "--launcher",
             "ssh", "--num-servers", "2", "--num-trainers", "2", "--config-out",
             str(tmp_path / "c.json"), "--timeout", "30", "--", sys.executable, "-c",
             trainer], env=child_env(PATH=bindir + os.pathsep + os.environ["PATH"]))
        out, _ = launcher.communicate(timeout=90)  # (the sshd runs on)
    assert launcher.returncode == 0 and out.count("ROWS 20.0") == 2, out
    job = json.loads((tmp_path / "c.json").read_text())["job_id"]
    assert shm_files(job) == []


HANGING_SERVER = """
import sys, time
import distemb.kvstore.server.kvserver as kvserver
from distemb import server

def hang_in_close(self):  # a shutdown that never ends (what the test plants)
    time.sleep(3600)

kvserver.KVServer.close = hang_in_close
sys.exit(server.main(["--config", sys.argv[1], "--server-id", "0"]))
"""


def test_a_server_whose_shutdown_hangs_exits_after_the_grace(tmp_path):
    """Told to stop by SIGTERM (what the launcher's death sends), a server whose shutdown
    hangs still exits, STOP_GRACE_S later, with status 3 and every thread's stack on
    stderr (the planted hang among them), so it never outlives its job."""
    from distemb.server import STOP_GRACE_S
    raw = cluster_dict(1, shared_memory=False)
    with ProcessGroup() as group:
        path = write_json(tmp_path / "c.json", raw)
        server = group.spawn([sys.executable, "-c", HANGING_SERVER, path], expect=3)
        group.wait_listening([("127.0.0.1", raw["servers"][0]["port"])])
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=STOP_GRACE_S + 30)
        took = time.monotonic() - start
    assert server.returncode == 3, out
    assert STOP_GRACE_S - 0.5 <= took < STOP_GRACE_S + 10, took
    assert f"still running {STOP_GRACE_S:g} s after it was told to stop" in out, out
    assert "hang_in_close" in out, out  # its stack says where it hung


#: A server whose Python freezes once it serves: a thread holds the GIL in a blocking C
#: call (libc's sleep through ctypes.PyDLL, which keeps the GIL), so neither its signal
#: handlers nor its parent watch nor its stop deadline can run.
FROZEN_SERVER = """
import ctypes, sys, threading, time
from distemb import server

def freeze():
    time.sleep(0.5)
    ctypes.PyDLL(None).sleep(3600)

def build_then_freeze(*args, real=server.build_service):
    service = real(*args)
    threading.Thread(target=freeze, daemon=True).start()
    return service

server.build_service = build_then_freeze
sys.exit(server.main(["--config", sys.argv[1], "--server-id", "0"]))
"""
#: The frozen server's parent: it prints the server's pid, then waits (SIGKILLed by the
#: test, as a launcher can be).
PARENT = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.pid, flush=True)
p.wait()
"""


def test_a_server_whose_python_is_frozen_is_killed_by_its_reaper_after_its_parents_death(
        tmp_path):
    """Neither the launcher's death signal nor the server's own watch can stop a server
    whose interpreter is stuck; its reaper (forked at its start) SIGKILLs it
    REAP_AFTER_S after its parent's death, then dies with it. (A server of the
    launcher-SIGKILL test once stayed 30 s, its three threads in futex waits.)"""
    from distemb.server import REAP_AFTER_S
    raw = cluster_dict(1, shared_memory=False)
    with ProcessGroup() as group:
        path = write_json(tmp_path / "c.json", raw)
        parent = group.spawn([sys.executable, "-c", PARENT, FROZEN_SERVER, path],
                             expect=None)
        server = int(parent.stdout.readline())
        try:
            group.wait_listening([("127.0.0.1", raw["servers"][0]["port"])])
            time.sleep(1.5)  # frozen by now
            with open(f"/proc/{server}/task/{server}/children", encoding="ascii") as f:
                reapers = [int(w) for w in f.read().split()]
            assert len(reapers) == 1, reapers
            parent.kill()
            start = time.monotonic()
            while not (gone(server) and gone(reapers[0])) and \
                    time.monotonic() - start < REAP_AFTER_S + 20:
                time.sleep(0.05)
            took = time.monotonic() - start
            left = {p: what_runs(p) for p in (server, *reapers) if not gone(p)}
            assert not left, f"still running {took:.1f} s after the parent's death: {left}"
            assert REAP_AFTER_S - 0.5 <= took < REAP_AFTER_S + 5, took
        finally:
            if not gone(server):  # ours: the test started its parent
                os.kill(server, signal.SIGKILL)


#: ``python -m distemb.server`` (run as ``__main__``), with a hang planted in the
#: interpreter's finalization: an object whose collection at exit never ends.
HANGING_FINALIZATION = """
import runpy, sys, time

class CollectedAtExit:
    def __del__(self):
        time.sleep(3600)

planted = CollectedAtExit()
sys.argv[:] = ["distemb.server", "--config", sys.argv[1], "--server-id", "0"]
runpy.run_module("distemb.server", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("told", ["SIGTERM", "goodbye"])
def test_a_server_leaves_without_the_interpreters_finalization(tmp_path, told):
    """A server whose shutdown is done leaves at once, told to stop by SIGTERM (what its
    launcher's death sends) or by its trainers' goodbyes: it does not go through the
    interpreter's finalization, where the stop deadline no longer runs (daemon threads
    stop when it begins), so nothing there can keep it alive. With the planted hang it
    used to stay forever, in either case. (Under load a server of the launcher-SIGKILL
    test was seen in finalization's garbage collection 3 s after the SIGKILL.)"""
    raw = cluster_dict(1, shared_memory=False)
    with ProcessGroup() as group:
        path = write_json(tmp_path / "c.json", raw)
        server = group.spawn([sys.executable, "-c", HANGING_FINALIZATION, path], expect=0)
        group.wait_listening([("127.0.0.1", raw["servers"][0]["port"])])
        if told == "SIGTERM":
            server.send_signal(signal.SIGTERM)
        else:
            RemoteKVClient(parse_cluster_config(raw), 0).close()  # its goodbye
        out = group.wait_all(60)[server.pid]
    assert "Traceback" not in out and "still running" not in out, out
