"""Node2Vec: PyG's model, its table a distemb table on any placement.

PyG's ``torch_geometric.nn.Node2Vec`` keeps an ``nn.Embedding(sparse=True)`` in one
process and walks with pyg-lib. This one has PyG's constructor and methods
(``forward``, ``loader``, ``pos_sample``, ``neg_sample``, ``sample``, ``loss``,
``test``) and draws the same walks and negatives from torch's generator, but:

- its table is a :class:`~distemb.embedding.DistEmbedding` (``model.embedding``): in this
  process, on servers or sharded over a collective job, trained by a distemb optimizer
  (``distemb.SparseAdam([model.embedding], lr=0.01)`` where PyG's example uses
  ``torch.optim.SparseAdam(list(model.parameters()), lr=0.01)``);
- it walks with :class:`~distemb.pyg.walks.RandomWalker` (plain torch), so pyg-lib is
  not needed;
- :meth:`loss` looks every node of a batch up once (PyG looks the rows up four times,
  one per pair and window) and hands the optimizer one gradient row per node (PyG's
  ``SparseAdam`` sorts and sums one row per looked-up position first).

The loss is PyG's float32 expression: ``mean(-log(s(h_start . h_rest) + 1e-15))`` over
the positive pairs plus ``mean(-log(1 - s(h_start . h_rest) + 1e-15))`` over the
negative ones, including where float32 rounds it (a negative pair whose score passes
about 16.6 rounds ``s`` to 1: its loss is ``-log(1e-15)`` and its gradient zero, in PyG
and here), so training follows PyG's step by step.

Example:
    >>> import torch, distemb
    >>> from distemb.pyg import Node2Vec
    >>> edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    >>> model = Node2Vec(edge_index, embedding_dim=4, walk_length=3, context_size=2,
    ...                  name="doc-n2v")
    >>> opt = distemb.SparseAdam([model.embedding], lr=0.01)
    >>> for pos_rw, neg_rw in model.loader(batch_size=2, shuffle=True):
    ...     opt.zero_grad(); loss = model.loss(pos_rw, neg_rw); loss.backward(); opt.step()
    >>> model
    Node2Vec(3, 4)
"""
from typing import List, Optional, Tuple, Union

import torch
from torch.utils.data import DataLoader

from distemb.embedding import DistEmbedding
from distemb.integrations.pyg import torch_geometric
from distemb.pyg.walks import RandomWalker

__all__ = ["Node2Vec"]

_utils = torch_geometric.utils


def _normal(shape, dtype):
    """``nn.Embedding``'s initialisation (PyG's ``reset_parameters``): N(0, 1)."""
    return torch.randn(shape).to(dtype)


def _pairs(windows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(first node, other node) of every pair a window makes: its first node with each
    of the others."""
    rest = windows.size(1) - 1
    return windows[:, :1].expand(-1, rest).reshape(-1), windows[:, 1:].reshape(-1)


def _scores(rows: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """``h_start . h_rest`` of every pair of ``windows`` (row indices), as PyG's loss
    lays them out: window-major, then position in the window."""
    first = rows.index_select(0, windows[:, 0])
    rest = rows.index_select(0, windows[:, 1:].reshape(-1)).view(
        windows.size(0), windows.size(1) - 1, rows.size(1))
    return torch.bmm(rest, first.unsqueeze(2)).view(-1)


class _WindowLoss(torch.autograd.Function):
    """PyG's Node2Vec loss on rows of unique nodes, its gradients summed per row.

    Forward is PyG's float32 expression, ``-log(s(x) + eps)`` averaged over the positive
    pairs plus ``-log(1 - s(x) + eps)`` over the negative ones, with each score ``x`` one
    batched product instead of a broadcast product and sum. Backward is what autograd
    computes for that expression, pair by pair (``dL/dx``: ``-(1 - s) s / (s + eps) / P``
    and ``(1 - s) s / (1 - s + eps) / N``: zero, as in PyG, where float32 rounds ``s`` to
    1), then summed into the rows in one sparse product, so no (pairs, dim) gradient is
    materialised and the optimizer receives one row per node.
    """

    @staticmethod
    def forward(ctx, rows, pos, neg, eps):
        x_pos, x_neg = _scores(rows, pos), _scores(rows, neg)
        s_pos, s_neg = torch.sigmoid(x_pos), torch.sigmoid(x_neg)
        loss = -torch.log(s_pos + eps).mean() - torch.log(1 - s_neg + eps).mean()
        c_pos = -((1 - s_pos) * s_pos) / (s_pos + eps) / max(len(x_pos), 1)
        c_neg = ((1 - s_neg) * s_neg) / (1 - s_neg + eps) / max(len(x_neg), 1)
        a_pos, b_pos = _pairs(pos)
        a_neg, b_neg = _pairs(neg)
        a, b, c = torch.cat([a_pos, a_neg]), torch.cat([b_pos, b_neg]), torch.cat([c_pos, c_neg])
        # d loss / d rows = M rows with M[a, b] += c and M[b, a] += c, pair by pair
        ctx.pairs = torch.sparse_coo_tensor(torch.stack([torch.cat([a, b]), torch.cat([b, a])]),
                                            torch.cat([c, c]), (len(rows), len(rows)),
                                            check_invariants=False)
        ctx.save_for_backward(rows)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        grad = torch.sparse.mm(ctx.pairs, rows.detach())
        ctx.pairs = None
        return grad * grad_out, None, None, None


class Node2Vec(torch.nn.Module):
    """PyG's ``Node2Vec`` on a distemb table.

    Args:
        edge_index: the graph; it and the arguments after it up to ``num_nodes``
            (``embedding_dim``, ``walk_length``, ``context_size``, ``walks_per_node``,
            ``p``, ``q``, ``num_negative_samples``) are PyG's ``Node2Vec``'s.
        sparse: accepted for PyG's signature; a distemb table is always updated sparsely
            (only the rows a batch looked up), whatever it says.
        name: the table's distemb name (None: a fresh anonymous one); tables of one name
            share rows, so every trainer of a job names it the same.
        context: the :class:`~distemb.context.DistContext` (default: the current one).
        part_policy: how the table's rows are sharded (default: even ranges).
        dtype: how its rows are stored (float32, or torch.bfloat16 / torch.float16).

    Raises:
        ValueError: ``walk_length`` < ``context_size``, or a size that is not a positive
            int.

    Example:
        >>> import torch
        >>> from distemb.pyg import Node2Vec
        >>> m = Node2Vec(torch.tensor([[0, 1], [1, 0]]), 2, walk_length=2, context_size=2)
        >>> pos_rw, neg_rw = m.sample(torch.tensor([0]))
        >>> pos_rw.shape, neg_rw.shape, m.loss(pos_rw, neg_rw).item() > 0
        (torch.Size([1, 2]), torch.Size([1, 2]), True)
    """

    def __init__(self, edge_index: torch.Tensor, embedding_dim: int, walk_length: int,
                 context_size: int, walks_per_node: int = 1, p: float = 1.0, q: float = 1.0,
                 num_negative_samples: int = 1, num_nodes: Optional[int] = None,
                 sparse: bool = False, *, name: Optional[str] = None, context=None,
                 part_policy=None, dtype=torch.float32):
        super().__init__()
        for arg, value in (("embedding_dim", embedding_dim), ("walk_length", walk_length),
                           ("context_size", context_size), ("walks_per_node", walks_per_node),
                           ("num_negative_samples", num_negative_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: expected a positive int, got {value!r}")
        if walk_length < context_size:
            raise ValueError(f"walk_length: expected >= context_size ({context_size}), got "
                             f"{walk_length}")
        self.num_nodes = _utils.num_nodes.maybe_num_nodes(edge_index, num_nodes)
        row, col = _utils.sort_edge_index(edge_index, num_nodes=self.num_nodes).cpu()
        self.rowptr, self.col = torch_geometric.index.index2ptr(row, self.num_nodes), col
        self.walker = RandomWalker(self.rowptr, self.col)
        self.EPS = 1e-15
        self.embedding_dim = embedding_dim
        self.walk_length = walk_length - 1
        self.context_size = context_size
        self.walks_per_node = walks_per_node
        self.p, self.q = p, q
        self.num_negative_samples = num_negative_samples
        self.embedding = DistEmbedding(self.num_nodes, embedding_dim, name=name,
                                       init_func=_normal, part_policy=part_policy,
                                       context=context, dtype=dtype)

    def reset_parameters(self):
        """Draw every row again from N(0, 1) (PyG's ``reset_parameters``)."""
        self.embedding.weight[slice(0, self.num_nodes)] = \
            _normal((self.num_nodes, self.embedding_dim), torch.float32)

    def forward(self, batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rows of the nodes in ``batch`` (every node when None), traced for the
        optimizer while autograd records."""
        if batch is None:
            batch = torch.arange(self.num_nodes)
        return self.embedding(batch)

    def loader(self, **kwargs) -> DataLoader:
        """PyG's: a DataLoader over the node ids whose batches are :meth:`sample`'s."""
        return DataLoader(range(self.num_nodes), collate_fn=self.sample, **kwargs)

    def _windows(self, rw: torch.Tensor) -> torch.Tensor:
        num_walks_per_rw = 1 + self.walk_length + 1 - self.context_size
        return torch.cat([rw[:, j:j + self.context_size] for j in range(num_walks_per_rw)],
                         dim=0)

    def pos_sample(self, batch: torch.Tensor) -> torch.Tensor:
        """Every window of ``context_size`` nodes of ``walks_per_node`` walks from each
        node of ``batch`` (PyG's, walked by :class:`~distemb.pyg.walks.RandomWalker`)."""
        batch = batch.repeat(self.walks_per_node)
        rw = self.walker(batch, self.walk_length, self.p, self.q)
        return self._windows(rw)

    def neg_sample(self, batch: torch.Tensor) -> torch.Tensor:
        """Windows of uniformly drawn nodes after each node of ``batch`` (PyG's)."""
        batch = batch.repeat(self.walks_per_node * self.num_negative_samples)
        rw = torch.randint(self.num_nodes, (batch.size(0), self.walk_length),
                           dtype=batch.dtype, device=batch.device)
        rw = torch.cat([batch.view(-1, 1), rw], dim=-1)
        return self._windows(rw)

    def sample(self, batch: Union[List[int], torch.Tensor]
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(positive windows, negative windows) of ``batch`` (PyG's)."""
        if not isinstance(batch, torch.Tensor):
            batch = torch.tensor(batch)
        return self.pos_sample(batch), self.neg_sample(batch)

    def loss(self, pos_rw: torch.Tensor, neg_rw: torch.Tensor) -> torch.Tensor:
        """PyG's loss of positive and negative windows, with PyG's float32 maths (see the
        module): every node looked up once, the gradients summed per node."""
        ids = torch.cat([pos_rw.reshape(-1), neg_rw.reshape(-1)])
        nodes, where = torch.unique(ids, return_inverse=True)
        rows = self.embedding(nodes)
        pos = where[:pos_rw.numel()].view(pos_rw.shape)
        neg = where[pos_rw.numel():].view(neg_rw.shape)
        return _WindowLoss.apply(rows, pos, neg, self.EPS)

    def test(self, train_z: torch.Tensor, train_y: torch.Tensor, test_z: torch.Tensor,
             test_y: torch.Tensor, solver: str = "lbfgs", *args, **kwargs) -> float:
        """PyG's: the accuracy of a logistic regression fit on (train_z, train_y), scored
        on (test_z, test_y) (needs scikit-learn)."""
        from sklearn.linear_model import LogisticRegression  # optional, as in PyG

        clf = LogisticRegression(*args, solver=solver, **kwargs).fit(
            train_z.detach().cpu().numpy(), train_y.detach().cpu().numpy())
        return clf.score(test_z.detach().cpu().numpy(), test_y.detach().cpu().numpy())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_nodes}, {self.embedding_dim})"
