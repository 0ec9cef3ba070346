"""A file-backed table: memory-mapped, larger than RAM if the disk is; reopened to resume."""
import sys
import tempfile

import torch

import distemb
from distemb.stores import FileStore

path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="distemb-table-")
store = FileStore(path, num_rows=10_000_000, dim=32)      # 1.2 GiB file, preallocated
emb = distemb.StoreEmbedding(store, name="nodes")
opt = distemb.SparseRowWiseAdagrad([emb], lr=0.1)
for step in range(50):
    ids = torch.randint(0, 10_000_000, (4096,))
    (emb(ids) - 1.0).pow(2).sum().backward()
    opt.step()
    if step % 25 == 24:
        emb.flush()                                      # durable against a machine crash
emb.close()                                              # flushes and unmaps
again = distemb.StoreEmbedding(FileStore(path), name="nodes-again")   # rows are still there
print(path, again.weight[ids[:2]][:, :4])
