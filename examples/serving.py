"""Serving a trained table: a checkpoint read into a read-only torch module, without
distemb's training stack (no context, client or optimizer)."""
import os
import tempfile

import torch

import distemb
from distemb import serving
from distemb.stores import key_normal

# Train two tables and save them: the job's checkpoint (any number of servers or ranks).
items = distemb.DistEmbedding(10_000, 16, name="items",
                              init_func=lambda shape, dtype: torch.randn(shape, dtype=dtype))
users = distemb.DynamicEmbedding(16, name="users", init_func=key_normal(16, seed=0))
opt = distemb.SparseAdagrad([items, users], lr=0.1)
for step in range(50):
    loss = (items(torch.randint(0, 10_000, (256,))) -
            users(torch.randint(0, 500, (256,)) * 7919)).pow(2).mean()
    loss.backward()
    opt.step()
path = os.path.join(tempfile.mkdtemp(), "checkpoint")
opt.save(path)
print("tables:", serving.tables(path))

# A table of fixed keys: a frozen torch.nn.Embedding (or EmbeddingBag with mode=).
served = serving.load(path, "items")
ids = torch.tensor([[1, 2], [9_999, 5]])
print(type(served).__name__, "equal to training rows:",
      torch.equal(served(ids), items(ids).detach()))
pooled = serving.load(path, "items", mode="mean", dtype=torch.bfloat16)
print(type(pooled).__name__, pooled(ids).dtype, tuple(pooled(ids).shape))
program = torch.export.export(served, (ids,))           # torch.export works on it
print("exported equal:", torch.equal(program.module()(ids), served(ids)))

# A hash table: a frozen hash index and its rows; an unseen key gets the table's own
# initial row when default= is its initialiser, or raises MissingKeyError without one.
keyed = serving.load(path, "users", default=key_normal(16, seed=0))
keys = torch.tensor([7919 * 3, 123456789])                # a trained key, an unseen one
print(type(keyed).__name__, len(keyed), "keys; trained row equal:",
      torch.equal(keyed(keys[:1]), users.get(keys[:1])))
print("unseen key gets its initial row:",
      torch.equal(keyed(keys[1:]), torch.from_numpy(key_normal(16, seed=0)(keys[1:].numpy()))))
