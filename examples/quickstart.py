import torch
import distemb

emb = distemb.DistEmbedding(100_000, 64, name="nodes",                 # sharded, sparse table
                            init_func=lambda shape, dtype: torch.randn(shape, dtype=dtype))
opt = distemb.SparseAdagrad([emb], lr=0.1)                            # exact torch.optim maths
for step in range(301):
    ids = torch.randint(0, 1_000, (4096,))                            # duplicates are summed
    loss = (emb(ids) - 1.0).pow(2).sum(dim=1).mean()                  # any torch model on top
    loss.backward()
    opt.step()                                                        # fused update, in place
    if step % 100 == 0:
        print(f"step {step:3d}  loss {loss.item():8.3f}")
