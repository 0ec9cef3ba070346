"""DeepWalk on servers with and without prefetching the next batch's rows: steps/s per trainer.

Runs ``graph_examples/deepwalk.py`` (skip-gram on WordNet walks, sparse Adam) as a job
of S servers x T trainers (``--hosts 2x2``, also ``1x1``), over each link of
``--links``: ``loopback`` runs every process on 127.0.0.1; a rate (``1gbit``) puts
every server and every trainer on a host of its own, a network namespace whose link is
shaped to that rate each way (``benchmarks/netns.py``; needs root), so every row crosses
a link. Each job runs once a round per side, on fresh servers each time (fresh
tables), with the same seed (the same walks, batches and steps: ``--steps`` per
trainer), the sides in turns over ``--rounds``:

- ``none`` (the baseline): ``--no-prefetch-rows``;
- ``prefetch``: deepwalk.py's default, ``distemb.pipeline.Prefetcher``, which times its
  iterations and stops prefetching for a while where that is no faster;
- ``every`` (``--sides prefetch,every``): every batch prefetched
  (``--prefetch-every-batch``), what prefetch itself does to a step.

Each trainer times its own steps (deepwalk.py ``--train-only``: the end of every step,
and where the time went: between steps (the wait for the sampler, the prefetch sent),
lookups with forward and backward, the optimizer step); the first ``--warmup`` steps are
left out. Printed per job, link and side: the median steps/s per trainer, the median of
the rounds' ratios over ``none`` (same round), ms per step in each phase, the share of
lookups that were prefetched and the MB per step of rows the updates' replies patched
(the trainers' prefetch counters), and the bytes a trainer's step moves each way (the
rows of its unique ids) against the link's rate.

Usage::

    PYTHONPATH=. python benchmarks/bench_deepwalk_cluster.py [--dataset wordnet]
        [--hosts 2x2,1x1] [--links loopback,1gbit] [--shared-memory] [--sides prefetch,every]
        [--steps 200] [--warmup 10] [--rounds 3] [--timeout 600]
        [-- more deepwalk.py options]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("DGLBACKEND", "pytorch")
ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import numpy as np  # noqa: E402

import netns  # noqa: E402
import results  # noqa: E402
from graph_examples import deepwalk  # noqa: E402
from graph_examples.walks import SkipGramBatches  # noqa: E402

DEEPWALK = os.path.join(ROOT, "graph_examples", "deepwalk.py")
#: deepwalk.py's timed phases, per step: 'sample' is the time between two steps (the wait
#: for the sampler thread, and the Prefetcher sending the next batch's Pulls), 'step' the
#: optimizer's (the update sent, its replies awaited).
PHASES = ("sample", "forward_backward", "step")


def parse_hosts(text):
    """``'2x2'`` -> (2 servers, 2 trainers).

    Raises:
        ValueError: naming the text and the expected form.
    """
    s, sep, t = text.partition("x")
    if not (sep and s.isdigit() and t.isdigit() and int(s) >= 1 and int(t) >= 1):
        raise ValueError(f"--hosts: expected SERVERSxTRAINERS such as '2x2', got {text!r}")
    return int(s), int(t)


def env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_WAIT_POLICY="passive", DISTEMB_NUM_THREADS="1", OMP_NUM_THREADS="1")


def run_job(args, servers, trainers, rate, options, workdir):
    """One DeepWalk job on fresh servers (fresh tables), ``options`` added to deepwalk.py's
    (a side's); each trainer's timing, by rank.

    Every process is started here (no launcher), bounded by ``args.timeout`` and, if it
    has not exited by then, killed by the PID it was started with; the namespaces go on
    leaving the ``with`` block.
    """
    out = tempfile.mkdtemp(prefix=f"{servers}x{trainers}-", dir=workdir)
    deadline = time.monotonic() + args.timeout
    procs, logs = [], []
    with netns.JobHosts(servers, trainers, rate) as hosts:
        path = os.path.join(out, "cluster.json")
        with open(path, "w") as f:
            json.dump({"job_id": uuid.uuid4().hex[:8], "num_trainers": trainers,
                       "trainer_machines": hosts.trainer_machines(), "servers": hosts.servers(),
                       "shared_memory": args.shared_memory and rate is None,
                       "timeout_s": 120.0}, f)
        base = dict(env(), DISTEMB_CONFIG=path)

        def start(name, argv, role, rank):
            log = open(os.path.join(out, f"{name}.log"), "w")
            logs.append(log)
            procs.append((name, subprocess.Popen(argv, env=dict(
                base, DISTEMB_ROLE=role, DISTEMB_RANK=str(rank)), stdout=log,
                stderr=subprocess.STDOUT)))
        try:
            for s in range(servers):
                start(f"server{s}", hosts.server(s, [
                    sys.executable, "-m", "distemb.server", "--config", path,
                    "--server-id", str(s)]), "server", s)
            for r in range(trainers):
                start(f"trainer{r}", hosts.trainer(r, [
                    sys.executable, DEEPWALK, "--quiet", "--threads", "1", "--train-only",
                    "--out", out, "--dataset", args.dataset, "--seed", str(args.seed),
                    "--max-steps", str(args.steps * trainers),
                    *options, *args.deepwalk_args]), "trainer", r)
            # trainers first: the servers exit once every trainer has shut down
            for name, p in procs[servers:] + procs[:servers]:
                try:
                    code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{name} still running after --timeout "
                                       f"{args.timeout} s:\n{tail(out, name)}") from None
                if code != 0:
                    raise RuntimeError(f"{name} exited {code}:\n{tail(out, name)}")
        finally:
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    return [json.load(open(os.path.join(out, f"train-rank{r}.json"))) for r in range(trainers)]


def tail(out, name, lines=30):
    with open(os.path.join(out, f"{name}.log")) as f:
        return "".join(f.readlines()[-lines:])


def steady(timing, warmup):
    """Steps/s of a trainer after its first ``warmup`` steps, and its seconds per step
    in each phase over all steps."""
    ends = timing["step_ends"]
    if len(ends) <= warmup + 1:
        raise RuntimeError(f"--warmup {warmup}: a trainer took only {len(ends)} steps; "
                           "raise --steps")
    rate = (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])
    return rate, {k: timing["phase_seconds"][k] / len(ends) for k in PHASES}


def rows_per_step(args, strides):
    """What a trainer's step moves, over the stream's first 40 batches: the mean bytes of
    rows it pulls (and pushes as gradients: float32 rows of the unique ids of its two
    lookups), the batch size, and per stride T (trainers) the mean share of those rows
    that the trainer's next batch (T batches on) looks up again (with prefetch, they come
    back patched on the update's reply)."""
    dw = deepwalk.parse_args(["--dataset", args.dataset, "--seed", str(args.seed),
                              *args.deepwalk_args])
    graph = deepwalk.load(dw).graph
    deepwalk.resolve_batch_size(dw, graph)
    batches = SkipGramBatches(graph, dw.walk_length, dw.window, dw.num_walks, dw.negatives,
                              dw.batch_size, dw.p, dw.q, dw.seed)
    ids = []  # per batch: (unique centre ids, unique context ids)
    for _, batch in zip(range(40), batches.epoch(0)):
        u_ids, _, c_ids, _, _ = deepwalk.unique_batch(batch)
        ids.append((u_ids.numpy(), c_ids.numpy()))
    rows = [len(u) + len(c) for u, c in ids]
    shared = {t: float(np.mean([
        sum(len(np.intersect1d(a, b, assume_unique=True)) for a, b in zip(ids[i], ids[i + t]))
        / rows[i] for i in range(len(ids) - t)])) for t in strides}
    return float(np.mean(rows)) * dw.dim * 4, dw.batch_size, shared, dw.dim


def ahead(timings, dim):
    """Share of a job's lookups that were prefetched, and MB per step of rows the
    updates' replies patched (the trainers' prefetch counters; 0 without)."""
    stats = [t["prefetch_stats"] or {} for t in timings]
    steps = sum(len(t["step_ends"]) for t in timings)
    lookups = 2 * steps  # the node table's and the context table's
    return (sum(s.get("prefetches", 0) for s in stats) / lookups,
            sum(s.get("patched_rows", 0) for s in stats) * dim * 4 / 1e6 / steps)


#: The ways a job runs: deepwalk.py's options for each (the baseline, ``none``, last).
SIDES = {"prefetch": ["--prefetch-rows"],
         "every": ["--prefetch-rows", "--prefetch-every-batch"],
         "none": ["--no-prefetch-rows"]}
SIDE_TEXT = {"prefetch": "deepwalk.py's default: the Prefetcher, which stops prefetching "
             "for a while where it finds iterations no faster",
             "every": "every batch prefetched (--prefetch-every-batch)",
             "none": "--no-prefetch-rows (the baseline)"}
#: the figure name of each side's ratio over ``none``
FIGURE = {"prefetch": "prefetch", "every": "prefetch_every"}


def make_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="wordnet", help="deepwalk.py's --dataset")
    p.add_argument("--hosts", default="2x2",
                   help="jobs, comma-separated SERVERSxTRAINERS (e.g. '2x2,1x1')")
    p.add_argument("--links", default="loopback,1gbit",
                   help="links, comma-separated: 'loopback', 'veth' (hosts in namespaces, "
                   "unshaped) and/or rates ('1gbit', '10gbit'; root)")
    p.add_argument("--shared-memory", action="store_true",
                   help="loopback jobs with shared memory on: each trainer reads the rows "
                        "of the servers on its machine in place, and hands its updates "
                        "over shared memory (the default: every row on the socket)")
    p.add_argument("--steps", type=int, default=200, help="steps per trainer")
    p.add_argument("--warmup", type=int, default=10, help="first steps not timed")
    p.add_argument("--rounds", type=int, default=3,
                   help="each job with and without prefetch, in turns; medians")
    p.add_argument("--sides", default="prefetch",
                   help="besides the baseline (no prefetch), comma-separated: 'prefetch' "
                   "(deepwalk.py's default, judged by the Prefetcher's own timing) and/or "
                   "'every' (every batch prefetched)")
    p.add_argument("--seed", type=int, default=0, help="deepwalk.py's --seed (every run)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds one job may run before its processes are killed")
    p.add_argument("deepwalk_args", nargs="*",
                   help="more deepwalk.py options, after -- (e.g. -- --batch-size 4096)")
    results.add_arguments(p)
    return p


def main():
    p = make_parser()
    args = p.parse_args()
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps - 1:
        p.error(f"--warmup: must be in [0, --steps - 1), got {args.warmup} "
                f"(--steps {args.steps})")
    unknown = set(args.sides.split(",")) - (set(SIDES) - {"none"})
    if unknown:
        p.error(f"--sides: expected 'prefetch' and/or 'every', got {args.sides!r}")
    try:
        jobs = [parse_hosts(x) for x in args.hosts.split(",")]
        links = [netns.parse_link(x) for x in args.links.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    netns.prepare_links(p, args.links, links)
    nbytes, batch, shared, dim = rows_per_step(args, sorted({t for _, t in jobs}))
    configs = [(s, t, rate) for rate in links for s, t in jobs]
    sides = [x for x in SIDES if x in args.sides.split(",")] + ["none"]
    got = {(c, side): [] for c in configs for side in sides}  # [(steps/s, phases, ahead)]
    with results.Recorder("bench_deepwalk_cluster", args) as rec, \
            tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for c in configs:
                # the order turns each round: no side always runs after another
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    timings = run_job(args, *c, SIDES[side], workdir)
                    each = [steady(t, args.warmup) for t in timings]
                    got[(c, side)].append((float(np.mean([e[0] for e in each])), {
                        k: float(np.mean([e[1][k] for e in each])) for k in PHASES},
                        ahead(timings, dim)))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{s}x{t} {netns.link_name(rate)} " + "/".join(
                    f"{got[((s, t, rate), side)][-1][0]:.2f}" for side in sides)
                for s, t, rate in configs)
                + f" steps/s ({'/'.join(sides)}); load average {os.getloadavg()[0]:.1f}",
                flush=True)
        print(f"\nDeepWalk on {args.dataset}, {batch:,} pairs a step, {args.steps} steps per "
              f"trainer ({args.warmup} not timed), one thread per process, "
              f"{os.cpu_count()} cores, {args.rounds} round(s) in turns, medians; a step "
              f"moves ~{nbytes / 1e6:.1f} MB of rows each way per trainer, of which a "
              "trainer's next batch looks up again " + ", ".join(
                  f"{100 * v:.0f}% ({t} trainer{'s' * (t > 1)})" for t, v in shared.items())
              + f"\nsides: {'; '.join(f'{x}: {SIDE_TEXT[x]}' for x in sides)}\n")
        print("| job | link | rows | steps/s | vs none | ms/step sample, fwd+bwd, step | "
              "lookups prefetched | MB/step patched | wire ms/step each way |")
        print("|---|---|---|---|---|---|---|---|---|")
        for s, t, rate in configs:
            link = netns.link_name(rate)
            key = f"{s}x{t}_{link}"
            wire = "-" if rate in (None, netns.VETH) else f"{1e3 * nbytes * 8 / rate:.0f}"
            for side in sides:
                runs, base = got[((s, t, rate), side)], got[((s, t, rate), "none")]
                ratio = float(np.median([a[0] / b[0] for a, b in zip(runs, base)]))
                phases = ", ".join(f"{1e3 * np.median([x[1][k] for x in runs]):.0f}"
                                   for k in PHASES)
                steps = float(np.median([x[0] for x in runs]))
                print(f"| {s}x{t} | {link} | {side} | {steps:.2f} | {ratio:.2f}x | {phases} | "
                      f"{np.median([x[2][0] for x in runs]):.0%} | "
                      f"{np.median([x[2][1] for x in runs]):.1f} | {wire} |")
                rec.figure(f"steps_{side}.{key}", steps, "{:.2f} steps/s",
                           f"DeepWalk {s}x{t} over {link}, {side}: steps/s per trainer")
                if side != "none":
                    rec.figure(f"{FIGURE[side]}.{key}", ratio, "{:.2f}x",
                               f"DeepWalk {s}x{t} over {link}: steps/s per trainer, "
                               f"{SIDE_TEXT[side]}, over no prefetch, same round")
        rec.figure("mb_per_step", nbytes / 1e6, "{:.1f} MB",
                   "rows one trainer's step pulls (and pushes as gradients), float32")
        for t, v in shared.items():
            rec.figure(f"shared_next.{t}", 100 * v, "{:.0f}%", f"share of a trainer's rows "
                       f"that its next batch looks up again, {t} trainer(s)")


if __name__ == "__main__":
    main()
