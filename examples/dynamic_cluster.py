"""A dynamic table sharded over a cluster's servers by key hash (runs embedded too).

    echo "127.0.0.1 30070" > ip.txt
    .venv/bin/distemb-launch --ip-config ip.txt --num-servers 2 --num-trainers 2 \
        --consistency sync_exact -- .venv/bin/python examples/dynamic_cluster.py
"""
import os
import tempfile

import torch

import distemb
from distemb.stores import key_normal

ctx = distemb.initialize()                     # a trainer under distemb-launch, else embedded
torch.manual_seed(ctx.rank)
# Collective: every trainer makes the table with the same arguments. The initialiser
# must be key_normal/key_uniform: the servers rebuild it from its spec.
emb = distemb.DynamicEmbedding(16, name="users", init_func=key_normal(16, std=0.1, seed=0),
                               capacity=100_000, evict="lru")
opt = distemb.SparseAdam([emb], lr=0.01)
for step in range(20):
    ids = torch.randint(0, 5_000, (256,)) * 1_000_003 - 2**40   # raw int64 ids
    loss = (emb(ids) - 1.0).pow(2).sum(dim=1).mean()
    loss.backward()
    opt.step()
# Every trainer saves (collective): each server writes its own keys, rows and Adam state.
path = os.path.join(tempfile.gettempdir(), f"dynamic-cluster-{ctx.num_servers}")
opt.save(path)
if ctx.rank == 0:
    print(f"{emb.size()} keys over {ctx.num_servers} server(s), loss {loss.item():.3f}; "
          f"checkpoint {path} (loads into any number of servers with opt.load)")
distemb.shutdown()
