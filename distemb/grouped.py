"""Lookups of several tables in one call, each traced in its own table.

Example:
    >>> import torch
    >>> from distemb.embedding import DistEmbedding
    >>> a = DistEmbedding(10, 4, name="doc-grouped-a")
    >>> [r.shape for r in grouped_lookup([(a, torch.tensor([1, 2])), (a, torch.tensor([3]))])]
    [torch.Size([2, 4]), torch.Size([1, 4])]
"""
from typing import Any, List, Sequence, Tuple

from distemb.arrays import Tensor
from distemb.embedding import DistEmbedding


def grouped_lookup(lookups: Sequence[Tuple[DistEmbedding, Tensor]],
                   device: Any = None) -> List[Tensor]:
    """Rows of several tables in one call: ``[emb(ids, device) for emb, ids in lookups]``.

    Each lookup is traced in its table as ``emb(ids)`` traces it, but the ids of every
    table go to their client together (:meth:`~distemb.kvstore.KVClient.pull_many`): in
    collective mode that is one exchange for all the tables instead of one per table (as
    torchrec's EmbeddingCollection looks up every feature of a KeyedJaggedTensor at
    once); elsewhere the tables are looked up in turn. A table may appear several times.
    In collective mode, every rank makes the same grouped calls with the same tables.

    Args:
        lookups: ``(table, ids)`` pairs (ids of any shape, as ``emb(ids)`` takes).
        device: where the rows go (as ``emb(ids, device=...)``).

    Returns:
        the rows of each lookup, in order.

    Example:
        >>> import torch
        >>> a = DistEmbedding(10, 4, name="doc-group-a")
        >>> b = DistEmbedding(20, 2, name="doc-group-b")
        >>> ra, rb = grouped_lookup([(a, torch.tensor([1, 9])), (b, torch.tensor([[3]]))])
        >>> ra.shape, rb.shape, len(a.trace), len(b.trace)
        (torch.Size([2, 4]), torch.Size([1, 1, 2]), 1, 1)
    """
    prepared = []
    for i, (emb, ids) in enumerate(lookups):
        if not isinstance(emb, DistEmbedding):
            raise TypeError(f"lookups[{i}]: expected a (DistEmbedding, ids) pair, got "
                            f"{type(emb).__name__}")
        client = emb.kvstore.view_on(device)
        prepared.append((emb, client) + tuple(emb.weight.lookup_ids(ids, client)))
    by_client = {}
    for i, (_, client, _, _) in enumerate(prepared):
        by_client.setdefault(id(client), (client, []))[1].append(i)
    rows: List[Any] = [None] * len(prepared)
    for client, which in by_client.values():
        got = client.pull_many([(prepared[i][0].name, prepared[i][2]) for i in which])
        for i, r in zip(which, got):
            rows[i] = r
    out = []
    for (emb, client, flat, shape), r in zip(prepared, rows):
        F = emb._F
        out.append(emb._record(flat, F.reshape(client.rows_out(r, F), shape), client))
    return out
