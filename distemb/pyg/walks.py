"""Random walks on a CSR graph in plain torch: uniform (DeepWalk) and node2vec-biased.

PyG's ``Node2Vec`` walks with pyg-lib's compiled ``random_walk``, which is not on PyPI;
:class:`RandomWalker` walks the same graph (PyG's ``rowptr``/``col``) with a few tensor
ops per step, so :class:`distemb.pyg.Node2Vec` needs no compiled companion. A node
without out-edges ends its walk where it is (the walk repeats it), as PyG's walkers do.
node2vec's bias (``p``, ``q``) is drawn by rejection, as pyg-lib and torch-cluster draw
it: a uniform neighbour is kept with probability ``1/p`` (it is the previous node), 1 (a
neighbour of the previous node) or ``1/q`` (farther), each over the largest of the three.

Example:
    >>> import torch
    >>> walker = RandomWalker(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 0]))
    >>> walker(torch.tensor([0, 2]), walk_length=3)   # the cycle 0 -> 1 -> 2 -> 0
    tensor([[0, 1, 2, 0],
            [2, 0, 1, 2]])
"""
from typing import Optional

import torch

__all__ = ["RandomWalker"]


class RandomWalker:
    """Walks on the CSR graph ``(rowptr, col)`` (PyG's ``Node2Vec.rowptr``, ``.col``).

    Random numbers come from torch's default generator (``torch.manual_seed`` makes the
    walks repeatable).

    Args:
        rowptr: int64 (N + 1,) row offsets.
        col: int64 (E,) neighbours of each row, sorted within each row (PyG's
            ``sort_edge_index`` sorts them) when node2vec's ``p`` or ``q`` is not 1.

    Raises:
        ValueError: ``rowptr`` and ``col`` do not describe one CSR graph.

    Example:
        >>> import torch
        >>> RandomWalker(torch.tensor([0, 1, 1]), torch.tensor([1]))(torch.tensor([1]), 2)
        tensor([[1, 1, 1]])
    """

    def __init__(self, rowptr: torch.Tensor, col: torch.Tensor):
        rowptr, col = torch.as_tensor(rowptr), torch.as_tensor(col)
        if rowptr.dim() != 1 or col.dim() != 1 or len(rowptr) < 1 or \
                int(rowptr[0]) != 0 or int(rowptr[-1]) != len(col):
            raise ValueError(f"rowptr, col: expected CSR offsets (N + 1,) from 0 to "
                             f"len(col) = {len(col)}, got rowptr of shape "
                             f"{tuple(rowptr.shape)}")
        self.rowptr, self.col = rowptr.to(torch.int64), col.to(torch.int64)
        self.num_nodes = len(rowptr) - 1
        self._edge_keys: Optional[torch.Tensor] = None  # row * N + col, for node2vec's bias

    def _step(self, cur: torch.Tensor) -> torch.Tensor:
        """One uniform step from every node of ``cur`` (a node without out-edges stays)."""
        start = self.rowptr[cur]
        deg = self.rowptr[cur + 1] - start
        pick = (torch.rand(len(cur)) * deg).to(torch.int64).clamp_(max=(deg - 1).clamp_(min=0))
        nxt = self.col[(start + pick).clamp_(max=max(len(self.col) - 1, 0))] \
            if len(self.col) else cur
        return torch.where(deg > 0, nxt, cur)

    def _adjacent(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Whether each edge a -> b exists."""
        if self._edge_keys is None:
            rows = torch.repeat_interleave(torch.arange(self.num_nodes),
                                           self.rowptr[1:] - self.rowptr[:-1])
            self._edge_keys = rows * self.num_nodes + self.col
        keys = a * self.num_nodes + b
        at = torch.searchsorted(self._edge_keys, keys).clamp_(max=max(len(self.col) - 1, 0))
        return (self._edge_keys[at] == keys) if len(self.col) else torch.zeros_like(keys,
                                                                                 dtype=torch.bool)

    def __call__(self, start: torch.Tensor, walk_length: int, p: float = 1.0,
                 q: float = 1.0) -> torch.Tensor:
        """``walk_length`` steps from every node of ``start``.

        Args:
            start: int64 start nodes.
            walk_length: steps per walk (PyG's ``Node2Vec.walk_length``), >= 1.
            p, q: node2vec's return and in-out parameters, > 0 (1 and 1: uniform).

        Returns:
            int64 (len(start), walk_length + 1): each walk, its start first.

        Raises:
            ValueError: ``walk_length`` < 1, ``p`` or ``q`` not > 0, or a start node out
                of range.
        """
        if isinstance(walk_length, bool) or not isinstance(walk_length, int) or walk_length < 1:
            raise ValueError(f"walk_length: expected an int >= 1, got {walk_length!r}")
        if not (p > 0 and q > 0):
            raise ValueError(f"p, q: node2vec parameters must be > 0, got p={p}, q={q}")
        start = torch.as_tensor(start).to(torch.int64).view(-1)
        if len(start) and (int(start.min()) < 0 or int(start.max()) >= self.num_nodes):
            raise ValueError(f"start: expected node ids in 0..{self.num_nodes - 1}, got "
                             f"{int(start.min())}..{int(start.max())}")
        walks = [start, self._step(start)]
        biased = p != 1.0 or q != 1.0
        if biased:
            top = max(1.0 / p, 1.0, 1.0 / q)
            keep_back, keep_near, keep_far = 1.0 / p / top, 1.0 / top, 1.0 / q / top
        for _ in range(walk_length - 1):
            prev, cur = walks[-2], walks[-1]
            if not biased:
                walks.append(self._step(cur))
                continue
            nxt = cur.clone()
            todo = torch.arange(len(cur))
            while len(todo):  # rejection: redraw the walks whose draw was not kept
                x = self._step(cur[todo])
                r = torch.rand(len(todo))
                back = x == prev[todo]
                near = self._adjacent(prev[todo], x)
                keep = torch.where(back, r < keep_back,
                                   torch.where(near, r < keep_near, r < keep_far))
                c = cur[todo]
                keep |= self.rowptr[c + 1] == self.rowptr[c]  # no out-edges: it stays
                nxt[todo[keep]] = x[keep]
                todo = todo[~keep]
            walks.append(nxt)
        return torch.stack(walks, dim=1)
