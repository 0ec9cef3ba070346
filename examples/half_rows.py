"""Rows stored in bfloat16: half the bytes per row, float32 state and maths."""
import torch

import distemb
from distemb.stores import DenseStore, key_uniform

store = DenseStore(100_000, 64, dtype="bfloat16", init=key_uniform(64, -0.1, 0.1))
emb = distemb.StoreEmbedding(store, name="items")            # or DynamicEmbedding(dtype=)
opt = distemb.SparseAdam([emb], lr=0.01)
for step in range(100):
    ids = torch.randint(0, 2_000, (1024,))
    loss = (emb(ids) - 0.5).pow(2).sum(dim=1).mean()         # lookups return float32
    loss.backward()
    opt.step()                                               # rounds to nearest-even on store
print(f"loss {loss.item():.4f}; weight bytes {store.column('weight').nbytes:,}")
