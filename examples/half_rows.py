"""Rows stored in bfloat16: half the bytes per row (in memory and on the wire), float32
state and maths. A dense DistEmbedding, then a row store."""
import torch

import distemb
from distemb.stores import DenseStore, key_uniform

# A dense table (embedded here; on the servers under distemb-launch, unchanged).
emb = distemb.DistEmbedding(100_000, 64, name="users", dtype=torch.bfloat16,
                            init_func=lambda shape, dtype: torch.empty(shape, dtype=dtype)
                            .uniform_(-0.1, 0.1))
opt = distemb.SparseAdagrad([emb], lr=0.05)   # float32 state, rows rounded on store
for step in range(100):
    ids = torch.randint(0, 2_000, (1024,))
    rows = emb(ids)                                           # float32 rows, with autograd
    loss = (rows - 0.5).pow(2).sum(dim=1).mean()
    loss.backward()
    opt.step()
print(f"DistEmbedding: loss {loss.item():.4f}; rows {emb.dtype}, lookups {rows.dtype}")

# A row store (any store, or DynamicEmbedding(dtype=)), here with stochastic rounding.
store = DenseStore(100_000, 64, dtype="bfloat16", init=key_uniform(64, -0.1, 0.1),
                   rounding="stochastic")
items = distemb.StoreEmbedding(store, name="items")
opt = distemb.SparseAdam([items], lr=0.01)
for step in range(100):
    ids = torch.randint(0, 2_000, (1024,))
    loss = (items(ids) - 0.5).pow(2).sum(dim=1).mean()
    loss.backward()
    opt.step()
print(f"StoreEmbedding: loss {loss.item():.4f}; weight bytes "
      f"{store.column('weight').nbytes:,}")
