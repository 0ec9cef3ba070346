"""A collective-mode job for tests/test_collective.py, and the one-process oracle.

Run as one rank of a torch.distributed job (torchrun's environment: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): ``python tests/collective_trainer.py OUT_DIR [--steps N]
[--die-at STEP] [--timeout S]``. One dense table per optimizer distemb has (SGD, Adagrad,
row-wise Adagrad, Adam with global and per-row steps, FTRL; and Adagrad again on a
table sharded by a hash policy) trains on zipf-distributed,
duplicate-heavy batches of B ids; rank r takes the r-th 1/W of every batch, and on every
fifth step the last rank looks nothing up (it still takes part in the exchanges). Rank 0
writes each table's rows and optimizer state (``opt.state_dict()``, pulled collectively)
to OUT_DIR/<table>.npz. ``--die-at S``: the last rank (or ``--die-rank R``) exits
abruptly at step S; the others must raise KVStoreError naming it (they print it and exit
3). ``--fewer-steps N``: the last rank takes N steps only, then closes distemb and exits 0;
the others must raise KVStoreError saying so. ``--nan-at S``: rank 0's gradients of each
table of its own hold a NaN on step S; every rank's step() of it must refuse (printed),
and the job goes on. ``--mismatch``: rank 1
defines a table with another row length; ``--apart``: rank 0 alone reads a row before
training. Every rank must raise KVStoreError (printed, exit 3). ``--save DIR`` after
training, ``--load DIR`` before it (from step ``--start``): every optimizer's checkpoint
at DIR/<table>, collective (each rank writes and reads its own shards). ``--servers``:
the same job as a trainer of a distemb-launch job (sync_exact), for checkpoints that
cross modes; ``--every-step``: the grouped model looks every table up on every step.
``--keys``: key management of the dynamic table after training (OUT_DIR/keys<rank>.npz).
``--prefetch``: every lookup prefetched one step ahead (distemb.pipeline's order); the
oracle is the same (a prefetch changes no row).

Bit-identical by construction (as the client suite's job in tests/test_kvclient_jobs.py):
the gradient of a looked-up row is ``c + round(8 row) / 8`` with ``c`` a multiple of 1/8, a dyadic number of small
magnitude, so every sum of duplicate ids is exact in float32 in any order (each rank's
partial sums, then the owner's sum of the ranks' sums, equal the one process's sum), and
each owner runs the same update kernel on the same inputs. The gradient depends on the
rows looked up, so a wrong row from any owner changes the result.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

import distemb
from distemb import DistEmbedding
from distemb.dynamic import DynamicEmbedding, StoreEmbedding
from distemb.errors import KVStoreError, MissingKeyError, NonFiniteGradientError
from distemb.optim import (SparseAdagrad, SparseAdam, SparseFtrl, SparseRowWiseAdagrad,
                           SparseSGD)
from distemb.partition import HashPartitionBook, PartitionPolicy, key_partition
from distemb.stores import key_normal
from distemb.stores.spec import FileTableSpec

NUM, D, B = 300, 8, 64
OPTIMIZERS = {"sgd": lambda e: SparseSGD([e], lr=0.05, check_finite=True),
              "adagrad": lambda e: SparseAdagrad([e], lr=0.1, check_finite=True),
              "rowwise": lambda e: SparseRowWiseAdagrad([e], lr=0.1, check_finite=True),
              "adam": lambda e: SparseAdam([e], lr=0.01, check_finite=True),
              "adam_row": lambda e: SparseAdam([e], lr=0.01, step_mode="per_row",
                                               check_finite=True),
              "ftrl": lambda e: SparseFtrl([e], lr=0.1, l1_regularization_strength=0.01,
                                           check_finite=True)}
#: Tables sharded by id modulo 2 W + 1 partitions (rank r holds those p % W == r; the
#: others: one range per rank).
HASHED = ("adagrad_hash",)
OPTIMIZERS["adagrad_hash"] = OPTIMIZERS["adagrad"]


def initial(i):
    """Table ``i``'s initial rows (pushed by every rank: a collective write)."""
    return torch.from_numpy(np.random.default_rng(i).normal(0, 0.5, (NUM, D))
                            .astype(np.float32))


def batch(step):
    """(ids, c) of step ``step``: zipf ranks over the rows, dyadic offsets."""
    rng = np.random.default_rng(900 + step)
    ids = (rng.zipf(1.2, B) - 1) % NUM
    c = rng.integers(-32, 33, (B, D)).astype(np.float32) / 8
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(c)


def rows_of(step, rank, world):
    """The batch rows rank ``rank`` of ``world`` looks up at ``step``."""
    if world > 1 and rank == world - 1 and step % 5 == 4:
        return slice(0, 0)
    per = B // world
    return slice(rank * per, (rank + 1) * per)


def make_tables(ctx, parts):
    """Every table, the ``HASHED`` ones by a hash policy of ``parts`` partitions."""
    embs = {}
    for i, k in enumerate(OPTIMIZERS):
        policy = None if k not in HASHED else PartitionPolicy(
            "node", "_N", HashPartitionBook(2 * parts + 1, node_counts={"_N": NUM}))
        embs[k] = DistEmbedding(NUM, D, name=f"coll-{k}", context=ctx, part_policy=policy)
        embs[k].weight[torch.arange(NUM)] = initial(i)
    return embs, {k: OPTIMIZERS[k](e) for k, e in embs.items()}


#: Tables of the grouped model: (key, rows, dim, dtype). One SparseAdam (global step)
#: steps all of them with one exchange; every step looks them up with one grouped lookup
#: (table "gnode" twice: source and context ids). Odd row widths exercise the payload's
#: padding; "grare" is looked up by no rank on steps 3k (so Adam's step count must not
#: advance) and with ids on rank 0 alone on 3k + 1 (the others look up no ids).
#: "gdyn" is a DynamicEmbedding: raw int64 keys (KEY_SCALE apart, spread over the int64
#: range), each rank holding the keys the key hash sends it, rows made on first lookup;
#: "gdyn16" the same in bfloat16 rows (2 bytes a value between ranks).
GROUP = (("gnode", 200, 5, "float32"), ("gctx", 120, 3, "bfloat16"),
         ("grare", 50, 7, "float32"), ("gdyn", None, 4, "float32"),
         ("gdyn16", None, 4, "bfloat16"))
KEY_SCALE, KEY_BASE = 3_000_000_000_019, -2 ** 62


def make_group(ctx):
    """The grouped model's tables (keyed as in GROUP) and its one optimizer."""
    embs = {}
    for i, (k, n, d, dtype) in enumerate(GROUP):
        if n is None:
            embs[k] = DynamicEmbedding(d, name=f"coll-{k}", context=ctx, dtype=dtype,
                                       init_func=key_normal(d, std=0.5, seed=i))
            continue
        embs[k] = DistEmbedding(n, d, name=f"coll-{k}", context=ctx, dtype=dtype)
        embs[k].weight[torch.arange(n)] = initial_rows(100 + i, n, d)
    return embs, SparseAdam(list(embs.values()), lr=0.01)


def initial_rows(seed, n, d):
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 0.5, (n, d))
                            .astype(np.float32))


def group_lookups(embs, step, ranks, world, skip_rare=True):
    """The grouped lookup of ``ranks``' share of step ``step``: [(table key, ids)];
    ``skip_rare=False``: "grare" on every step (a server-mode job counts a step for every
    table in every step: its trainers cannot know that none had gradients)."""
    ids, _ = batch(step)
    sl = [rows_of(step, r, world) for r in ranks]
    mine = torch.cat([ids[s] for s in sl])
    out = [("gnode", mine % 200), ("gctx", (mine * 7) % 120), ("gnode", (mine * 3 + 1) % 200),
           ("gdyn", mine * KEY_SCALE + KEY_BASE), ("gdyn16", mine * KEY_SCALE - KEY_BASE)]
    if step % 3 == 1:  # every rank makes the call; only rank 0 has ids
        out.append(("grare", torch.cat([ids[s] if r == 0 else ids[:0]
                                        for r, s in zip(ranks, sl)]) % 50))
    elif step % 3 == 2 or not skip_rare:
        out.append(("grare", (mine * 5) % 50))
    return out


def train_group(embs, opt, step, ranks, world, skip_rare=True):
    _, c = batch(step)
    sl = [rows_of(step, r, world) for r in ranks]
    cs = torch.cat([c[s] for s in sl])
    lookups = group_lookups(embs, step, ranks, world, skip_rare)
    opt.zero_grad()
    got = distemb.grouped_lookup([(embs[k], ids) for k, ids in lookups])
    loss = 0
    for (k, ids), rows in zip(lookups, got):
        up = cs[:len(ids), :rows.shape[1]] + torch.round(rows.detach() * 8) / 8
        loss = loss + (rows * up).sum()
    loss.backward()
    opt.step()


def prefetch_step(embs, step, ranks, world, group=None, skip_rare=True):
    """Prefetch every lookup of step ``step`` (each table once, its ids of the step; the
    grouped model's tables those it looks up then), collective as every call."""
    ids, _ = batch(step)
    mine = torch.cat([ids[s] for s in [rows_of(step, r, world) for r in ranks]])
    for emb in embs.values():
        emb.prefetch(mine)
    if group is not None:
        by_table = {}
        for k, keys in group_lookups(group[0], step, ranks, world, skip_rare):
            by_table.setdefault(k, []).append(keys)
        for k, keys in by_table.items():
            group[0][k].prefetch(torch.cat(keys))


def train(embs, opts, steps, ranks, world, die_at=None, start=0, group=None,
          skip_rare=True, nan_at=None, skip=None, prefetch=False):
    """Steps ``start``.. ``start + steps - 1``; ``ranks``: the ranks whose batch rows this
    process looks up (all of them: the oracle); ``group``: the grouped model, trained in
    each step too. ``nan_at``: on that step rank 0 gives one gradient of each table of
    its own a NaN, and every rank's step() must refuse it (printed); ``skip``: the
    oracle's, that step of those tables is not taken. ``prefetch``: each step's lookups
    are prefetched before the step before it (distemb.pipeline's order)."""
    if prefetch:
        prefetch_step(embs, start, ranks, world, group, skip_rare)
    for step in range(start, start + steps):
        if die_at == step:
            os._exit(9)
        if prefetch and step + 1 < start + steps:
            prefetch_step(embs, step + 1, ranks, world, group, skip_rare)
        ids, c = batch(step)
        sl = [rows_of(step, r, world) for r in ranks]
        mine = torch.cat([ids[s] for s in sl])
        cs = torch.cat([c[s] for s in sl])
        for k, emb in embs.items():
            if step == skip:
                continue
            opts[k].zero_grad()
            rows = emb(mine)
            up = cs + torch.round(rows.detach() * 8) / 8  # dyadic: see the docstring
            if step == nan_at and 0 in ranks and len(up):
                up[0, 0] = float("nan")
            (rows * up).sum().backward()
            try:
                opts[k].step()
            except NonFiniteGradientError as e:
                if step != nan_at:
                    raise
                print(f"rank {ranks[0]}: step {step} of {k!r} refused: {e}", flush=True)
        if group is not None:
            train_group(*group, step, ranks, world, skip_rare)


def snapshot(embs, opts, group=None):
    out = {}
    for k, emb in embs.items():
        state = opts[k].state_dict()["state"][emb.name]
        out[k] = {"weight": emb.weight[torch.arange(NUM)].numpy()}
        out[k].update({s: v.numpy() for s, v in state.items() if s != "step"})
    if group is not None:
        gembs, gopt = group
        state = gopt.state_dict()["state"]
        for k, emb in gembs.items():
            if isinstance(emb, DynamicEmbedding):  # keys held, rows and state columns
                out[k] = dict(emb.export(), step=np.array(state[emb.name]["step"]))
                continue
            out[k] = {"weight": emb.weight[torch.arange(emb.num_embeddings)].numpy(),
                      "step": np.array(state[emb.name]["step"])}
            out[k].update({s: v.numpy() for s, v in state[emb.name].items() if s != "step"})
    return out


def key_ops(emb, ranks, world):
    """Key management of the trained DynamicEmbedding ``emb``, as ranks ``ranks`` of
    ``world`` make it (every rank in turn: the oracle); {name: array} per rank.

    Every rank asks ``contains``/``get`` of the same probe (held and absent keys), removes
    a set of its own that overlaps the next rank's (a key counts for the first remover),
    then every rank reads ``size()`` and ``export()``.
    """
    held = np.sort(emb.export()["keys"])
    probe = np.concatenate([held[::7], [12345, -1]]).astype(np.int64)
    out = {r: {} for r in ranks}
    for r in ranks:
        out[r]["contains"] = emb.contains(probe)
        out[r]["get"] = emb.get(held[::5]).numpy()
        try:
            emb.get(probe)
            out[r]["missing"] = np.array(False)
        except MissingKeyError:
            out[r]["missing"] = np.array(True)
    for r in ranks:
        gone = held[r * 3:r * 3 + 6 * world:2 + r]  # overlaps the next rank's
        out[r]["removed"] = np.array(emb.remove(np.concatenate([gone, [777]])))
    size = emb.size()
    after = emb.export()
    for r in ranks:
        out[r]["size"] = np.array(size)
        out[r].update({f"export_{c}": v for c, v in after.items()})
    return out


def file_table(ctx, path, ranks, world, steps=4):
    """A table on files (``StoreEmbedding(FileTableSpec)``, keys 0..79 by range: rank r
    of W holds ``path/part-r-of-W``) trained ``steps`` steps with SparseAdagrad on the
    shares of ``ranks``; its export (keys, rows, state)."""
    spec = FileTableSpec(path, 80, 4, init=key_normal(4, std=0.5, seed=3), preallocate=False)
    emb = StoreEmbedding(spec, name="coll-file", context=ctx)
    opt = SparseAdagrad([emb], lr=0.1)
    for step in range(steps):
        ids, c = batch(100 + step)
        sl = [rows_of(step, r, world) for r in ranks]
        mine = torch.cat([ids[s] for s in sl]) % 80
        cs = torch.cat([c[s] for s in sl])[:, :4]
        opt.zero_grad()
        rows = emb(mine)
        (rows * (cs + torch.round(rows.detach() * 8) / 8)).sum().backward()
        opt.step()
    return emb.export()


def file_oracle(path, world):
    """:func:`file_table` in one embedded process on the concatenated shares."""
    ctx = distemb.DistContext.embedded(backend="pytorch", num_threads=1)
    out = file_table(ctx, path, range(world), world)
    ctx.close()
    return out


def evict_check(emb):
    """evict() to half the keys: every rank's store evicts down to its share by its own
    order, so the keys differ from one process's; asserted as properties here."""
    before = emb.export()["keys"]
    target = len(before) // 2
    evicted = emb.evict(target)
    after = emb.export()["keys"]
    assert emb.size() == target == len(after), (emb.size(), target, len(after))
    assert not emb.contains(evicted).any()
    assert np.array_equal(np.sort(np.concatenate([evicted, after])), before)


def wire_bytes(ctx, group, rank, world):
    """Bytes this rank sends while every rank pulls the same 64 keys of the float32 and
    of the bfloat16 dynamic table, and how many of those keys this rank owns (it sends
    their rows to the ``world - 1`` others: 16 bytes a row in float32, 8 in bfloat16)."""
    keys = np.arange(64, dtype=np.int64) * KEY_SCALE + 12345
    out = {"owned": int((key_partition(keys, world) == rank).sum())}
    for k in ("gdyn", "gdyn16"):
        before = ctx.client.bytes_sent
        ctx.client.pull(group[0][k].name, keys)
        out[k] = ctx.client.bytes_sent - before
    return out


def all_optimizers(opts, group):
    """{checkpoint directory name: optimizer} of the job."""
    return dict(opts, group=group[1])


def oracle(steps, world, load=None, then=(), keys=False, skip_rare=True, skip=None):
    """The same job in one embedded process on the concatenated batches: ``steps`` steps
    of ``world`` ranks (after loading checkpoint ``load``, when given), then each
    ``(steps, world)`` of ``then``; with ``keys``, also {rank: key_ops results}."""
    ctx = distemb.DistContext.embedded(backend="pytorch", num_threads=1)
    embs, opts = make_tables(ctx, world)
    group = make_group(ctx)
    if load:
        for k, opt in all_optimizers(opts, group).items():
            opt.load(os.path.join(load, k))
    start = 0
    for n, w in ((steps, world),) + tuple(then):
        train(embs, opts, n, range(w), w, start=start, group=group, skip_rare=skip_rare,
              skip=skip)
        start += n
    out = snapshot(embs, opts, group)
    if keys:
        out = out, key_ops(group[0]["gdyn"], range(world), world)
    ctx.close()
    return out


def main(args):
    torch.set_num_threads(1)
    if args.servers:  # a trainer of a distemb-launch job (sync_exact)
        ctx = distemb.initialize(backend="pytorch", num_threads=1)
    else:
        ctx = distemb.initialize(backend="pytorch", num_threads=1, mode="collective",
                                 timeout_s=args.timeout)
    world, rank = ctx.num_trainers, ctx.rank
    dying = world - 1 if args.die_rank is None else args.die_rank
    die_at = args.die_at if rank == dying else None
    short = args.fewer_steps is not None and rank == world - 1
    steps = args.fewer_steps if short else args.steps
    try:
        if args.mismatch:
            DistEmbedding(NUM, D + (rank == 1), name="mismatched", context=ctx)
        embs, opts = make_tables(ctx, world)
        group = make_group(ctx)
        if args.apart and rank == 0:
            embs["sgd"].weight[torch.arange(3)]
        if args.load:
            for k, opt in all_optimizers(opts, group).items():
                opt.load(os.path.join(args.load, k))
        calls = getattr(ctx.client, "exchanges", 0)
        train(embs, opts, steps, [rank], world, die_at, args.start, group,
              not args.every_step, nan_at=args.nan_at, prefetch=args.prefetch)
        calls = getattr(ctx.client, "exchanges", 0) - calls
        if short:  # done early: closes distemb and exits as a finished script does
            print(f"rank {rank} of {world}: done after {steps} steps", flush=True)
            distemb.shutdown()
            return
        if args.save:
            for k, opt in all_optimizers(opts, group).items():
                opt.save(os.path.join(args.save, k))
    except KVStoreError as e:
        print(f"rank {rank}: KVStoreError: {e}", flush=True)
        os._exit(3)
    out = snapshot(embs, opts, group)
    if rank == 0:
        for k, arrays in out.items():
            np.savez(os.path.join(args.out, f"{k}.npz"), **arrays)
        with open(os.path.join(args.out, "exchanges.json"), "w") as f:
            json.dump({"steps": args.steps, "calls": calls, "tables": len(embs)}, f)
        stats = getattr(ctx.client, "prefetch_stats", None)
        if args.prefetch and stats is not None:
            with open(os.path.join(args.out, "prefetch.json"), "w") as f:
                json.dump(stats(), f)
    if args.keys:
        got = key_ops(group[0]["gdyn"], [rank], world)[rank]
        np.savez(os.path.join(args.out, f"keys{rank}.npz"), **got)
        evict_check(group[0]["gdyn"])
        with open(os.path.join(args.out, f"wire{rank}.json"), "w") as f:
            json.dump(wire_bytes(ctx, group, rank, world), f)
        got = file_table(ctx, os.path.join(args.out, "files"), [rank], world)
        if rank == 0:
            np.savez(os.path.join(args.out, "file_table.npz"), **got)
    print(f"rank {rank} of {world}: done", flush=True)
    distemb.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--die-rank", type=int)
    parser.add_argument("--fewer-steps", type=int)
    parser.add_argument("--nan-at", type=int)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--apart", action="store_true")
    parser.add_argument("--keys", action="store_true")
    parser.add_argument("--servers", action="store_true")
    parser.add_argument("--every-step", action="store_true")
    parser.add_argument("--prefetch", action="store_true")
    main(parser.parse_args())
    sys.exit(0)
