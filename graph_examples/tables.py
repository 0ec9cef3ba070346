"""Skip-gram embedding tables (node and context) on one of two backends, behind one interface.

'distemb' uses distemb.DistEmbedding with a distemb sparse optimizer; 'torch' uses
torch.nn.Embedding(sparse=True) with the matching torch.optim class, the baseline distemb
is checked against (OPTIMIZERS: SparseAdam by default; row-wise Adagrad has no torch
class). Both start the same way as word2vec: node rows uniform in
+-0.5/dim, context rows zero (were both zero, every gradient would stay zero).
"""
from typing import Optional, Protocol

import numpy as np
import torch

import distemb
from distemb.kernels.cuda import CudaUnavailableError

BACKENDS = ("distemb", "torch")

#: --optimizer: name -> (distemb class, torch class or None where torch has none).
OPTIMIZERS = {"adam": (distemb.SparseAdam, torch.optim.SparseAdam),
              "adagrad": (distemb.SparseAdagrad, torch.optim.Adagrad),
              "rowwise_adagrad": (distemb.SparseRowWiseAdagrad, None),
              "sgd": (distemb.SparseSGD, torch.optim.SGD)}


class SkipGramTables(Protocol):
    """Node and context tables plus the sparse optimizer that updates both."""

    def node(self, ids: torch.Tensor) -> torch.Tensor:
        """Return node-table rows for ids, recorded for the next step()."""

    def context(self, ids: torch.Tensor) -> torch.Tensor:
        """Return context-table rows for ids, recorded for the next step()."""

    def step(self) -> None:
        """Apply the gradients of the rows looked up since zero_grad()."""

    def zero_grad(self) -> None:
        """Forget gradients and recorded lookups."""

    def export(self) -> np.ndarray:
        """Return the node table as a float32 (N, dim) array."""


#: Rows per write of the node table's initial rows.
INIT_CHUNK = 1 << 16


def _node_init(dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def init(shape, dtype=torch.float32):
        return (torch.rand(shape, generator=gen, dtype=dtype) - 0.5) / dim

    return init


class TorchTables:
    """Tables as torch.nn.Embedding(sparse=True), trained by a torch.optim class.

    Args:
        num_nodes: rows per table.
        dim: embedding width.
        lr: learning rate.
        seed: node-table initialisation seed.
        device: where the tables live ('cpu' or a CUDA device); ids are moved there.
        optimizer: a key of OPTIMIZERS with a torch class.

    Example:
        >>> tables = TorchTables(34, 8, lr=0.01)
        >>> loss = (tables.node(torch.tensor([0])) * tables.context(torch.tensor([1]))).sum()
        >>> loss.backward(); tables.step(); tables.zero_grad()
    """

    def __init__(self, num_nodes: int, dim: int, lr: float, seed: int = 0,
                 device: str = "cpu", optimizer: str = "adam"):
        self._device = torch.device(device)
        self._node = torch.nn.Embedding(num_nodes, dim, sparse=True,
                                        _weight=_node_init(dim, seed)((num_nodes, dim)))
        self._context = torch.nn.Embedding(num_nodes, dim, sparse=True,
                                           _weight=torch.zeros(num_nodes, dim))
        self._node.to(self._device)
        self._context.to(self._device)
        self._opt = OPTIMIZERS[optimizer][1]([self._node.weight, self._context.weight], lr=lr)

    def node(self, ids):
        return self._node(ids.to(self._device))

    def context(self, ids):
        return self._context(ids.to(self._device))

    def step(self):
        self._opt.step()

    def zero_grad(self):
        self._opt.zero_grad(set_to_none=True)

    def export(self):
        return self._node.weight.detach().cpu().numpy().copy()


class DistembTables:
    """Tables as distemb.DistEmbedding, trained by a distemb sparse optimizer (embedded mode).

    Args:
        num_nodes: rows per table.
        dim: embedding width.
        lr: learning rate.
        seed: node-table initialisation seed.
        name: table-name prefix. Tables of one name share storage (distemb reuses an
            existing table instead of initialising it), which trainers of one job
            need; None gives fresh, uniquely named tables, right for one process.
        device: where the tables live: 'cpu' (host memory) or a CUDA device, where rows,
            gradients and the fused updates stay (embedded mode only).

    Example:
        >>> tables = DistembTables(34, 8, lr=0.01)
        >>> loss = (tables.node(torch.tensor([0])) * tables.context(torch.tensor([1]))).sum()
        >>> loss.backward(); tables.step(); tables.zero_grad()
    """

    def __init__(self, num_nodes: int, dim: int, lr: float, seed: int = 0,
                 name: Optional[str] = None, device: str = "cpu", optimizer: str = "adam"):
        self._node = distemb.DistEmbedding(num_nodes, dim, name=name and f"{name}-node",
                                           device=device)
        # The initial rows of the whole table, written in (a shard's init_func would
        # draw the rows of every shard from the start of the seed's stream): the rows of
        # the torch backend, whatever the number of shards, servers or ranks. Every
        # trainer of a job writes the same rows, then waits for the others, so none
        # trains before every write has landed.
        init = _node_init(dim, seed)((num_nodes, dim))
        for lo in range(0, num_nodes, INIT_CHUNK):
            ids = torch.arange(lo, min(lo + INIT_CHUNK, num_nodes))
            self._node.weight[ids] = init[lo:lo + INIT_CHUNK]
        self._node.kvstore.barrier()
        self._context = distemb.DistEmbedding(
            num_nodes, dim, name=name and f"{name}-context",
            init_func=lambda shape, dtype: torch.zeros(shape, dtype=dtype), device=device)
        self._opt = OPTIMIZERS[optimizer][0]([self._node, self._context], lr=lr)

    @property
    def node_table(self) -> distemb.DistEmbedding:
        """The node table (what export() returns)."""
        return self._node

    @property
    def context_table(self) -> distemb.DistEmbedding:
        """The context table."""
        return self._context

    def node(self, ids):
        return self._node(ids)

    def context(self, ids):
        return self._context(ids)

    def step(self):
        self._opt.step()

    def zero_grad(self):
        self._opt.zero_grad()

    def export(self, chunk: int = 65536):
        n = self._node.num_embeddings
        with torch.no_grad():  # lookups under no_grad record no trace
            parts = [self._node(torch.arange(lo, min(lo + chunk, n)))
                     for lo in range(0, n, chunk)]
        return torch.cat(parts).cpu().numpy().astype(np.float32, copy=False)


def make_tables(backend: str, num_nodes: int, dim: int, lr: float, seed: int = 0,
                name: Optional[str] = None, device: str = "cpu",
                optimizer: str = "adam") -> SkipGramTables:
    """Build skip-gram tables on a backend.

    Args:
        backend: 'distemb' or 'torch'.
        num_nodes: rows per table.
        dim: embedding width, >= 1.
        lr: learning rate, > 0.
        seed: node-table initialisation seed.
        name: distemb table-name prefix (see DistembTables); ignored by 'torch'.
        device: where the tables live: 'cpu' or a CUDA device such as 'cuda'.
        optimizer: a key of OPTIMIZERS.

    Returns:
        A SkipGramTables implementation.

    Raises:
        ValueError: unknown backend or optimizer (or one torch has no class for), dim < 1
            or lr <= 0.
        ImportError: backend 'distemb' without distemb installed.
        CudaUnavailableError: a CUDA device was asked for where the CUDA kernels (or, for
            'torch', torch's CUDA) cannot run; it says why.
    """
    if dim < 1:
        raise ValueError(f"dim: must be >= 1, got {dim}")
    if not lr > 0:
        raise ValueError(f"lr: must be > 0, got {lr}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if backend == "torch":
        if OPTIMIZERS[optimizer][1] is None:
            raise ValueError(f"optimizer: {optimizer!r} has no torch.optim class (backend "
                             "'torch' takes " + ", ".join(
                                 k for k, v in OPTIMIZERS.items() if v[1]) + ")")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise CudaUnavailableError(f"device: {device!r} asked for, but torch "
                                       f"{torch.__version__} sees no CUDA device")
        return TorchTables(num_nodes, dim, lr, seed, device, optimizer)
    if backend == "distemb":
        return DistembTables(num_nodes, dim, lr, seed, name, device, optimizer)
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
