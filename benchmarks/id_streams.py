"""The id streams of bench_cache.py, and the hit rates no cache can beat on them.

A stream is, per step, ``{table name: int64 ids}`` one trainer looks up. WordNet's come
from graph_examples (DGL's neighbour sampler, DeepWalk's skip-gram batches, zipf(1.1)
ranks over its nodes); ``zipf10m`` is a recommendation-like Zipf(1.05) over a large table.
"""
import time

import numpy as np
import torch

SIZES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


def sage_stream(graph, train_idx, steps, rank, num_trainers, seed=0):
    """Per step, {table: ids}: the input nodes of NeighborSampler([10, 10]) batches."""
    from distemb.integrations.dgl import dgl

    nodes = train_idx[rank::num_trainers]
    sampler = dgl.dataloading.NeighborSampler([10, 10])
    torch.manual_seed(seed + rank)
    loader = dgl.dataloading.DataLoader(graph, nodes, sampler, batch_size=1024, shuffle=True,
                                        drop_last=False)
    out = []
    while len(out) < steps:
        for input_nodes, _, _ in loader:
            out.append({"nodes": input_nodes.numpy().astype(np.int64)})
            if len(out) == steps:
                break
    return out


def zipf_stream(num_rows, steps, rank, size=13_000, a=1.1, seed=0):
    """Per step, {table: ids}: ``size`` zipf(a) draws, ranks scattered over the table."""
    rng = np.random.default_rng(seed + 100 + rank)
    perm = np.random.default_rng(seed).permutation(num_rows)
    return [{"nodes": perm[(rng.zipf(a, size) - 1) % num_rows].astype(np.int64)}
            for _ in range(steps)]


def zipf_table_stream(num_rows, steps, ranks, size, a=1.05, seed=0):
    """Per trainer rank in ``ranks``, per step, {table: ids}: ``size`` draws of a Zipf(a)
    truncated to ``num_rows`` ranks (p(k) ~ k^-a, k = 1..num_rows), scattered by a fixed
    permutation (hot rows land on every server)."""
    cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    perm = np.random.default_rng(seed).permutation(num_rows)
    out = []
    for rank in ranks:
        rng = np.random.default_rng(seed + 200 + rank)
        out.append([{"nodes": perm[np.minimum(np.searchsorted(cdf, rng.random(size)),
                                              num_rows - 1)]} for _ in range(steps)])
    return out


def uniform_stream(num_rows, steps, rank, size, seed=0):
    """Per step, {table: ids}: ``size`` ids drawn uniformly from ``num_rows``."""
    rng = np.random.default_rng(seed + 300 + rank)
    return [{"nodes": rng.integers(0, num_rows, size)} for _ in range(steps)]


def deepwalk_stream(graph, steps, rank, seed=0):
    """Per step, {table: ids}: a skip-gram batch's centres and contexts + negatives."""
    from graph_examples.walks import SkipGramBatches

    batches = SkipGramBatches(graph, walk_length=20, window=3, num_walks=2, negatives=5,
                              batch_size=4096, seed=seed + rank)
    out = []
    for centers, contexts, negatives in batches.epoch(0):
        out.append({"nodes": centers.numpy().astype(np.int64),
                    "contexts": torch.cat([contexts, negatives.reshape(-1)]).numpy()
                    .astype(np.int64)})
        if len(out) == steps:
            break
    return out


def static_hit_rates(streams, num_rows, warmup, sizes=SIZES):
    """{(stream, 'static top-k'): [hit rate per size]}: the most frequent rows, kept."""
    out = {}
    for sname, stream in streams.items():
        steps = [np.unique(np.concatenate(list(s.values()))) for s in stream]
        freq = np.bincount(np.concatenate(steps), minlength=num_rows)
        order = np.argsort(-freq, kind="stable")
        rates = []
        for frac in sizes:
            top = np.zeros(num_rows, bool)
            top[order[:int(frac * num_rows)]] = True
            rates.append(float(np.mean([top[ids].mean() for ids in steps[warmup:]])))
        out[(sname, "static top-k")] = rates
    return out


def exact_bound(streams, num_rows, warmup, fraction, summed=False):
    """The hit rate of trainer 0 (``streams[0]``) with a clairvoyant static cache of the
    ``fraction`` most frequent rows in EXACT mode while the other trainers train too.

    Its copy of a row is current only if no other trainer updated the row since trainer 0
    last read it (a step's updates all land before the next step: synchronous training;
    trainer 0's own updates are applied to its copy). Rows it never read count as current.
    ``summed``: sync_exact with the owner's summed gradient sent back for held rows
    trainer 0 updated too, so another trainer's update in the step of trainer 0's last
    read keeps the copy current; only one in a later step voids it.
    """
    order = np.argsort(-np.bincount(np.concatenate(
        [np.unique(np.concatenate(list(s.values()))) for s in streams[0]]),
        minlength=num_rows), kind="stable")
    top = np.zeros(num_rows, bool)
    top[order[:int(fraction * num_rows)]] = True
    rates = []
    for table in streams[0][0]:
        mine = np.full(num_rows, -1, np.int64)    # step trainer 0 last read the row
        theirs = np.full(num_rows, -2, np.int64)  # step another trainer last updated it
        for t, step in enumerate(streams[0]):
            ids = np.unique(step[table])
            if t >= warmup:
                current = theirs[ids] <= mine[ids] if summed else theirs[ids] < mine[ids]
                rates.append(float(np.mean(top[ids] & current)))
            mine[ids] = t
            for other in streams[1:]:
                theirs[other[t][table]] = t
    return float(np.mean(rates))


def byte_bounds(streams, num_rows, warmup, fraction, row_bytes):
    """Row bytes a step of trainer 0 (``streams[0]``) must receive, per design, with the
    other trainers (``streams[1:]``) writing too (sync_exact) and a clairvoyant static
    cache of the ``fraction`` most frequent rows holding rows and optimizer state
    (``row_bytes`` each: rows, and a state of a row's size). Positions, versions and
    headers are left out.

    Returns:
        {design: mean bytes per step}: ``no cache`` (every id's row, duplicates
        included), ``each row once`` (no cache), ``summed rows`` (this cache: the summed
        gradient of held rows the others wrote in the same step, a stale held row
        refetched with its state, the rest of the rows not held), ``owner pushes``
        (every other trainer's write of a held row sent to the holder), ``no state
        refetch`` (a stale held row refetched without its state: a bound, not a design).
    """
    order = np.argsort(-np.bincount(np.concatenate(
        [np.unique(np.concatenate(list(s.values()))) for s in streams[0]]),
        minlength=num_rows), kind="stable")
    top = np.zeros(num_rows, bool)
    top[order[:int(fraction * num_rows)]] = True
    out = {k: [] for k in ("no cache", "each row once", "summed rows", "owner pushes",
                           "no state refetch")}
    for table in streams[0][0]:
        mine = np.full(num_rows, -1, np.int64)        # step trainer 0 last read the row
        theirs = np.full(num_rows, -2, np.int64)      # step another trainer last wrote it
        theirs_only = np.full(num_rows, -2, np.int64)  # ... in a step trainer 0 did not
        for t, step in enumerate(streams[0]):
            ids = np.unique(step[table])
            other = np.unique(np.concatenate([o[t][table] for o in streams[1:]]))
            held = top[ids]
            if t >= warmup:
                stale = held & (theirs_only[ids] > mine[ids])
                changed = held & (theirs[ids] >= mine[ids])  # incl. in my last read's step
                co_held = int(top[np.intersect1d(ids, other)].sum())
                cold = int((~held).sum())
                out["no cache"].append(len(step[table]) * row_bytes)
                out["each row once"].append(len(ids) * row_bytes)
                out["summed rows"].append((cold + 2 * int(stale.sum()) + co_held) * row_bytes)
                out["owner pushes"].append((cold + int(top[other].sum())) * row_bytes)
                out["no state refetch"].append((cold + int(changed.sum())) * row_bytes)
            mine[ids] = t
            theirs[other] = t
            theirs_only[np.setdiff1d(other, ids)] = t
    return {k: float(np.mean(v)) for k, v in out.items()}


def draw_streams(names, steps, args):
    """{stream: (num_rows, [the 1x1 trainer's stream, the 2x2 trainers' streams])}."""
    out, t0 = {}, time.perf_counter()
    if {"sage", "deepwalk", "zipf"} & set(names):
        from graph_examples.datasets import load_dataset

        ds = load_dataset("wordnet")
        n = ds.graph.num_nodes()
        ranks = [(T, r) for T in (1, 2) for r in range(T)]
        if "sage" in names:
            out["sage"] = n, [sage_stream(ds.graph, ds.train_idx, steps, r, T) for T, r in ranks]
        if "deepwalk" in names:
            out["deepwalk"] = n, [deepwalk_stream(ds.graph, steps, r) for T, r in ranks]
        if "zipf" in names:
            out["zipf"] = n, [zipf_stream(n, steps, r) for T, r in ranks]
    if "zipf10m" in names:
        out["zipf10m"] = args.zipf_rows, zipf_table_stream(args.zipf_rows, steps, [0, 0, 1],
                                                           args.zipf_batch)
    if "uniform10m" in names:  # no skew: ids a cache cannot help with
        out["uniform10m"] = args.zipf_rows, [uniform_stream(args.zipf_rows, steps, rank,
                                                            args.zipf_batch)
                                             for rank in (0, 0, 1)]
    unknown = set(names) - set(out)
    if unknown:
        raise SystemExit(f"--streams: unknown {sorted(unknown)}; expected some of "
                         "sage, deepwalk, zipf, zipf10m, uniform10m")
    def ids(stream, unique):
        return np.mean([len(np.unique(a) if unique else a) for a in (
            np.concatenate(list(step.values())) for step in stream)])

    print(f"streams drawn in {time.perf_counter() - t0:.1f} s: " + "; ".join(
        f"{k}: {n:,} rows, {ids(st[0], False):.0f} ids per step ({ids(st[0], True):.0f} "
        "unique)" for k, (n, st) in out.items()), flush=True)
    return out
