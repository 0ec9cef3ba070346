"""Steps/s of a sparse training step with tables in server processes, vs in-process.

One step: look up B random rows of a (N, D) DistEmbedding, backward a trivial loss,
SparseAdagrad.step(). Configurations, all measured in this run:

- ``in-process`` (baseline): the embedded store, no servers.
- ``1s x 1t shm``: one server and one trainer on this machine; pulls read the server's
  shared memory, updates go through the trainer's request slot.
- ``1s x 1t tcp``: the same with shared memory off.
- ``2s x 2t tcp``: two servers and two trainers, shared memory off (every row over TCP);
  steps/s is per trainer, and rows/s counts both trainers.
- with ``--dynamic``: the same step on a ``DynamicEmbedding`` (N int64 keys spread over
  the whole range; one hash store per server, keys sharded by key hash), in process,
  1s x 1t and 2s x 2t over TCP (dynamic tables have no shared-memory path).
- with ``--links loopback,1gbit,10gbit``: the two TCP jobs (and ``--dynamic``'s) once per
  link: ``loopback`` runs every process on 127.0.0.1; a rate puts every server and every
  trainer on a host of its own, a network namespace whose link to a switch is shaped to
  that rate each way (``benchmarks/netns.py``; needs root), so every row crosses a link;
  ``veth``: the same hosts, links not shaped (what the simulated network itself costs on
  this machine's CPUs). The links are checked first: a bulk TCP transfer across each.
- with ``--shm-pages both``: the shm job twice a round, its shared memory on 4 KiB
  pages (``shmem_enabled=never``, what many distributions ship) and on 2 MiB pages
  (``advise``: distemb asks for them on every shard, distemb/pages.py); the machine's
  setting is switched for each run and restored after (needs root). The default,
  ``machine``, runs it once under the setting the machine has, and names it.
- with ``--file``: the same step on a file table (``storage=FileTableSpec(...)``: rows in
  memory-mapped files, in the page cache after warm-up), in process, 1s x 1t with shared
  memory (the trainer maps the server's file and reads its rows in place) and 1s x 1t
  over TCP (every row on the socket).
- with ``--dtype bfloat16`` (or ``float16``): every distemb table above keeps 16-bit rows,
  which cross the sockets and shared memory in 2 bytes a value (gradients in float32).
- with ``--prefetch``: every TCP job again with each next batch's rows prefetched while
  the current batch computes (``distemb.pipeline.Prefetcher``: the Pulls go out before
  the step, their replies are read on a helper thread while the update is sent, and
  the update's reply patches the rows it wrote); a table gives each job's steps/s with
  prefetch over without, same round (the results are the same bit for bit:
  tests/test_prefetch.py). The shared-memory job too: there the prefetch names the rows
  the trainer reads next, which the co-located server writes first.
- with ``--dgl``: DGL 1.1.3's distributed KVStore (``dgl.distributed.DistEmbedding`` +
  its SparseAdagrad) on a one-partition random graph of N nodes, 1x1 and 2x2. DGL has
  one partition per machine, so its second server is a backup server of the same
  partition, and DGL always reads co-located partitions through shared memory.

Usage::

    PYTHONPATH=. python benchmarks/bench_kvstore.py [--steps 50] [--batch 4096] [--dim 128]
        [--dtype float32|bfloat16|float16] [--dgl] [--dynamic] [--file] [--rounds 3]
        [--only-shm] [--links loopback,veth,10gbit,1gbit]
        [--shm-pages machine|both] [--prefetch]
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

import distemb
from distemb.context import DistContext
from distemb.pages import SHMEM_ENABLED, shmem_setting
from distemb.stores import key_uniform
from distemb.stores.file import FileTableSpec
from distemb.transport import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netns  # noqa: E402
import results  # noqa: E402


def train(ctx, args):
    """Steps/s of ``args.steps`` timed steps (after warm-up) in context ``ctx``."""
    rng = np.random.default_rng(ctx.rank)
    batches = [torch.from_numpy(rng.integers(0, args.rows, args.batch))
               for _ in range(args.steps + args.warmup)]
    if args.dynamic_table:  # N keys spread over the int64 range, rows made on first use
        emb = distemb.DynamicEmbedding(args.dim, name="bench", context=ctx,
                                       init_func=key_uniform(args.dim, 0.01, 0.02),
                                       dtype=args.dtype)
        batches = [ids * 3_000_000_000_019 - 2 ** 62 for ids in batches]
        # Every key inserted before timing, as the dense table has every row: the step is
        # compared at steady state (making a new key's row is the initialiser's cost).
        keys = torch.arange(args.rows) * 3_000_000_000_019 - 2 ** 62
        with torch.no_grad():
            for chunk in keys.split(65536)[ctx.rank::ctx.num_trainers]:
                emb(chunk)
    elif args.file_table:  # rows in files under a fresh directory (one per job)
        spec = FileTableSpec(args.file_table, num_rows=args.rows, dim=args.dim,
                             init=key_uniform(args.dim, 0.01, 0.02), dtype=args.dtype)
        emb = distemb.DistEmbedding(args.rows, args.dim, name="bench", storage=spec,
                                    context=ctx)
    else:
        emb = distemb.DistEmbedding(args.rows, args.dim, name="bench",
                                    init_func=lambda s, d: torch.full(s, 0.01, dtype=d),
                                    context=ctx, dtype=args.dtype)
    opt = distemb.SparseAdagrad([emb], lr=0.01)
    pipeline = batches
    if getattr(args, "prefetch_rows", False):  # (imported here: older trees have none)
        from distemb.pipeline import Prefetcher
        pipeline = Prefetcher(batches, lambda ids: [(emb, ids)])
    for i, ids in enumerate(pipeline):
        if i == args.warmup:
            ctx.client.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        emb(ids).sum().backward()
        opt.step()
    ctx.client.barrier()
    return args.steps / (time.perf_counter() - start)


def trainer_main(args):
    torch.set_num_threads(1)
    ctx = distemb.initialize(num_threads=1)
    rate = train(ctx, args)
    with open(os.path.join(args.out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"steps_per_s": rate}, f)
    distemb.shutdown()


#: --shm-pages both: the two settings of shared memory's huge pages, named by page size.
SHM_PAGES = {"never": "4 KiB shared pages", "advise": "2 MiB shared pages"}


@contextlib.contextmanager
def shmem_policy(value):
    """The machine's ``shmem_enabled`` set to ``value`` for the block, then restored."""
    before = shmem_setting()
    with open(SHMEM_ENABLED, "w") as f:
        f.write(value)
    try:
        yield
    finally:
        with open(SHMEM_ENABLED, "w") as f:
            f.write(before)


def run_under(value, run):
    with shmem_policy(value):
        return run()


def run_cluster(args, servers, trainers, shm, dynamic=False, file=False, prefetch=False):
    """Launch a job on 127.0.0.1 running this script as trainer; per-trainer steps/s."""
    with tempfile.TemporaryDirectory() as out:
        ip = os.path.join(out, "ip.txt")
        with open(ip, "w") as f:
            f.write(f"127.0.0.1 {ports.free_port(8)}\n")
        argv = [sys.executable, "-m", "distemb.launch", "--ip-config", ip, "--num-servers",
                str(servers), "--num-trainers", str(trainers), "--config-out",
                os.path.join(out, "cluster.json")]
        argv += [] if shm else ["--no-shared-memory"]
        argv += ["--", sys.executable, os.path.abspath(__file__), "--trainer", "--out", out,
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
                 str(args.batch), "--dim", str(args.dim), "--rows", str(args.rows),
                 "--dtype", args.dtype]
        argv += ["--dynamic-table"] if dynamic else []
        argv += ["--file-table", os.path.join(out, "table")] if file else []
        argv += ["--prefetch-rows"] if prefetch else []
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1")
        subprocess.run(argv, env=env, check=True, timeout=600)
        return [json.load(open(os.path.join(out, f"rank{r}.json")))["steps_per_s"]
                for r in range(trainers)]


def run_hosts(args, servers, trainers, rate, dynamic=False, prefetch=False):
    """The job with every process on a host of its own, linked at ``rate`` bits/s, or all
    on 127.0.0.1 (``rate=None``), started here without a launcher (every process's parent
    is this one); shared memory off. Per-trainer steps/s."""
    with tempfile.TemporaryDirectory() as out, netns.JobHosts(servers, trainers, rate) as hosts:
        path = os.path.join(out, "cluster.json")
        with open(path, "w") as f:
            json.dump({"job_id": uuid.uuid4().hex[:8], "num_trainers": trainers,
                       "trainer_machines": hosts.trainer_machines(), "servers": hosts.servers(),
                       "shared_memory": False, "timeout_s": 120.0}, f)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1", DISTEMB_CONFIG=path)
        procs = [subprocess.Popen(hosts.server(s, [
            sys.executable, "-m", "distemb.server", "--config", path, "--server-id", str(s)]),
            env=dict(env, DISTEMB_ROLE="server", DISTEMB_RANK=str(s))) for s in range(servers)]
        try:
            procs += [subprocess.Popen(hosts.trainer(r, [
                sys.executable, os.path.abspath(__file__), "--trainer", "--out", out, "--steps",
                str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                "--dim", str(args.dim), "--rows", str(args.rows), "--dtype", args.dtype]
                + (["--dynamic-table"] if dynamic else [])
                + (["--prefetch-rows"] if prefetch else [])),
                env=dict(env, DISTEMB_ROLE="trainer", DISTEMB_RANK=str(r)))
                for r in range(trainers)]
            for p in procs[servers:] + procs[:servers]:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"{p.args} exited {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [json.load(open(os.path.join(out, f"rank{r}.json")))["steps_per_s"]
                for r in range(trainers)]


def run_dgl(args, servers, trainers, workdir):
    """DGL's distributed KVStore on 127.0.0.1; per-trainer steps/s."""
    ip = os.path.join(workdir, "ip.txt")
    port = ports.free_port(servers + 1)  # the servers', then the master's
    with open(ip, "w") as f:
        f.write(f"127.0.0.1 {port}\n")
    common = dict(os.environ, DGL_IP_CONFIG=ip, DGL_NUM_SERVER=str(servers),
                  DGL_NUM_CLIENT=str(trainers), DGL_CONF_PATH=os.path.join(workdir, "g.json"),
                  DGL_NUM_SAMPLER="0", DGL_GRAPH_FORMAT="csc", OMP_NUM_THREADS="1",
                  OMP_WAIT_POLICY="passive", BENCH_DIM=str(args.dim),
                  BENCH_BATCH=str(args.batch), BENCH_STEPS=str(args.steps),
                  BENCH_WARMUP=str(args.warmup), MASTER_PORT=str(port + servers))
    job = os.path.join(ROOT, "benchmarks", "dgl_kvstore_job.py")
    procs = [subprocess.Popen([sys.executable, job], env=dict(
        common, DGL_ROLE="server", DGL_SERVER_ID=str(s)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL) for s in range(servers)]
    try:
        trainers_p = [subprocess.Popen([sys.executable, job], env=dict(
            common, DGL_ROLE="default", DGL_DIST_MODE="distributed", RANK=str(r),
            WORLD_SIZE=str(trainers)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True) for r in range(trainers)]
        outs = [p.communicate(timeout=600)[0] for p in trainers_p]
        for p in procs:
            p.wait(timeout=60)  # DGL servers exit once every trainer has
    finally:
        for p in procs + trainers_p:
            if p.poll() is None:
                p.kill()
    return [json.loads(line)["steps_per_s"] for out in outs for line in out.splitlines()
            if line.startswith("{")]


DGL_1X1 = "DGL DistEmbedding, 1 server x 1 trainer"


def slug(name):
    """A configuration's name as a figure name: '1 server x 1 trainer, shm' ->
    '1_server_x_1_trainer_shm'."""
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def dgl_graph(args, workdir):
    """Partition a random graph of ``args.rows`` nodes for DGL's job into ``workdir``."""
    import dgl  # optional: only with --dgl
    g = dgl.rand_graph(args.rows, 2 * args.rows)
    dgl.distributed.partition_graph(g, "g", 1, workdir, part_method="random")


def make_parser():
    """This script's options (other benchmarks run its step with them: step_args)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="storage dtype of every distemb table (half rows: 2 bytes a value "
                        "in shards and on the wire)")
    p.add_argument("--dgl", action="store_true", help="also run DGL's distributed KVStore")
    p.add_argument("--prefetch", action="store_true",
                   help="also run every job but the in-process one with each next batch's rows "
                        "prefetched")
    p.add_argument("--prefetch-rows", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dynamic", action="store_true",
                   help="also run the step on a DynamicEmbedding (in process and on servers)")
    p.add_argument("--dynamic-table", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--file", action="store_true",
                   help="also run the step on a file table (in process, 1x1 shm and tcp)")
    p.add_argument("--file-table", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every configuration in turns; print medians")
    p.add_argument("--only-shm", action="store_true",
                   help="only the in-process baseline and 1 server x 1 trainer, shm")
    p.add_argument("--links", default="loopback",
                   help="links of the TCP jobs, comma-separated: 'loopback', 'veth' (hosts "
                   "in namespaces, unshaped) and/or rates ('1gbit', '10gbit'): each server "
                   "and trainer on its own shaped host")
    p.add_argument("--shm-pages", choices=["machine", "both"], default="machine",
                   help="'both': run the shm job on 4 KiB and on 2 MiB shared pages, "
                   "switching the machine's shmem_enabled (a kernel setting) for each run "
                   "and restoring it after (root); the default changes nothing")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    results.add_arguments(p)
    return p


def step_args(**fields):
    """The options train(), run_cluster() and run_dgl() read: this script's defaults with
    ``fields`` replaced, for another benchmark that runs this step (bench_collective)."""
    args = make_parser().parse_args([])
    unknown = sorted(set(fields) - set(vars(args)))
    if unknown:
        raise TypeError(f"step_args: bench_kvstore has no options {unknown}")
    vars(args).update(fields)
    return args


def main():
    p = make_parser()
    args = p.parse_args()
    if args.trainer:
        return trainer_main(args)
    torch.set_num_threads(1)
    if args.shm_pages == "both":
        if not os.access(SHMEM_ENABLED, os.W_OK):
            p.error(f"--shm-pages both: {SHMEM_ENABLED} is not writable here (run as root)")
        netns.exit_on_sigterm()  # a kill still restores the machine's setting
    links = [netns.parse_link(x) for x in args.links.split(",")]
    netns.prepare_links(p, args.links, links)
    workdir = tempfile.TemporaryDirectory()
    if args.shm_pages == "both":
        configs = [(f"1 server x 1 trainer, shm, {pages}", lambda value=value, **kw: (
            run_under(value, lambda: run_cluster(args, 1, 1, shm=True, **kw))))
            for value, pages in SHM_PAGES.items()]
    else:
        configs = [(f"1 server x 1 trainer, shm ({shmem_setting()} shmem_enabled)",
                    lambda **kw: run_cluster(args, 1, 1, shm=True, **kw))]
    prefetched = {}  # configuration with prefetch -> the same without
    if args.prefetch:
        for name, run in list(configs):
            configs.append((f"{name}, prefetch", lambda run=run: run(prefetch=True)))
            prefetched[configs[-1][0]] = name
    side = {}  # (job, link) -> configuration name: the side-by-side table of --links

    def on(job, rate):
        name = job + ("" if rate is None and len(links) == 1
                      else f" over {netns.link_name(rate)}")
        side[(job, netns.link_name(rate))] = name
        return name

    if not args.only_shm:
        for rate in links:
            for s, t in ((1, 1), (2, 2)):
                job = f"{s} server{'s' * (s > 1)} x {t} trainer{'s' * (t > 1)}, tcp"
                configs.append((on(job, rate), lambda rate=rate, s=s, t=t:
                                run_hosts(args, s, t, rate)))
                if args.prefetch:
                    configs.append((on(job + ", prefetch", rate),
                                    lambda rate=rate, s=s, t=t:
                                    run_hosts(args, s, t, rate, prefetch=True)))
                    prefetched[configs[-1][0]] = configs[-2][0]
    if args.dynamic:
        def in_process_dynamic():
            ns = argparse.Namespace(**{**vars(args), "dynamic_table": True})
            return [train(DistContext.embedded(num_threads=1), ns)]
        configs.append(("dynamic, in-process", in_process_dynamic))
        for rate in links:
            configs += [(on("dynamic, 1 server x 1 trainer, tcp", rate),
                         lambda rate=rate: run_hosts(args, 1, 1, rate, dynamic=True)),
                        (on("dynamic, 2 servers x 2 trainers, tcp", rate),
                         lambda rate=rate: run_hosts(args, 2, 2, rate, dynamic=True))]
    if args.file:
        def in_process_file():
            with tempfile.TemporaryDirectory() as d:
                ns = argparse.Namespace(**{**vars(args), "file_table": os.path.join(d, "t")})
                ctx = DistContext.embedded(num_threads=1)
                try:
                    return [train(ctx, ns)]
                finally:
                    ctx.close()  # its files flushed and unlocked
        configs += [("file table, in-process", in_process_file),
                    ("file table, 1 server x 1 trainer, shm",
                     lambda: run_cluster(args, 1, 1, shm=True, file=True)),
                    ("file table, 1 server x 1 trainer, tcp",
                     lambda: run_cluster(args, 1, 1, shm=False, file=True))]
    if args.dgl:
        dgl_graph(args, workdir.name)
        configs.append((DGL_1X1, lambda: run_dgl(args, 1, 1, workdir.name)))
        if not args.only_shm:
            configs.append(("DGL DistEmbedding, 2 servers x 2 trainers",
                            lambda: run_dgl(args, 2, 2, workdir.name)))
    with results.Recorder("bench_kvstore", args) as rec:
        # Configurations in turns, each round against its own in-process baseline (and DGL
        # 1 x 1): on a shared machine the load drifts, and a ratio of neighbours in time
        # drifts less.
        rates = {name: [] for name in ["in-process (baseline)"] + [c[0] for c in configs]}
        ratios = {name: [] for name in rates}
        for r in range(args.rounds):
            base = train(DistContext.embedded(num_threads=1), args)
            rates["in-process (baseline)"].append([base])
            ratios["in-process (baseline)"].append(1.0)
            for name, run in configs:
                got = run()
                rates[name].append(got)
                ratios[name].append(sum(got) / base)
            print(f"round {r + 1}/{args.rounds}: in-process {base:.1f}, " + ", ".join(
                f"{name} {np.mean(rates[name][-1]):.1f}" for name, _ in configs) +
                f" steps/s; load average {os.getloadavg()[0]:.1f}", flush=True)
        workdir.cleanup()
        print(f"\nB={args.batch} D={args.dim} N={args.rows} {args.dtype} steps={args.steps}, "
              f"one thread per process, {os.cpu_count()} cores, {args.rounds} round(s) in "
              "turns, medians\n")
        print("| configuration | steps/s per trainer | rows/s (all trainers) | vs in-process |"
              + (" vs DGL 1 x 1 |" if args.dgl else ""))
        print("|---|---|---|---|" + ("---|" if args.dgl else ""))
        for name in rates:
            mean = float(np.median([np.mean(r) for r in rates[name]]))
            total = float(np.median([sum(r) for r in rates[name]])) * args.batch
            ratio = float(np.median(ratios[name]))
            # per trainer, against DGL's one trainer of the same round
            vs_dgl = None if not args.dgl else float(np.median(
                [np.mean(a) / b[0] for a, b in zip(rates[name], rates[DGL_1X1])]))
            print(f"| {name} | {mean:.1f} | {total / 1e6:.2f} M | {ratio:.2f}x |"
                  + ("" if vs_dgl is None else f" {vs_dgl:.2f}x |"))
            key = slug(name)
            rec.figure(f"steps.{key}", mean, "{:.1f} steps/s", f"{name}: steps/s per trainer")
            rec.figure(f"vs_inprocess.{key}", ratio, "{:.2f}x",
                       f"{name}: steps/s (all trainers) over the in-process step's, same round")
            if vs_dgl is not None:
                rec.figure(f"vs_dgl.{key}", vs_dgl, "{:.2f}x",
                           f"{name}: steps/s per trainer over DGL's 1 x 1 trainer's, same round")
        if prefetched:
            print("\nprefetch: steps/s per trainer with prefetch over without, same round "
                  "(median of the rounds' ratios)\n")
            print("| job | with / without prefetch |")
            print("|---|---|")
            for name, base in prefetched.items():
                ratio = float(np.median([np.mean(a) / np.mean(b)
                                         for a, b in zip(rates[name], rates[base])]))
                print(f"| {base} | {ratio:.2f}x |")
                rec.figure(f"prefetch.{slug(base)}", ratio, "{:.2f}x",
                           f"{base}: steps/s per trainer with prefetch over without, same "
                           "round")
        if len(links) > 1:
            names = [netns.link_name(rate) for rate in links]
            first = names[0]
            print(f"\nthe TCP jobs side by side: steps/s per trainer (medians; in brackets: vs "
                  f"{first}, same round)\n")
            print("| job | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
            for job in dict.fromkeys(job for job, _ in side):
                cells = []
                for link in names:
                    got, ref = rates[side[(job, link)]], rates[side[(job, first)]]
                    cells.append(f"{float(np.median([np.mean(r) for r in got])):.1f} ("
                                 + "%.2fx" % np.median([np.mean(a) / np.mean(b)
                                                        for a, b in zip(got, ref)]) + ")")
                print(f"| {job} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
