"""A file-backed table: memory-mapped, larger than RAM if the disk is; reopened to resume.

``python examples/file_table.py [DIR]``: the table's files (1.2 GiB) go into DIR and stay;
without DIR, into a temporary directory removed at the end.
"""
import sys
import tempfile

import torch

import distemb
from distemb.stores import FileStore

with tempfile.TemporaryDirectory(prefix="distemb-table-") as scratch:
    path = sys.argv[1] if len(sys.argv) > 1 else scratch
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
    again = distemb.StoreEmbedding(FileStore(path), name="nodes-again")  # rows still there
    print(path, again.weight[ids[:2]][:, :4])
    again.close()
