"""Pooled lookups: the sum, mean or max of each bag's rows in one pass (emb.bag, with
torch.nn.EmbeddingBag's arguments), on a dense table and on a hash table."""
import torch

import distemb
from distemb.stores import key_normal

emb = distemb.DistEmbedding(100_000, 32, name="items",
                            init_func=lambda shape, dtype: torch.randn(shape, dtype=dtype))
opt = distemb.SparseAdagrad([emb], lr=0.1)
for step in range(200):
    ids = torch.randint(0, 5_000, (4096 * 8,))          # 4,096 bags of 8 ids...
    offsets = torch.arange(0, len(ids), 8)               # ...starting at these offsets
    bags = emb.bag(ids, offsets, mode="mean")             # (4096, 32): one row per bag
    loss = (bags - 1.0).pow(2).sum(dim=1).mean()
    loss.backward()                                       # one traced lookup: unique ids
    opt.step()
    if step == 0:
        first = loss.item()
print(f"mean bags {tuple(bags.shape)}, loss {first:.3f} -> {loss.item():.3f}, "
      f"traced ids per step {len(torch.unique(ids))} of {len(ids)}")

# 2-D ids (one bag per row), weights per id (sum mode), a padding id, an empty bag.
ids = torch.tensor([[3, 7, 0], [0, 0, 0]])
weights = torch.tensor([[2.0, 0.5, 9.0], [1.0, 1.0, 1.0]])
out = emb.bag(ids, mode="sum", per_sample_weights=weights, padding_idx=0)
want = 2.0 * emb(torch.tensor([3])) + 0.5 * emb(torch.tensor([7]))
print(f"weighted bag equal: {torch.allclose(out[0], want[0])}, padding-only bag: "
      f"{out[1].abs().sum().item()}")

# Any int64 key: a hash table pools the same way (keys looked up once, made if new).
users = distemb.DynamicEmbedding(16, name="users", init_func=key_normal(16, seed=0))
opt = distemb.SparseAdam([users], lr=0.01)
keys = torch.randint(0, 1_000, (600,)) * 1_000_003 - 2**40
out = users.bag(keys, torch.tensor([0, 100, 100, 450]), mode="max")
out.sum().backward()
opt.step()
print(f"max bags {tuple(out.shape)}, keys held {users.size()}")
