"""The trainer cache on real access patterns: hit rate vs size, bytes per step, steps/s.

Id streams, drawn once in this process from WordNet (graph_examples' loader):

- ``sage``: the input nodes of DGL's ``NeighborSampler([10, 10])`` mini-batches (1,024
  seed nodes from the training split per batch; trainer r of T takes every T-th node);
- ``deepwalk``: the ids one DeepWalk skip-gram step looks up (4,096 pairs: centres in the
  node table, contexts and 5 negatives each in the context table), from
  ``graph_examples.walks.SkipGramBatches``.

Each step looks the ids up in DistEmbedding tables, backwards ``(rows ** 2).sum()`` and
runs SparseAdagrad.step(), with the tables held by KVStore server processes over TCP
(``--no-shared-memory`` semantics: every row crosses a socket).

1. Hit rate vs cache size (1 server x 1 trainer, exact mode, D=16: the hit rate does not
   depend on D): the share of looked-up unique rows served without their data, for LRU
   and LFU, after a warm-up; written as a PNG plot.
2. Bytes and steps/s (D=128 or ``--dim``; ``sage``, ``deepwalk`` and synthetic zipf(1.1) ids, 13,000
   per step, for contrast), 1 server x 1 trainer and 2 servers x 2 trainers: no cache vs
   LRU and LFU caches of each of ``--fractions`` of the rows (exact mode), and LFU at the
   first size with each bounded staleness of ``--staleness``. One set of server and trainer processes per
   job runs every configuration on fresh tables, each cached run between two uncached
   runs, for ``--rounds`` rounds; steps/s ratios are against the mean of the two
   neighbours (medians over rounds). Bytes are what each trainer's sockets received and
   sent per step, as the kernel counts them (``TCP_INFO``: frames with their headers);
   ``--account`` breaks them down by request kind and array. CPU per step: a trainer
   process's own (mean of the trainers), and all servers' together (from /proc), which a
   loaded machine inflates less than wall time.

Also printed: the hit rate of a clairvoyant static cache of the most frequent rows of
the stream (an upper bound for any policy that keeps a fixed share of rows).

A recommendation-like workload beside WordNet's, stream ``zipf10m``: ``--zipf-batch`` ids
per step from a Zipf(1.05) distribution truncated to a ``--zipf-rows`` table (10M rows;
rank k drawn with probability proportional to k^-1.05, ranks scattered over the table by
a fixed permutation). Its tables are created zero on the servers (no rows cross the wire
at creation, and untouched rows cost no memory) and the loss is ``((rows - 0.5) ** 2)``
so that every step updates them. ``uniform10m``: the same table and batch size, ids
drawn uniformly (no skew: what a cache costs when it cannot help).

``--links loopback,1gbit``: part 2 once per link; with a rate, every server and trainer
runs on a host of its own whose link is shaped to it (``benchmarks/netns.py``, needs
root), checked first with a bulk transfer; ``veth``: those hosts, links not shaped.

Usage::

    PYTHONPATH=. python benchmarks/bench_cache.py [--steps 40] [--fractions 0.1,0.4]
        [--staleness 1,10,100] [--plot out/bench_cache_hit_rate.png]
        [--streams sage,deepwalk,zipf,zipf10m,uniform10m] [--jobs 1,2] [--rounds 3]
        [--skip-hit-rate] [--consistency sync_exact] [--account] [--profile DIR]
        [--policies lru,lfu] [--links loopback,1gbit,10gbit]
"""
import argparse
import cProfile
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import distemb  # noqa: E402
from distemb.config import parse_cache_config, parse_cluster_config  # noqa: E402
from distemb.context import DistContext  # noqa: E402
from distemb.kvstore.caches.trainer import CachedKVClient  # noqa: E402
from distemb.kvstore.remote import RemoteKVClient  # noqa: E402
from distemb.partition import range_policy  # noqa: E402
from distemb.transport import tcp  # noqa: E402
from distemb.transport.base import Connection  # noqa: E402
from distemb.transport.messages import Service  # noqa: E402
import netns  # noqa: E402
import results  # noqa: E402
from cache_report import headline, plot, print_account, slug, summarize  # noqa: E402
from id_streams import (SIZES, byte_bounds, draw_streams, exact_bound,  # noqa: E402
                        static_hit_rates)


# -- one trainer ----------------------------------------------------------------------------

class Counting(Connection):
    """A TCP connection that counts the bytes its socket sent and received (the kernel's
    own counts: ``TCP_INFO``'s ``tcpi_bytes_acked`` and ``tcpi_bytes_received``, frame
    headers included), and, for the byte account, the array bytes of each kind of
    request and of its reply (``account``: {(service name, array index, "sent" or
    "received"): bytes}; replies arrive in request order on a connection)."""

    def __init__(self, conn):
        self.conn, self.peer = conn, conn.peer
        self.account, self._asked = {}, []

    def _tcp_info(self):
        info = self.conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        acked, received = struct.unpack_from("QQ", info, TCP_INFO_BYTES)
        return acked, received

    @property
    def retransmits(self):
        """Segments this socket retransmitted (``tcpi_total_retrans``)."""
        info = self.conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        return struct.unpack_from("I", info, TCP_INFO_RETRANS)[0]

    @property
    def sent(self):
        return self._tcp_info()[0]

    @property
    def received(self):
        return self._tcp_info()[1]

    def _add(self, service, frame, way):
        for i, a in enumerate(frame.arrays):
            key = (service, i, way)
            self.account[key] = self.account.get(key, 0) + a.nbytes

    def send(self, frame):
        service = Service(frame.service).name
        self._asked.append(service)
        self._add(service, frame, "sent")
        self.conn.send(frame)

    def recv(self, timeout=None):
        frame = self.conn.recv(timeout)
        self._add(self._asked.pop(0) if self._asked else "?", frame, "received")
        return frame

    def close(self):
        self.conn.close()


#: Offsets of ``tcpi_bytes_acked`` (then ``tcpi_bytes_received``) and of
#: ``tcpi_total_retrans`` in Linux's struct tcp_info.
TCP_INFO_BYTES, TCP_INFO_RETRANS = 120, 100


def server_cpu_s(pids):
    """CPU seconds the server processes ``pids`` used so far (all their threads)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def run_steps(client, conns, rank, stream, num_rows, dim, cache, warmup, label,
              zero_init=False, profile=None, server_pids=()):
    """Train on ``stream`` as trainer ``rank``; per-step numbers after ``warmup`` steps.

    ``client`` is this trainer's RemoteKVClient on the counting connections ``conns``;
    with ``cache``, a CachedKVClient in front of it (a view: the connections are shared).
    The tables are fresh (named ``label``) and deleted at the end. ``zero_init``: tables
    made zero by the servers (nothing sent) and a loss that moves them from zero.
    ``profile``: a path to write cProfile's statistics (CPU time) of the timed steps to.
    """
    prof = cProfile.Profile(time.process_time) if profile else None
    kv = client if cache is None else CachedKVClient(client, cache)
    ctx = DistContext(kv, backend="pytorch", num_threads=1)
    init = None if zero_init else (lambda s, d: torch.full(s, 0.01, dtype=d))
    shift = 0.5 if zero_init else 0.0
    tables = {name: distemb.DistEmbedding(
        num_rows, dim, name=f"{label}-{name}", context=ctx,
        part_policy=range_policy(num_rows, client.num_servers), init_func=init)
        for name in stream[0]}
    opt = distemb.SparseAdagrad(list(tables.values()), lr=0.01)
    for i, step in enumerate(stream):
        if i == warmup:
            client.barrier()
            start = time.perf_counter()
            sent0, recv0 = sum(c.sent for c in conns), sum(c.received for c in conns)
            stats0 = kv.stats() if cache is not None else None
            account0 = [dict(c.account) for c in conns]
            cpu0, server0 = time.process_time(), server_cpu_s(server_pids)
            retrans0 = sum(c.retransmits for c in conns)
            if prof is not None:
                prof.enable()
        opt.zero_grad()
        loss = sum(((tables[name](torch.from_numpy(ids)) - shift) ** 2).sum()
                   for name, ids in step.items())
        loss.backward()
        opt.step()
    client.barrier()
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    server_cpu = server_cpu_s(server_pids) - server0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    n = len(stream) - warmup
    account = {}
    for c, a0 in zip(conns, account0):
        for key, v in c.account.items():
            name = "/".join(map(str, key))
            account[name] = account.get(name, 0) + (v - a0.get(key, 0)) / n
    out = dict(steps_per_s=n / seconds,
               received_per_step=(sum(c.received for c in conns) - recv0) / n,
               sent_per_step=(sum(c.sent for c in conns) - sent0) / n, account=account,
               cpu_ms_per_step=1e3 * cpu / n, server_cpu_ms_per_step=1e3 * server_cpu / n,
               retransmits=sum(c.retransmits for c in conns) - retrans0)
    if cache is not None:
        st = {k: v - stats0[k] for k, v in kv.stats().items()}
        out["hit_rate"] = st["hit_rows"] / max(1, st["unique_rows"])
    client.barrier()  # every trainer is done with the tables
    if rank == 0:
        for t in tables.values():
            client.delete_data(t.name)
    client.barrier()
    return out


def trainer_main(args):
    spec = json.load(open(args.trainer))
    cfg = parse_cluster_config(spec["cluster"])
    stream = [{k: np.asarray(v) for k, v in s.items()} for s in np.load(
        spec["streams"][args.rank], allow_pickle=True)["steps"]]
    torch.set_num_threads(1)
    conns = [Counting(tcp.connect(s.host, s.port, cfg.timeout_s)) for s in cfg.servers]
    client = RemoteKVClient(cfg, args.rank, connections=conns, num_threads=1)
    with open(os.path.join(spec["out"], "servers.json")) as f:
        # Rank 0 times the servers' CPU (both trainers step in lockstep through a run).
        server_pids = json.load(f) if args.rank == 0 else []
    out = []
    # The runs of the schedule one after the other, in these processes and on the same
    # connections: neighbours in time see the same load.
    for i, (label, cache) in enumerate(spec["schedule"]):
        out.append(run_steps(client, conns, args.rank, stream, spec["num_rows"], spec["dim"],
                             None if cache is None else parse_cache_config(cache),
                             spec["warmup"], f"{spec['label']}-{i}", spec["zero_init"],
                             profile=os.path.join(spec["profile"], f"rank{args.rank}-run{i}"
                                                  ".prof") if spec.get("profile") else None,
                             server_pids=server_pids))
    client.close(goodbye=True)
    with open(os.path.join(spec["out"], f"rank{args.rank}.json"), "w") as f:
        json.dump(out, f)


# -- jobs -----------------------------------------------------------------------------------

def env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1", OMP_NUM_THREADS="1")


def cluster(hosts, consistency="sync"):
    return {"job_id": uuid.uuid4().hex[:8], "num_trainers": hosts.num_trainers,
            "trainer_machines": hosts.trainer_machines(), "shared_memory": False,
            "timeout_s": 120.0, "servers": hosts.servers(), "consistency": consistency}


def run_job(streams, num_servers, num_rows, dim, schedule, warmup, label, rate=None,
            zero_init=False, profile=None, consistency="sync"):
    """Servers and one trainer process per stream, running every cache of ``schedule``
    (a list of CacheConfig or None) in turn; per run, the trainers' results. ``rate``:
    every process on a host of its own linked at ``rate`` bits/s; None: loopback."""
    if profile:
        os.makedirs(profile, exist_ok=True)  # the trainers write their statistics there
    with netns.JobHosts(num_servers, len(streams), rate) as hosts, \
            tempfile.TemporaryDirectory() as out:
        raw = cluster(hosts, consistency)
        cfg_path = os.path.join(out, "cluster.json")
        json.dump(raw, open(cfg_path, "w"))
        paths = []
        for r, stream in enumerate(streams):
            paths.append(os.path.join(out, f"stream{r}.npz"))
            holder = np.empty(len(stream), dtype=object)
            holder[:] = stream
            np.savez(paths[-1], steps=holder)
        spec = dict(cluster=raw, streams=paths, num_rows=num_rows, dim=dim, warmup=warmup,
                    schedule=[[str(i), None if c is None else c.to_dict()]
                              for i, c in enumerate(schedule)], out=out, label=label,
                    zero_init=zero_init, profile=profile)
        json.dump(spec, open(os.path.join(out, "spec.json"), "w"))
        prof = (lambda s: [os.path.join(ROOT, "benchmarks", "thread_profile.py"),
                           os.path.join(profile, f"server{s}.prof")]) if profile else (
            lambda s: [])
        servers = [subprocess.Popen(hosts.server(s, [
            sys.executable, *prof(s), "-m", "distemb.server", "--config", cfg_path,
            "--server-id", str(s)]), env=env()) for s in range(num_servers)]
        with open(os.path.join(out, "servers.json"), "w") as f:  # for server_cpu_s
            json.dump([p.pid for p in servers], f)
        trainers = [subprocess.Popen(hosts.trainer(r, [
            sys.executable, os.path.abspath(__file__), "--trainer",
            os.path.join(out, "spec.json"), "--rank", str(r)]), env=env())
            for r in range(len(streams))]
        try:
            for p in trainers + servers:
                if p.wait(timeout=3600) != 0:
                    raise RuntimeError(f"{p.args} exited {p.returncode}")
        finally:
            for p in trainers + servers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json")))
                 for r in range(len(streams))]
        return [[ranks[r][i] for r in range(len(streams))] for i in range(len(schedule))]


def hit_rates(streams, num_rows, warmup):
    """{(stream, policy): [hit rate per size]}, 1 server x 1 trainer, D=16, exact."""
    out = {}
    for sname, stream in streams.items():
        for policy in ("lru", "lfu"):
            res = run_job([stream], 1, num_rows, 16, [
                parse_cache_config({"policy": policy, "fraction": frac}) for frac in SIZES],
                warmup, f"hr-{sname}-{policy}")
            out[(sname, policy)] = [run[0]["hit_rate"] for run in res]
            print(f"  hit rate {sname} {policy}: {out[(sname, policy)]}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per trainer")
    p.add_argument("--warmup", type=int, default=10, help="steps before timing")
    p.add_argument("--fractions", default="0.1,0.4",
                   help="cache sizes of part 2 (fractions of the table), each policy")
    p.add_argument("--policies", default="lru,lfu", help="cache policies of part 2")
    p.add_argument("--staleness", default="5",
                   help="part 2 also runs LFU at the first size with each of these "
                   "staleness bounds, comma-separated (0: none)")
    p.add_argument("--jobs", default="1,2", help="part 2's jobs: 1 (1 server x 1 trainer), "
                   "2 (2 servers x 2 trainers)")
    p.add_argument("--plot", default="out/bench_cache_hit_rate.png")
    p.add_argument("--skip-hit-rate", action="store_true")
    p.add_argument("--streams", default="sage,deepwalk,zipf",
                   help="id streams of part 2: sage, deepwalk, zipf (WordNet), zipf10m, "
                   "uniform10m")
    p.add_argument("--dim", type=int, default=128, help="part 2's row width")
    p.add_argument("--zipf-rows", type=int, default=10_000_000, help="zipf10m's table rows")
    p.add_argument("--zipf-batch", type=int, default=13_000, help="zipf10m's ids per step")
    p.add_argument("--links", default="loopback",
                   help="part 2's links, comma-separated: 'loopback', 'veth' and/or rates "
                   "('1gbit')")
    p.add_argument("--rounds", type=int, default=3, help="rounds in turns (medians)")
    p.add_argument("--when-slower", choices=["idle", "keep", "both"], default="idle",
                   help="part 2's caches as configured by default (idle where slower than "
                        "plain pulls), always on, or both")
    p.add_argument("--consistency", default="sync", choices=["sync", "sync_exact"],
                   help="part 2's consistency: sync (updates applied on arrival) or "
                   "sync_exact (each step's updates summed at the owner)")
    p.add_argument("--profile", help="a folder for cProfile statistics of every trainer's "
                   "timed steps (rank<r>-run<i>.prof, i: the run in the schedule)")
    p.add_argument("--account", action="store_true", help="print the byte account: the "
                   "array bytes of each request kind and its reply, per step and trainer")
    p.add_argument("--trainer", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    results.add_arguments(p)
    args = p.parse_args()
    if args.trainer:
        return trainer_main(args)
    args.fractions = [float(x) for x in args.fractions.split(",")]
    try:
        args.staleness = [int(x) for x in args.staleness.split(",") if int(x)]
    except ValueError:
        p.error(f"--staleness: expected whole numbers, comma-separated, got {args.staleness!r}")
    args.jobs = [int(x) for x in args.jobs.split(",")]
    links = [netns.parse_link(x) for x in args.links.split(",")]
    netns.prepare_links(p, args.links, links)
    with results.Recorder("bench_cache", args) as rec:
        measure(args, links, rec)


def measure(args, links, rec):
    """Part 1 (hit rates, unless skipped) and part 2 (bytes, steps/s) with their tables."""
    names = args.streams.split(",")
    streams = draw_streams(names + ([] if args.skip_hit_rate else ["sage", "deepwalk"]),
                           args.steps + args.warmup, args)
    if not args.skip_hit_rate:
        n = streams["sage"][0]
        first = {k: streams[k][1][0] for k in ("sage", "deepwalk")}
        rates = hit_rates(first, n, args.warmup)
        rates.update(static_hit_rates(first, n, args.warmup))
        plot(rates, args.plot)
        print(f"\nhit rate (% of unique rows per step) vs cache size, plot: {args.plot}\n")
        print("| ids, policy | " + " | ".join(f"{s:.0%}" for s in SIZES) + " |")
        print("|---|" + "---|" * len(SIZES))
        for (sname, policy), r in rates.items():
            print(f"| {sname}, {policy} | " + " | ".join(f"{100 * x:.1f}" for x in r) + " |")
            for size, x in zip(SIZES, r):
                rec.figure(f"hit_rate.{sname}.{slug(policy)}.{100 * size:g}", 100 * x,
                           "{:.1f}%", f"{sname} ids, {policy}, a cache of {size:.0%} of the "
                           "rows: % of a step's unique rows served from it, 1 x 1")
    # a cache as configured goes idle where it is slower than plain pulls; "always on"
    # is the same cache kept caching there (--when-slower)
    modes = {"idle": [("", True)], "keep": [(" always on", False)],
             "both": [("", True), (" always on", False)]}[args.when_slower]
    configs = [(f"{pol} {frac:.0%} exact{tag}", parse_cache_config(
        {"policy": pol, "fraction": frac, "idle_when_slower": judged}))
        for frac in args.fractions for pol in args.policies.split(",") for tag, judged in modes]
    configs += [(f"lfu {args.fractions[0]:.0%} staleness {s}{tag}",
                 parse_cache_config({"policy": "lfu", "fraction": args.fractions[0],
                                     "staleness": s, "idle_when_slower": judged}))
                for s in args.staleness for tag, judged in modes]
    # Every cached run between two uncached ones (none, c1, none, c2, ..., ck, none), in
    # the same processes, for --rounds rounds; a cached run's ratio is against the mean
    # of its two neighbours: the load of a shared machine drifts less between them.
    schedule = [None]
    for _, cache in configs:
        schedule += [cache, None]
    rows, bounds, headline_rows = [], {}, {}
    for sname in names:
        num_rows, per_rank = streams[sname]
        bounds[sname] = static_hit_rates({sname: per_rank[0]}, num_rows, args.warmup,
                                         args.fractions)[(sname, "static top-k")]
        if 2 in args.jobs:
            bounds[sname + " (exact, 2 trainers)"] = [
                exact_bound(per_rank[1:3], num_rows, args.warmup, f) for f in args.fractions]
            bounds[sname + " (sync_exact with summed rows, 2 trainers)"] = [
                exact_bound(per_rank[1:3], num_rows, args.warmup, f, summed=True)
                for f in args.fractions]
            if args.account:
                rows_b = byte_bounds(per_rank[1:3], num_rows, args.warmup,
                                     args.fractions[0], 4 * args.dim)
                print(f"row bytes trainer 0 must receive per step, {sname}, 2 trainers, "
                      f"sync_exact, a clairvoyant cache of {args.fractions[0]:.0%} "
                      "(id_streams.byte_bounds): " + "; ".join(
                          f"{k} {v / 1e6:.3f} MB ({1 - v / rows_b['no cache']:.0%} fewer)"
                          for k, v in rows_b.items()), flush=True)
        for rate in links:
            for servers in args.jobs:
                per = per_rank[:1] if servers == 1 else per_rank[1:3]
                t0 = time.perf_counter()
                runs = run_job(per, servers, num_rows, args.dim, schedule * args.rounds,
                               args.warmup, f"{sname}{servers}", rate,
                               zero_init=sname.endswith("10m"), profile=args.profile,
                               consistency=args.consistency)
                job = f"{sname}, {servers}s x {len(per)}t, {netns.link_name(rate)}" + (
                    f", {args.consistency}" if args.consistency != "sync" else "")
                print(f"  {job}: {len(runs)} runs in {time.perf_counter() - t0:.0f} s, load "
                      f"average {os.getloadavg()[0]:.1f}", flush=True)
                each = [f"{run[0]['steps_per_s']:.1f} ({sum(r['retransmits'] for r in run)})"
                        for run in runs]
                print("  steps/s of each run in order (trainer 0), with the trainers' TCP "
                      "retransmits: " + "; ".join(each), flush=True)
                rows += summarize(job, runs, configs, len(schedule), args.rounds)
                if servers == args.jobs[-1]:
                    headline_rows[(sname, netns.link_name(rate))] = rows[-len(configs) - 1:]
                if args.account:
                    print_account(job, runs, [("no cache", None)] + configs)
    print(f"\nD={args.dim}, {args.steps} timed steps per trainer, one thread per process, "
          f"{os.cpu_count()} cores, medians of {args.rounds} rounds, every cached run between "
          f"two uncached ones (vs no cache: against their mean); load average now "
          f"{os.getloadavg()[0]:.1f}\n")
    print("clairvoyant static top-k hit rate of trainer 0's stream (the most frequent rows "
          "kept; exact with 2 trainers: a copy the other trainer updated since trainer 0 "
          "read it is a miss): " + "; ".join(f"{k}: " + ", ".join(f"{f:.0%} of rows {100 * h:.0f}%"
                                                     for f, h in zip(args.fractions, v))
                                for k, v in bounds.items()) + "\n")
    print("| ids, job, link | cache | steps/s per trainer | vs no cache | bytes received "
          "per step | fewer bytes | bytes sent per step | hit rate | CPU ms per step: trainer, "
          "servers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job, name, rate, ratio, recv, saved, sent, hit, cpu, scpu in rows:
        print(f"| {job} | {name} | {rate:.1f} | {ratio:.2f}x | {recv / 1e6:.2f} MB | "
              f"{100 * saved:.0f}% | {sent / 1e6:.2f} MB | {100 * hit:.0f}% | {cpu:.1f}, "
              f"{scpu:.1f} |")
        key = f"{slug(job)}.{slug(name)}"
        rec.figure(f"steps.{key}", rate, "{:.1f} steps/s", f"{job}, {name}: steps/s per trainer")
        rec.figure(f"vs_no_cache.{key}", ratio, "{:.2f}x",
                   f"{job}, {name}: steps/s over the uncached runs' beside it")
        rec.figure(f"fewer_bytes.{key}", 100 * saved, "{:.0f}%",
                   f"{job}, {name}: bytes received per step, fewer than without a cache")
        rec.figure(f"hit_rate.{key}", 100 * hit, "{:.0f}%",
                   f"{job}, {name}: % of a step's unique rows served from the cache")
    headline(rec, headline_rows, names, [netns.link_name(r) for r in links], bounds,
             args.consistency, args.jobs[-1])


if __name__ == "__main__":
    main()
