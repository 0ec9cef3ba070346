"""Bags: pooled lookups of a table's rows, with ``torch.nn.EmbeddingBag``'s semantics.

``emb.bag(ids, offsets, mode=...)`` (:meth:`~distemb.embedding.DistEmbedding.bag`)
returns one row per bag: the sum, mean or max (:class:`~distemb.enums.BagMode`) of the
rows of the bag's ids, as ``torch.nn.functional.embedding_bag`` computes it. Bags are the
rows of 2-D ids, or 1-D ids cut at ``offsets`` (``include_last_offset``: the last offset
ends the last bag); ``per_sample_weights`` scale each id's row (sum mode);
``padding_idx`` is an id whose entries count for nothing (its row is neither looked up
nor updated); an empty bag gives zeros.

How: the ids are deduplicated once, by one sort (their ascending unique ids, each id's
place among them, and the entries grouped by id); the unique rows are looked up through
the table's own lookup path (one pull, on any placement); one ``embedding_bag`` pass
over those (U, D) rows reduces every bag. No (B, L, D) tensor of every id's row is made.
The backward is a pooled lookup too: each unique id's gradient is the sum of the
upstream rows of the bags it is in (weighted, or divided by the bag's size for a mean),
one ``embedding_bag`` pass over the (B, D) upstream gradient with the entries grouped
by id, which the sort already did (torch's own backward sorts them again and zero-fills
a buffer first: 1.7x the CPU time, 1.4x in max mode; one core, bags of 20 zipf ids).
Max mode's gradient goes to each bag's arg-max row, ties to the first as torch's. So
the table's trace holds one lookup of ascending unique ids whose gradients are summed,
which the client's duplicate sum hands to the fused update as they are.

Every pass is torch's own op on the device the rows were looked up onto, balanced by
rows: an id's entries are summed in chunks of at most :data:`CHUNK` (a hot id of a zipf
batch owns thousands of entries; summed as one bag, one GPU thread group would add them
all while the others idle), then its chunks, in fixed orders: deterministic, no atomics
(max mode's gradient is scattered with ``index_add_``, which on a GPU is atomic).

Example:
    >>> import torch
    >>> bags = Bags.of(torch.tensor([4, 2, 4, 9]), torch.tensor([0, 3]), mode="mean")
    >>> bags.unique.tolist()
    [2, 4, 9]
    >>> rows = torch.tensor([[2.0], [4.0], [9.0]])   # the rows of 2, 4 and 9
    >>> bags.pool(rows).tolist()                      # mean of (4, 2, 4), mean of (9)
    [[3.3333332538604736], [9.0]]
"""
import operator
from typing import Optional

import numpy as np
import torch

from torch.autograd.function import once_differentiable

from distemb.arrays import Rows, Tensor, UniqueIds
from distemb.enums import BagMode

INT64 = (-2 ** 63, 2 ** 63 - 1)
INT32 = (-2 ** 31, 2 ** 31 - 1)
#: Most entries of one id summed as one bag in the backward (see the module docstring).
CHUNK = 64
#: torch.embedding_bag's mode numbers.
MODE_CODE = {BagMode.SUM: 0, BagMode.MEAN: 1, BagMode.MAX: 2}


def _integer_tensor(x, what: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what}: expected an integer tensor (int32 or int64), got {t.dtype}")
    return t


def _check_offsets(offsets, n: int, include_last_offset: bool) -> torch.Tensor:
    """``offsets`` of 1-D ids of length ``n``, checked as torch's embedding_bag needs
    them (it reads out of bounds, or fails naming an internal index, otherwise)."""
    if offsets is None:
        raise ValueError("offsets: 1-D ids need the offsets where each bag starts (or "
                         "pass 2-D ids, one bag per row), got None")
    off = _integer_tensor(offsets, "offsets")
    if off.dim() != 1:
        raise ValueError(f"offsets: expected a 1-D tensor, got shape {tuple(off.shape)}")
    if include_last_offset and len(off) == 0:
        raise ValueError("offsets: with include_last_offset=True the last offset ends the "
                         "last bag, so at least one is needed, got none")
    if len(off):
        host = off.detach().cpu().numpy()  # (B,) checked at numpy's cost per call
        first, last = int(host[0]), int(host[-1])
        if first != 0:
            raise ValueError(f"offsets: the first bag must start at 0, got offsets[0]="
                             f"{first}")
        if last > n or (include_last_offset and last != n):
            want = f"= {n}" if include_last_offset else f"<= {n}"
            raise ValueError(f"offsets: expected offsets[-1] {want} (the number of ids"
                             f"{'; it ends the last bag' if include_last_offset else ''}), "
                             f"got offsets[-1]={last}")
        down = np.flatnonzero(host[1:] < host[:-1])
        if len(down):
            i = int(down[0]) + 1
            raise ValueError(f"offsets: expected non-decreasing offsets, got offsets[{i}]="
                             f"{int(host[i])} after {int(host[i - 1])}")
    return off.to(torch.int64)


class Bags:
    """Bags of ids made ready to pool: their unique ids, and where each id's row is.

    :meth:`of` validates the arguments and deduplicates the ids; the caller looks up the
    rows of :attr:`unique` and :meth:`pool` reduces them into one row per bag.

    Attributes:
        unique: (U,) int64 ascending unique ids of the bags, ``padding_idx`` left out, on
            the ids' device.

    Example:
        >>> import torch
        >>> bags = Bags.of(torch.tensor([[7, 7], [3, 0]]), padding_idx=0, num_rows=10)
        >>> bags.unique.tolist()                          # no row of the padding id
        [3, 7]
        >>> bags.pool(torch.tensor([[1.0], [10.0]])).tolist()
        [[20.0], [1.0]]
    """

    def __init__(self, unique: UniqueIds, inverse: Tensor, order: Tensor, counts: Tensor,
                 padding: Optional[int], offsets: Tensor, mode: BagMode,
                 weights: Optional[Tensor], include_last_offset: bool):
        self.unique = unique
        # inverse: (N,) each entry's place in unique (the padding id's: len(unique), the
        # zero row pool() appends); order: the entries but the padding id's, grouped by
        # id in ascending order (stable), counts[u] of them for unique[u].
        self._inverse, self._order, self._counts = inverse, order, counts
        self._padding, self._offsets, self._mode = padding, offsets, mode
        self._weights, self._include_last = weights, include_last_offset

    @classmethod
    def of(cls, ids: Tensor, offsets: Optional[Tensor] = None, mode="sum",
           per_sample_weights: Optional[Tensor] = None, include_last_offset: bool = False,
           padding_idx: Optional[int] = None, num_rows: Optional[int] = None) -> "Bags":
        """Validate ``torch.nn.functional.embedding_bag``'s arguments and deduplicate.

        Args:
            ids: int32/int64 ids, 2-D (B, L): B bags of L ids; or 1-D, cut into bags at
                ``offsets``.
            offsets: for 1-D ids, the (B,) starts of the bags (non-decreasing, from 0, at
                most the number of ids), or (B + 1,) with ``include_last_offset``, the
                last one the number of ids (torch's CSR layout).
            mode: a :class:`~distemb.enums.BagMode` or its value: 'sum', 'mean' or 'max'.
            per_sample_weights: floats shaped as ``ids``, each id's row's weight (sum
                mode only).
            include_last_offset: the last offset ends the last bag (1-D ids only).
            padding_idx: an id whose entries count for nothing in their bag (a mean
                does not count them); its row is neither looked up nor updated. With
                ``num_rows`` (a table of keys 0..N-1) it is in [-N, N) and a negative
                one counts from the end, as torch's; a hash table's is any int64 key.
            num_rows: N for a table of the fixed keys 0..N-1, None for a hash table.

        Raises:
            TypeError: ids or offsets that are not integer tensors, per-sample weights
                that are not floats, a ``padding_idx`` that is not an int.
            ValueError: an unknown mode; ids neither 1-D nor 2-D; offsets with 2-D ids
                or none with 1-D ids, or offsets that are not bag starts;
                ``include_last_offset`` with 2-D ids; per-sample weights of another
                shape than the ids, or with another mode than 'sum'; a ``padding_idx``
                outside the table's rows.
        """
        mode = BagMode.parse(mode, "mode", ValueError)
        ids = _integer_tensor(ids, "ids")
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError(f"offsets: 2-D ids are one bag per row; expected None, got "
                                 f"a tensor of shape {tuple(torch.as_tensor(offsets).shape)}")
            if include_last_offset:
                raise ValueError("include_last_offset: 2-D ids are one bag per row and take "
                                 "no offsets; expected False, got True")
        elif ids.dim() == 1:
            offsets = _check_offsets(offsets, len(ids), include_last_offset)
        else:
            raise ValueError(f"ids: expected 2-D ids (one bag per row) or 1-D ids with "
                             f"offsets, got shape {tuple(ids.shape)}")
        if per_sample_weights is not None:
            w = per_sample_weights if isinstance(per_sample_weights, torch.Tensor) \
                else torch.as_tensor(per_sample_weights)
            if mode is not BagMode.SUM:
                raise ValueError(f"per_sample_weights: only mode 'sum' weights its rows, "
                                 f"got mode {mode.value!r}")
            if not w.is_floating_point():
                raise TypeError(f"per_sample_weights: expected a float tensor, got {w.dtype}")
            if tuple(w.shape) != tuple(ids.shape):
                raise ValueError(f"per_sample_weights: expected the ids' shape "
                                 f"{tuple(ids.shape)}, got {tuple(w.shape)}")
            per_sample_weights = w
        flat = ids.reshape(-1).to(torch.int64)
        if ids.dim() == 2:  # B bags of L ids
            offsets = torch.arange(ids.shape[0], device=ids.device) * ids.shape[1]
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        return cls(*_dedup(flat, _padding_id(padding_idx, num_rows)),
                   offsets.to(ids.device), mode, per_sample_weights, include_last_offset)

    def pool(self, rows: Rows) -> Tensor:
        """One row per bag, reduced from ``rows``, the (U, D) rows of :attr:`unique`.

        Returns:
            (B, D) rows, on the device and of the dtype of ``rows``; autograd leaves on
            ``rows`` their gradients summed per unique id (and on per-sample weights that
            require one, theirs).
        """
        dev = rows.device
        weights = None if self._weights is None else self._weights.to(dev, rows.dtype)
        return _Pool.apply(rows, weights, self._on(dev))

    def _on(self, device) -> "Bags":
        """These bags with their index tensors on ``device``."""
        if self._inverse.device == device:
            return self
        return Bags(self.unique, self._inverse.to(device), self._order.to(device),
                    self._counts.to(device), self._padding, self._offsets.to(device),
                    self._mode, self._weights, self._include_last)

    def reduce(self, rows: Rows, weights: Optional[Tensor]):
        """The forward pass of :meth:`pool`, without autograd.

        Returns:
            ``(pooled rows (B, D), the rows pooled (the padding id's zero row appended),
            each bag's entries but padding (B,), each bag's arg-max row per column (B, D;
            max mode))``.
        """
        table = rows if self._padding is None else \
            torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))])
        out, _, sizes, arg_max = torch.embedding_bag(
            table, self._inverse, self._offsets, False, MODE_CODE[self._mode], False,
            weights, self._include_last, self._padding)
        return out, table, sizes, arg_max

    def _bag_of_entries(self) -> Tensor:
        """(N,) the bag of each entry."""
        n = self._inverse.numel()
        ends = self._offsets[1:] if self._include_last else \
            torch.cat([self._offsets[1:], self._offsets.new_tensor([n])])
        starts = self._offsets[:-1] if self._include_last else self._offsets
        return torch.repeat_interleave(torch.arange(len(starts), device=starts.device),
                                       ends - starts, output_size=n)

    def row_gradients(self, grad: Tensor, sizes: Tensor, arg_max: Tensor) -> Tensor:
        """(U, D): each unique id's gradient, from the (B, D) gradient of the bags.

        Args:
            grad: the pooled rows' gradient.
            sizes: (B,) entries of each bag but padding (torch.embedding_bag's).
            arg_max: (B, D) each bag's arg-max row per column (max mode).
        """
        u, dim = len(self._counts), grad.shape[1]
        if self._mode is BagMode.MAX:
            grad = grad.masked_fill((sizes == 0)[:, None], 0)  # an empty bag's arg is 0
            out = grad.new_zeros((u + 1, dim))  # + the padding row's place
            cols = torch.arange(dim, device=grad.device)
            out.view(-1).index_add_(0, (arg_max.clamp(min=0) * dim + cols).reshape(-1),
                                    grad.reshape(-1))
            return out[:u]
        if self._mode is BagMode.MEAN:
            grad = grad / sizes.clamp(min=1).to(grad.dtype)[:, None]
        src = self._bag_of_entries()[self._order]
        weights = None if self._weights is None else \
            self._weights.to(grad.device, grad.dtype)[self._order]
        return _segment_sums(grad, src, self._counts, weights)

    def weight_gradients(self, grad: Tensor, table: Tensor) -> Tensor:
        """(N,) each per-sample weight's gradient: its row dot its bag's gradient
        (``table``: the rows pooled, the padding row zero)."""
        return (grad[self._bag_of_entries()] * table[self._inverse]).sum(-1)


class _Pool(torch.autograd.Function):
    """The pooled rows of :class:`Bags`; backward: :meth:`Bags.row_gradients`."""

    @staticmethod
    def forward(ctx, rows, weights, bags):
        out, table, sizes, arg_max = bags.reduce(rows, weights)
        ctx.bags, ctx.sizes, ctx.arg_max = bags, sizes, arg_max
        ctx.table = table if ctx.needs_input_grad[1] else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        bags, grad = ctx.bags, grad.contiguous()
        rows = bags.row_gradients(grad, ctx.sizes, ctx.arg_max) \
            if ctx.needs_input_grad[0] else None
        weights = bags.weight_gradients(grad, ctx.table) if ctx.needs_input_grad[1] else None
        return rows, weights, None


def _dedup(flat: Tensor, padding_id: Optional[int]):
    """``(unique, inverse, order, counts, padding)`` of flat ids (see :class:`Bags`), by
    one stable sort; ``padding``: the place of the padding id's zero row, or None."""
    low, high = torch.aminmax(flat) if len(flat) else (flat.new_zeros(()),) * 2
    if INT32[0] <= int(low) and int(high) <= INT32[1]:  # sorted as int32: 1.8x faster
        keys, order = torch.sort(flat.to(torch.int32), stable=True)
    else:
        keys, order = torch.sort(flat, stable=True)
    unique, counts = torch.unique_consecutive(keys, return_counts=True)
    unique = unique.to(torch.int64)
    inverse = torch.empty_like(order)
    inverse[order] = torch.repeat_interleave(
        torch.arange(len(unique), device=flat.device), counts, output_size=len(flat))
    if padding_id is None or not len(unique):
        return unique, inverse, order, counts, None
    at = int(torch.searchsorted(unique, unique.new_tensor(padding_id)))
    if at == len(unique) or int(unique[at]) != padding_id:
        return unique, inverse, order, counts, None
    lo = int(counts[:at].sum())
    hi = lo + int(counts[at])
    is_pad = inverse == at
    inverse = inverse - (inverse > at).to(inverse.dtype)
    unique = torch.cat([unique[:at], unique[at + 1:]])
    inverse[is_pad] = len(unique)
    return (unique, inverse, torch.cat([order[:lo], order[hi:]]),
            torch.cat([counts[:at], counts[at + 1:]]), len(unique))


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def _segment_sums(rows: Tensor, src: Tensor, counts: Tensor,
                  weights: Optional[Tensor]) -> Tensor:
    """(U, D): row u the sum of ``rows[src[j]]`` (times ``weights[j]``) over segment u of
    ``src``, segments consecutive, ``counts[u]`` entries each; a segment of more than
    :data:`CHUNK` entries in chunks of at most CHUNK (module docstring)."""
    first = counts.clamp(max=CHUNK)
    extra = counts - first
    first_start = _exclusive_cumsum(first)
    if not bool(extra.any()):
        return torch.embedding_bag(rows, src, first_start, False, 0, False, weights,
                                   False, None)[0]
    # Each segment's first CHUNK entries first, as one bag each; then the rest of the
    # long ones (few segments), in chunks of CHUNK: bags U.. of the same pass. The rest
    # is marked by +1 / -1 at its ends and a running sum, in stable order.
    n, u = len(src), len(counts)
    long = torch.nonzero(extra).squeeze(1)
    ends = torch.cumsum(counts, 0)[long]
    edges = torch.zeros(n + 1, dtype=torch.int32, device=src.device)
    edges[ends - extra[long]] = 1
    edges[ends] = -1
    rest = torch.cumsum(edges[:n], 0, dtype=torch.int32).bool()
    moved = torch.cat([src[~rest], src[rest]])
    if weights is not None:
        weights = torch.cat([weights[~rest], weights[rest]])
    extra_start = int(first.sum()) + _exclusive_cumsum(extra)
    chunks = (extra[long] + CHUNK - 1) // CHUNK
    chunk_seg = torch.repeat_interleave(long, chunks)
    chunk_first = _exclusive_cumsum(chunks)
    k = torch.arange(len(chunk_seg), device=src.device) - \
        torch.repeat_interleave(chunk_first, chunks)
    sums = torch.embedding_bag(rows, moved, torch.cat([first_start, extra_start[chunk_seg] +
                                                        k * CHUNK]),
                               False, 0, False, weights, False, None)[0]
    out = sums[:u]
    out.index_add_(0, long, torch.embedding_bag(
        sums[u:], torch.arange(len(chunk_seg), device=src.device), chunk_first, False, 0,
        False, None, False, None)[0])
    return out


def _padding_id(padding_idx, num_rows: Optional[int]) -> Optional[int]:
    """``padding_idx`` as the id it means (see :meth:`Bags.of`), or None."""
    if padding_idx is None:
        return None
    try:
        if isinstance(padding_idx, bool):
            raise TypeError
        padding_idx = operator.index(padding_idx)
    except TypeError:
        raise TypeError(f"padding_idx: expected an int id or None, got "
                        f"{padding_idx!r}") from None
    if num_rows is None:
        if not INT64[0] <= padding_idx <= INT64[1]:
            raise ValueError(f"padding_idx: expected an int64 key, got {padding_idx}")
        return padding_idx
    if not -num_rows <= padding_idx < num_rows:
        raise ValueError(f"padding_idx: expected an id in [-{num_rows}, {num_rows}) (a "
                         f"negative one counts from the end), got {padding_idx}")
    return padding_idx % num_rows
