"""Checkpoint throughput (GB/s): save and load of one (N, D) float32 table, embedded and
with 2 server processes writing their shards in parallel, against a baseline measured in
the same run: the same bytes written with ``ndarray.tofile`` + fsync (the disk's own
sequential write speed) and read back with ``np.fromfile``.

Each save is complete on disk (segments and manifest fsynced) when its time is taken;
loads read through the page cache when the files are still in it (as right after a save).

Usage::

    PYTHONPATH=. python benchmarks/bench_checkpoint.py [--rows 2000000] [--dim 128]
        [--dir /tmp] [--repeat 3]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

import results
from distemb import checkpoint
from distemb.config import parse_cluster_config
from distemb.kvstore import LocalKVClient
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy
from distemb.transport import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def baseline(arr, workdir):
    path = os.path.join(workdir, "plain.bin")

    def write():
        with open(path, "wb") as f:
            arr.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    w = timed(write)
    r = timed(lambda: np.fromfile(path, dtype=arr.dtype))
    os.remove(path)
    return w, r


def round_trip(kv, workdir, rows, dim):
    ck = os.path.join(workdir, f"ck-{uuid.uuid4().hex[:6]}")
    w = timed(lambda: checkpoint.save(ck, kv, ["w"], {}))
    r = timed(lambda: checkpoint.restore(ck, kv, ["w"]))
    shutil.rmtree(ck)
    return w, r


def fill(kv, arr):
    for s in range(0, arr.shape[0], 1 << 18):
        kv.push("w", np.arange(s, min(s + (1 << 18), arr.shape[0])), arr[s:s + (1 << 18)])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    p.add_argument("--repeat", type=int, default=3)
    results.add_arguments(p)
    args = p.parse_args()
    with results.Recorder("bench_checkpoint", args) as rec:
        measure(args, rec)


def measure(args, rec):
    """Save and load in turns, ``args.repeat`` times; the table of medians."""
    arr = np.random.default_rng(0).standard_normal((args.rows, args.dim)).astype(np.float32)
    gb = arr.nbytes / 1e9
    workdir = tempfile.mkdtemp(dir=args.dir, prefix="bench-ck-")
    times = {"ndarray.tofile + fsync / np.fromfile (baseline)": [], "embedded": [],
               "2 servers (parallel shards)": []}
    local = LocalKVClient()
    local.init_data("w", arr.shape, "float32", range_policy(args.rows, 2))
    fill(local, arr)
    raw = {"job_id": uuid.uuid4().hex[:8], "num_trainers": 1, "trainer_machines": [0],
           "shared_memory": False, "timeout_s": 120.0,
           "servers": [{"host": "127.0.0.1", "port": ports.free_port(8), "machine": 0}
                       for _ in range(2)]}
    cfg_path = os.path.join(workdir, "cluster.json")
    with open(cfg_path, "w") as f:
        json.dump(raw, f)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1")
    servers = [subprocess.Popen([sys.executable, "-m", "distemb.server", "--config", cfg_path,
                                 "--server-id", str(i)], env=env) for i in range(2)]
    try:
        remote = RemoteKVClient(parse_cluster_config(raw), 0)
        remote.init_data("w", arr.shape, "float32", range_policy(args.rows, 2))
        fill(remote, arr)
        for _ in range(args.repeat):  # in turns, so a busy moment hits every contender
            times["ndarray.tofile + fsync / np.fromfile (baseline)"].append(
                baseline(arr, workdir))
            times["embedded"].append(round_trip(local, workdir, args.rows, args.dim))
            times["2 servers (parallel shards)"].append(
                round_trip(remote, workdir, args.rows, args.dim))
        remote.close()
    finally:
        for s in servers:
            try:
                s.wait(30)
            except subprocess.TimeoutExpired:
                s.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    base_w, base_r = (np.median([r[i] for r in times[next(iter(times))]]) for i in (0, 1))
    print(f"table {args.rows:,} x {args.dim} float32 = {gb:.2f} GB, {os.cpu_count()} cores, "
          f"dir {args.dir}, median of {args.repeat}\n")
    print("| writer | save s | save GB/s | vs baseline | load s | load GB/s | vs baseline |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in times.items():
        w, r = np.median([x[0] for x in runs]), np.median([x[1] for x in runs])
        print(f"| {name} | {w:.2f} | {gb / w:.2f} | {base_w / w:.2f}x | {r:.2f} | "
              f"{gb / r:.2f} | {base_r / r:.2f}x |")
        key = name.split()[0].split(".")[0].lower()  # ndarray, embedded, 2
        key = {"2": "servers"}.get(key, key)
        rec.figure(f"save_gbps.{key}", gb / w, "{:.2f} GB/s", f"{name}: save")
        rec.figure(f"load_gbps.{key}", gb / r, "{:.2f} GB/s", f"{name}: load")
        rec.figure(f"save_vs_baseline.{key}", base_w / w, "{:.2f}x",
                   f"{name}: save time of tofile + fsync over this one's")
        rec.figure(f"load_vs_baseline.{key}", base_r / r, "{:.2f}x",
                   f"{name}: load time of np.fromfile over this one's")


if __name__ == "__main__":
    main()
