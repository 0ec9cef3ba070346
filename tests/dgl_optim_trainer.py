"""DGL 1.1.3's check_dist_optim_store (tests/distributed/test_dist_graph_store.py), run on
distemb with only the import changed: ``import distemb.dgl as dist``.

Run by distemb-launch: ``python tests/dgl_optim_trainer.py save|load PATH``. DGL's test
saves with 4 trainers and loads with 8 and with 2; every rank calls save() and load().
Rank 0 sets the Adagrad state through DGL's ``optimizer._state[...]`` before saving;
after loading, every rank checks the state and DGL's ``_lr`` / ``_eps`` aliases.
"""
import sys

import torch

import distemb.dgl as dist
from distemb.dgl.optim import SparseAdagrad

NUM_NODES = 1000


def emb_init(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def optimizer_states():
    """The states DGL's test draws once (F.uniform((num_nodes, 1), 0, 1)), seeded here."""
    g = torch.Generator().manual_seed(12345)
    return [torch.rand((NUM_NODES, 1), generator=g) for _ in range(2)]


def main(mode, path):
    ctx = dist.initialize("ip_config.txt")
    torch.set_num_threads(1)
    rank = ctx.rank
    states = optimizer_states()
    total_idx = torch.arange(0, NUM_NODES, dtype=torch.int64)
    emb = dist.DistEmbedding(NUM_NODES, 1, name="optim_emb1", init_func=emb_init)
    emb2 = dist.DistEmbedding(NUM_NODES, 1, name="optim_emb2", init_func=emb_init)
    if mode == "save":
        optimizer = SparseAdagrad([emb, emb2], lr=0.1, eps=1e-08)
        if rank == 0:
            optimizer._state["optim_emb1"][total_idx] = states[0]
            optimizer._state["optim_emb2"][total_idx] = states[1]
        optimizer.save(path)
    else:
        optimizer = SparseAdagrad([emb, emb2], lr=0.001, eps=2e-08)
        optimizer.load(path)
        assert torch.equal(optimizer._state["optim_emb1"][total_idx], states[0])
        assert torch.equal(optimizer._state["optim_emb2"][total_idx], states[1])
        assert 0.1 == optimizer._lr
        assert 1e-08 == optimizer._eps
        ctx.client.barrier()
    print(f"rank {rank} of {ctx.num_trainers}: {mode} ok", flush=True)
    dist.exit_client()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
