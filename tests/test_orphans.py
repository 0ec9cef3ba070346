"""No orphans: a launcher killed by SIGKILL takes its servers and trainers with it, their
shared memory goes too, and the next launch removes segments of servers that are gone."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from mp_helper import ProcessGroup, child_env, free_port
from ssh_helper import ssh_wrapper, start_sshd

from distemb.transport.shm import remove_orphans

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SHM = "/dev/shm"
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
    except FileNotFoundError:
        return True


def lines_of(stream):
    q = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


def kill_launcher_and_check(group, tmp_path, extra=(), env=None):
    """Start a 2 servers x 2 trainers job with distemb-launch (``extra`` arguments), wait
    until both trainers pushed (through their request slots), SIGKILL the launcher, and
    check that every server and trainer (by the PIDs they printed) and every file of the
    job in /dev/shm is gone within 10 s."""
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    cfg_path = tmp_path / "cluster.json"
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip), "--num-servers",
            "2", "--num-trainers", "2", "--config-out", str(cfg_path), "--timeout", "30",
            *extra, "--", sys.executable, "-c", TRAINER]
    launcher = group.spawn(argv, env=env, expect=None)
    out, ready = lines_of(launcher.stdout), {}
    deadline = time.monotonic() + 60
    while len(ready) < 2:
        line = out.get(timeout=max(0.1, deadline - time.monotonic()))
        if "READY" in line:
            prefix, _, rest = line.partition(": READY ")
            ready[prefix] = [int(w) for w in rest.split()]
    assert sorted(ready) == ["[trainer0]", "[trainer1]"]  # lines carry role and rank
    pids = {pid for pl in ready.values() for pid in pl}
    assert len(pids) == 4  # two trainers, two servers
    job = json.loads(cfg_path.read_text())["job_id"]

    def left():
        return [n for n in os.listdir(SHM) if f"-{job}-" in n]
    mine = left()
    assert any(f"-{job}-s" in n for n in mine), f"the servers made no segments: {mine}"
    # Each trainer's push went through a request slot per server (issue 18: these four
    # files stayed after the launcher's SIGKILL).
    assert len([n for n in mine if f"-{job}-t" in n]) == 4, mine
    launcher.kill()
    start = time.monotonic()
    while (not all(gone(p) for p in pids) or left()) and time.monotonic() - start < 30:
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    files = left()
    running = [p for p in pids if not gone(p)]
    for p in running:  # ours (the test started their launcher): do not leak them
        os.kill(p, signal.SIGKILL)
    print(f"{' '.join(extra) or 'local'}: {elapsed:.2f} s after SIGKILL of the launcher, "
          f"{len(running)} of its 4 children running and {len(files)} of the job's "
          f"{len(mine)} files in {SHM} left")
    assert not running, f"still running {elapsed:.1f} s after the launcher died: {running}"
    assert elapsed < 10 and files == [], (elapsed, files)


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


def test_launch_removes_segments_of_servers_that_are_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs (reaped)
    stale = os.path.join(SHM, f"distemb-p{dead.pid}-testjob{free_port()}-s0-0")
    live = os.path.join(SHM, f"distemb-p{os.getpid()}-testjob{free_port()}-s0-0")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        removed = remove_orphans(SHM)
        assert stale in removed and not os.path.exists(stale)
        assert os.path.exists(live), "a segment of a live server must stay"
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_the_request_slots_of_a_killed_trainer_are_orphans_too(tmp_path):
    """A trainer killed with SIGKILL leaves its request slots in /dev/shm; they carry its
    pid, so the next launch's cleanup removes them (they used to stay for good)."""
    job = f"testjob{free_port()}"
    code = ("import os, numpy as np; from distemb.transport.shm import RequestSlot; "
            f"s = RequestSlot({job!r}, 0, 0, {SHM!r}); path, _ = s.write([np.arange(4)]); "
            "print(path, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    path = out.stdout.strip()
    try:
        assert os.path.exists(path) and os.path.basename(path).startswith("distemb-p")
        assert path in remove_orphans(SHM) and not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


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
    assert [n for n in os.listdir(SHM) if f"-{job}-" in n] == []
