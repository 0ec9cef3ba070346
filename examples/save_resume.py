"""Save a job and resume it in another: tables, their optimizer, a dense model, its
optimizer and the step count; the second job may have other server and trainer counts.

Step ``s`` trains on one global batch (``batch(s)``) split evenly among the trainers, and
the trainers' gradients are summed (the servers of a ``sync_exact`` job sum every
trainer's share of a step and apply it once; the dense layer's are summed with
``torch.distributed``), so any number of trainers trains the same model::

    python examples/save_resume.py --steps 6 --save ck1                # alone: embedded
    python examples/save_resume.py --load ck1 --steps 6 --save ck2     # 6 more steps
    echo "127.0.0.1 30050" > ip.txt
    distemb-launch --ip-config ip.txt --num-servers 2 --num-trainers 2 \\
        --consistency sync_exact -- python examples/save_resume.py --steps 6 --save ck1
    distemb-launch --ip-config ip.txt --num-servers 1 --num-trainers 1 \\
        --consistency sync_exact -- python examples/save_resume.py --load ck1 --steps 6
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distemb

N, D, BATCH = 10_000, 16, 512


def batch(step):
    """The global batch of step ``step`` (ids, targets): the same in every job."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, N, (BATCH,), generator=gen)
    return ids, (ids % 3 == 0).float()  # a toy target: learn which nodes it marks


def model():
    """The table, the dense layer and their optimizers, at their initial state."""
    torch.manual_seed(0)  # the same dense layer on every trainer of every job
    emb = distemb.DistEmbedding(N, D, name="nodes",  # an init that ignores the sharding
                                init_func=lambda shape, dtype: torch.full(shape, 0.1, dtype=dtype))
    dense = torch.nn.Linear(D, 1)
    return emb, dense, distemb.SparseAdam([emb], lr=0.01), torch.optim.Adam(dense.parameters(),
                                                                           lr=0.01)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps to train")
    p.add_argument("--load", help="checkpoint directory to resume from")
    p.add_argument("--save", help="checkpoint directory to write at the end")
    p.add_argument("--export", help="write the table's rows here (.npy) at the end")
    args = p.parse_args()
    ctx = distemb.initialize()  # embedded alone; the job's servers under distemb-launch
    rank, world = ctx.rank, ctx.num_trainers
    if world > 1:
        dist.init_process_group("gloo")  # distemb-launch sets MASTER_ADDR, RANK, ...
    emb, dense, emb_opt, dense_opt = model()
    start = 0
    if args.load:
        emb_opt.load(os.path.join(args.load, "tables"))  # every trainer: rows and state
        saved = torch.load(os.path.join(args.load, "dense.pt"))
        dense.load_state_dict(saved["model"])
        dense_opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(start, start + args.steps):
        ids, target = batch(step)
        logits = dense(emb(ids[share])).squeeze(1)
        # summed over this trainer's share, over the global batch: the trainers' sums add
        # up to the mean over the whole batch
        loss = F.binary_cross_entropy_with_logits(logits, target[share], reduction="sum") / BATCH
        emb_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        if world > 1:
            for param in dense.parameters():
                dist.all_reduce(param.grad)
        emb_opt.step()
        dense_opt.step()
    if args.save:
        emb_opt.save(os.path.join(args.save, "tables"))  # collective: every trainer calls it
        if rank == 0:
            torch.save({"model": dense.state_dict(), "optimizer": dense_opt.state_dict(),
                        "step": start + args.steps}, os.path.join(args.save, "dense.pt"))
    if args.export and rank == 0:
        np.save(args.export, emb.weight[torch.arange(N)].numpy())
        torch.save(dense.state_dict(), args.export + ".dense.pt")
    print(f"trainer {rank} of {world}: steps {start}..{start + args.steps - 1}, "
          f"last loss share {loss.item():.4f}")
    if world > 1:
        dist.destroy_process_group()
    distemb.shutdown()


if __name__ == "__main__":
    main()
