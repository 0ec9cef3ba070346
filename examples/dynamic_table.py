"""A hash-keyed table: any int64 id, rows created on first lookup, LRU eviction."""
import torch

import distemb
from distemb.stores import key_normal

emb = distemb.DynamicEmbedding(32, name="users", init_func=key_normal(32, std=0.1, seed=0),
                               capacity=4_000, evict="lru", low_water=0.9)
opt = distemb.SparseAdagrad([emb], lr=0.1)
for step in range(300):
    ids = torch.randint(0, 3_000, (512,)) * 1_000_003 - 2**40   # raw ids, not 0..N-1
    loss = (emb(ids) - 1.0).pow(2).sum(dim=1).mean()   # a new id gets its deterministic row
    loss.backward()
    opt.step()
print(f"size {emb.size()} of capacity {emb.capacity}, loss {loss.item():.3f}")
emb.upsert(torch.tensor([42]), torch.zeros(1, 32))          # write rows directly
emb.remove(torch.tensor([42]))                               # drop a row and its state
data = emb.export()                                          # keys, weight, Adagrad 'sum'
print(sorted(data), len(data["keys"]))
evicted = emb.evict(1_000, policy="lfu")                      # on demand, to a target size
print(f"evicted {len(evicted)}, size {emb.size()}")
