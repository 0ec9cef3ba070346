"""The contenders of bench_step.py: full user-level steps and single memory passes.

Every contender is built on the same table size and fed the same id batches; ``run(k)``
does one unit of work on batch ``k`` of the pool (one training step, or one kernel
call). Full steps are the code a user writes::

    opt.zero_grad(); rows = emb(ids); loss = (rows * upstream).sum(); loss.backward(); opt.step()

Kernel contenders call :mod:`distemb.kernels` directly on raw numpy tables, next to the
measured roofline: a random-row gather (``np.take``) and a minimal read-modify-write
pass (``w[r] -= 0 * g``, the SGD kernel with lr=0, over every array the fused Adagrad
kernel reads and writes), on the same rows.
"""
import gc
import os
import sys
import warnings

import numpy as np
import torch

import distemb
from distemb import kernels

# torch's sparse Adagrad warns once that sparse invariant checks are off; not our concern.
warnings.filterwarnings("ignore", message="Sparse invariant checks")

DISTEMB_OPTIMIZERS = {
    "SGD": lambda embs: distemb.SparseSGD(embs, lr=0.01),
    "Adagrad": lambda embs: distemb.SparseAdagrad(embs, lr=0.01),
    "RowWiseAdagrad": lambda embs: distemb.SparseRowWiseAdagrad(embs, lr=0.01),
    "Adam": lambda embs: distemb.SparseAdam(embs, lr=0.01),
}


def _uniform_init(shape, dtype):
    # uniform_ touches every page (as randn would) at a fraction of randn's cost
    return torch.empty(shape, dtype=dtype).uniform_(-0.01, 0.01)


class Contender:
    """One measured thing: ``run(k)`` works on batch ``k``; ``close()`` frees memory.

    Args:
        name: row label of the table.
        kind: 'step' (full user-level step) or 'kernel' (one kernel or memory pass).
        rows_per_call: rows one call processes (rows/s = calls/s * this).
    """

    def __init__(self, name, kind, run, rows_per_call, close=None, threads=None):
        self.name, self.kind, self.run = name, kind, run
        self.rows_per_call = rows_per_call
        self.threads = threads  # torch threads to set before timing (None: leave as is)
        self._close = close

    def close(self):
        self.run = None  # drop the step closure's references to tables and optimizers
        if self._close is not None:
            self._close()


def _user_step(emb, opt, batches, upstream):
    def run(k):
        opt.zero_grad()
        rows = emb(batches[k % len(batches)])
        loss = (rows * upstream).sum()
        loss.backward()
        opt.step()
    run.opt = opt
    return run


def distemb_step(opt_name, batches, upstream, num_rows, num_threads, tag):
    """distemb embedded: DistEmbedding + one of its sparse optimizers."""
    ctx = distemb.DistContext.embedded(num_threads=num_threads)
    emb = distemb.DistEmbedding(num_rows, upstream.shape[1], name=f"bench-{opt_name}-{tag}",
                                init_func=_uniform_init, context=ctx)
    opt = DISTEMB_OPTIMIZERS[opt_name]([emb])
    return Contender(f"distemb {opt_name}", "step", _user_step(emb, opt, batches, upstream),
                     upstream.shape[0], ctx.close, threads=num_threads)


def distemb_finite_check_on(adagrad):
    """The step of contender ``adagrad`` (``distemb_step("Adagrad", ...)``) on its own
    table and optimizer, with the optimizer's check of the gradients for NaN and infinity
    (``check_finite=True``; off by default): timed in turns with it, the ratio is the
    check's cost alone, whatever memory the table landed on."""
    step = adagrad.run
    opt = step.opt

    def run(k):
        opt.check_finite = True
        try:
            step(k)
        finally:
            opt.check_finite = False
    return Contender("distemb Adagrad, finite check", "step", run, adagrad.rows_per_call,
                     threads=adagrad.threads)


def torch_step(opt_name, batches, upstream, num_rows):
    """torch.nn.Embedding(sparse=True) with torch.optim.Adagrad or SparseAdam."""
    emb = torch.nn.Embedding(num_rows, upstream.shape[1], sparse=True)
    with torch.no_grad():
        emb.weight.uniform_(-0.01, 0.01)
    if opt_name == "Adagrad":
        opt = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    else:
        opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    return Contender(f"torch {opt_name}", "step", _user_step(emb, opt, batches, upstream),
                     upstream.shape[0])


def dgl_available():
    """Whether dgl.distributed imports (DGL is an optional extra)."""
    os.environ.setdefault("DGL_DIST_MODE", "standalone")
    try:
        import dgl.distributed  # noqa: F401  (optional dependency, probed here)
    except Exception:  # any import failure means: no DGL baseline
        return False
    return True


_DGL_INIT = []


def dgl_step(batches, upstream, num_rows, tag, ip_config):
    """DGL standalone: dgl.distributed.DistEmbedding + dgl.distributed.optim.SparseAdagrad.

    Standalone mode (DGL_DIST_MODE=standalone) keeps the table in this process behind
    DGL's fake KVStore; a DistEmbedding needs an explicit partition policy there because
    no DistGraph exists, so a one-partition RangePartitionBook provides it.
    """
    import dgl.distributed as dd
    from dgl.distributed.graph_partition_book import PartitionPolicy, RangePartitionBook
    from dgl.distributed.optim import SparseAdagrad

    if not _DGL_INIT:  # initialize() is process-wide in DGL
        with open(ip_config, "w") as f:
            f.write("127.0.0.1\n")
        dd.initialize(ip_config)
        _DGL_INIT.append(True)
    etype = ("_N", "_E", "_N")
    book = RangePartitionBook(0, 1, {"_N": torch.tensor([[0, num_rows]])},
                              {etype: torch.tensor([[0, 1]])}, {"_N": 0}, {etype: 0})
    emb = dd.DistEmbedding(num_rows, upstream.shape[1], name=f"bench-dgl-{tag}",
                           init_func=_uniform_init,
                           part_policy=PartitionPolicy("node~_N", book))
    opt = SparseAdagrad([emb], lr=0.01)
    held = [emb, opt]

    def close():
        # DGL 1.1.3's DistTensor.__del__ raises KeyError in standalone mode for the
        # optimizer's state tensor (never registered as graph data): a DGL bug, muted
        # here while the tensors are freed, not hidden elsewhere.
        hook = sys.unraisablehook
        sys.unraisablehook = lambda u: None if isinstance(u.exc_value, KeyError) else hook(u)
        try:
            held.clear()
            gc.collect()
        finally:
            sys.unraisablehook = hook

    return Contender("DGL SparseAdagrad", "step", _user_step(emb, opt, batches, upstream),
                     upstream.shape[0], close)


def kernel_contenders(batches, upstream, num_rows, num_threads):
    """distemb's kernels and the measured memory roofline, on raw numpy tables.

    Returns:
        list of Contender, kind 'kernel'.
    """
    dim = upstream.shape[1]
    rng = np.random.default_rng(1)
    w = rng.random((num_rows, dim), dtype=np.float32)
    s = np.full((num_rows, dim), 0.1, dtype=np.float32)
    np_batches = [b.numpy() for b in batches]
    grads = upstream.numpy()
    deduped = [kernels.dedup_sum(b, grads) for b in np_batches]
    b_rows = grads.shape[0]
    u_rows = int(np.mean([len(u) for u, _ in deduped]))
    out = np.empty_like(grads)
    sum_buf = np.empty_like(grads)
    nb = len(batches)

    def take(k):
        np.take(w, np_batches[k % nb], axis=0, out=out)

    def gather(k):
        kernels.gather_rows(w, np_batches[k % nb], out, num_threads)

    def dedup(k):
        kernels.dedup_sum(np_batches[k % nb], grads, out=sum_buf, num_threads=num_threads)

    def rmw(k):
        uniq, summed = deduped[k % nb]
        kernels.sgd_update(w, uniq, summed, 0.0, num_threads)
        kernels.sgd_update(s, uniq, summed, 0.0, num_threads)

    def adagrad(k):
        uniq, summed = deduped[k % nb]
        kernels.adagrad_update(w, s, uniq, summed, 1e-6, 1e-10, num_threads)

    return [
        Contender("roofline gather (np.take)", "kernel", take, b_rows),
        Contender("kernel gather_rows", "kernel", gather, b_rows),
        Contender("kernel dedup_sum", "kernel", dedup, b_rows),
        Contender("roofline rmw w,s (w[r]-=0*g)", "kernel", rmw, u_rows),
        Contender("kernel adagrad_update", "kernel", adagrad, u_rows),
    ]
