"""A DGL training script run by DGL 1.1.3's own tools/launch.py (tests/test_dgl_launcher.py).

Written against DGL's module paths only, plus distemb's one line. DGL's launcher runs it
in its server-role processes (``dgl.distributed.initialize`` serves there and, patched,
starts distemb's server beside) and, through torch's launcher, in its trainers.

``python dgl_launch_trainer.py --ip_config IP --part_config CFG --mode train|load --out D``

- train: each trainer looks up its own nodes (every world-size-th node from its torch
  rank: DGL's node_split takes the machine from the IP address, and the test's
  "machines" share 127.0.0.1) for ``--steps`` Adagrad steps of ``sum(emb(ids))``, the
  table sharded by DGL's partition policy, then every trainer saves
  the optimizer (collectively) to ``D/ckpt``; rank 0 writes the rows and the state;
- load: a fresh table and optimizer load ``D/ckpt``; rank 0 writes the rows and state.
"""
import distemb.dgl; distemb.dgl.patch()  # noqa: E702,I001 (the one line a DGL user adds)
import argparse  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
import torch as th  # noqa: E402

import dgl  # noqa: E402
from dgl.distributed import DistEmbedding  # noqa: E402


def initializer(shape, dtype):
    return th.full(shape, 0.5, dtype=dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ip_config")
    parser.add_argument("--part_config")
    parser.add_argument("--graph_name", default="g")
    parser.add_argument("--mode", choices=("train", "load"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    args, _ = parser.parse_known_args()  # torch's launcher adds --local-rank
    dgl.distributed.initialize(args.ip_config)
    th.distributed.init_process_group("gloo")
    g = dgl.distributed.DistGraph(args.graph_name, part_config=args.part_config)
    rank, n = th.distributed.get_rank(), g.num_nodes()
    emb = DistEmbedding(n, 4, name="launch-emb", init_func=initializer)
    opt = dgl.distributed.optim.SparseAdagrad([emb], lr=0.1)
    ckpt = os.path.join(args.out, "ckpt")
    if args.mode == "train":
        mine = th.arange(n)[rank::th.distributed.get_world_size()]
        np.save(os.path.join(args.out, f"ids-{rank}.npy"), mine.numpy())
        for _ in range(args.steps):
            emb(mine).sum().backward()
            opt.step()
        th.distributed.barrier()
        opt.save(ckpt)
    else:
        opt.load(ckpt)
    if rank == 0:
        state = opt._state["launch-emb"]  # DGL's name of Adagrad's state
        np.save(os.path.join(args.out, f"{args.mode}-rows.npy"), emb.weight[0:n].numpy())
        np.save(os.path.join(args.out, f"{args.mode}-state.npy"), state[0:n].numpy())
    th.distributed.barrier()
    policy = emb.part_policy  # DGL's node policy of the graph, taken as DGL would
    print(f"rank {rank} of {th.distributed.get_world_size()}: {args.mode} ok, "
          f"{policy.policy_str} in {policy.num_partitions} partition(s)", flush=True)


if __name__ == "__main__":
    main()
