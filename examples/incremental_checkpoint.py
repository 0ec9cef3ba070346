"""Incremental checkpoints: one full save, then deltas of only the rows that changed (and
the keys removed or evicted); a load replays them in order. A hash table's evicted rows
go to a sink directory instead of being lost."""
import os
import tempfile

import torch

import distemb
from distemb import checkpoint, serving
from distemb.stores import key_normal

work = tempfile.mkdtemp()
path, evicted = os.path.join(work, "checkpoint"), os.path.join(work, "evicted")

# A dense table and a hash table that holds 2,000 keys at most: past that, a lookup
# evicts the least recently used keys, and the sink directory gets their rows and state.
items = distemb.DistEmbedding(100_000, 32, name="items",
                              init_func=lambda shape, dtype: torch.randn(shape, dtype=dtype))
users = distemb.DynamicEmbedding(32, name="users", init_func=key_normal(32, seed=0),
                                 capacity=2_000, low_water=0.75, sink=evicted)
opt = distemb.SparseAdagrad([items, users], lr=0.05)


def train(steps, first_user):
    for step in range(steps):
        user_ids = torch.randint(first_user, first_user + 3_000, (256,))  # new users arrive
        loss = (items(torch.randint(0, 1_000, (256,))) - users(user_ids)).pow(2).mean()
        loss.backward()
        opt.step()


def saved_mb(save_id):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.startswith(save_id)) / 1e6


train(20, first_user=0)
opt.save(path)                                   # a full save: every row of both tables
full = checkpoint.read_meta(path)["save_id"]
print(f"full save: {saved_mb(full):.1f} MB")
for hour in range(1, 4):
    train(5, first_user=1_000 * hour)
    opt.save(path, incremental=True)             # a delta: only what changed since
    head = checkpoint.read_meta(path)
    print(f"delta {hour}: {saved_mb(head['save_id']):.2f} MB, after save {head['parent'][:8]}")

# A load replays the full save and the 3 deltas in order (into any number of servers or
# ranks); so does serving.
want = items(torch.arange(1_000)).detach()
opt.load(path)
print("items after the load equal the trained rows:",
      torch.equal(items(torch.arange(1_000)).detach(), want))
print("served rows equal:", torch.equal(serving.load(path, "items").weight[:1_000], want))

# Every row an eviction removed, with its Adagrad state, in the order they went.
gone = list(checkpoint.read_evicted(evicted, "users"))
print(f"evictions: {len(gone)}, keys sunk: {sum(len(keys) for _, keys, _ in gone)}, "
      f"columns: {sorted(gone[0][2])}; users held now: {users.size()}")
