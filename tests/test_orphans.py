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

from mp_helper import ProcessGroup, free_port

from distemb.transport.shm import remove_orphans

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SHM = "/dev/shm"
TRAINER = """
import os, time, distemb
from distemb.partition import range_policy
ctx = distemb.initialize(backend="numpy")
ctx.client.init_data("t", (100, 4), "float32", range_policy(100, 2))
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


def test_sigkill_of_the_launcher_stops_every_child_within_10_s(tmp_path):
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    cfg_path = tmp_path / "cluster.json"
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip), "--num-servers",
            "2", "--num-trainers", "2", "--config-out", str(cfg_path), "--timeout", "30",
            "--", sys.executable, "-c", TRAINER]
    with ProcessGroup() as group:
        launcher = group.spawn(argv, expect=None)
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
        assert any(f"-{job}-" in n for n in os.listdir(SHM)), "the servers made no segments"
        launcher.kill()
        start = time.monotonic()
        while not all(gone(p) for p in pids) and time.monotonic() - start < 30:
            time.sleep(0.02)
        elapsed = time.monotonic() - start
        left = [n for n in os.listdir(SHM) if f"-{job}-" in n]
        running = [p for p in pids if not gone(p)]
        for p in running:  # ours (the test started their launcher): do not leak them
            os.kill(p, signal.SIGKILL)
        print(f"all 4 children gone {elapsed:.2f} s after SIGKILL of the launcher")
        assert not running, f"still running {elapsed:.1f} s after the launcher died: {running}"
        assert elapsed < 10 and left == [], (elapsed, left)


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
