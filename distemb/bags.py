"""Bags: pooled lookups of a table's rows, with ``torch.nn.EmbeddingBag``'s semantics.

``emb.bag(ids, offsets, mode=...)`` (:meth:`~distemb.embedding.DistEmbedding.bag`)
returns one row per bag: the sum, mean or max (:class:`~distemb.enums.BagMode`) of the
rows of the bag's ids, as ``torch.nn.functional.embedding_bag`` computes it. Bags are the
rows of 2-D ids, or 1-D ids cut at ``offsets`` (``include_last_offset``: the last offset
ends the last bag); ``per_sample_weights`` scale each id's row (sum mode);
``padding_idx`` is an id whose entries count for nothing (its row is neither looked up
nor updated); an empty bag gives zeros.

How: the ids are deduplicated once (their ascending unique ids and, for every id, its
place among them); the unique rows are looked up through the table's own lookup path
(one pull, on any placement); one ``embedding_bag`` pass over those (U, D) rows reduces
every bag. No (B, L, D) tensor of every id's row is made, and the backward leaves on the
unique rows their gradients already summed per id (each weighted by its per-sample
weight, or divided by its bag's size for a mean). The table's trace then holds one lookup
of ascending unique ids whose gradient is summed: the client's duplicate sum has nothing
to add and hands it to the fused update as it is. The pass is torch's own op, on the
device the rows were looked up onto.

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

import torch
import torch.nn.functional as nnf

from distemb.arrays import Rows, Tensor, UniqueIds
from distemb.enums import BagMode

INT64 = (-2 ** 63, 2 ** 63 - 1)


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
        first, last = int(off[0]), int(off[-1])
        if first != 0:
            raise ValueError(f"offsets: the first bag must start at 0, got offsets[0]="
                             f"{first}")
        if last > n or (include_last_offset and last != n):
            want = f"= {n}" if include_last_offset else f"<= {n}"
            raise ValueError(f"offsets: expected offsets[-1] {want} (the number of ids"
                             f"{'; it ends the last bag' if include_last_offset else ''}), "
                             f"got offsets[-1]={last}")
        steps = off[1:] < off[:-1]
        if bool(steps.any()):
            i = int(steps.nonzero()[0]) + 1
            raise ValueError(f"offsets: expected non-decreasing offsets, got offsets[{i}]="
                             f"{int(off[i])} after {int(off[i - 1])}")
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

    def __init__(self, unique: UniqueIds, inverse: Tensor, offsets: Optional[Tensor],
                 mode: BagMode, weights: Optional[Tensor], include_last_offset: bool,
                 padding: Optional[int]):
        self.unique = unique
        self._inverse, self._offsets, self._mode = inverse, offsets, mode
        self._weights, self._include_last = weights, include_last_offset
        self._padding = padding  # the place of the zero row pool() appends, or None

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
        padding_idx = _padding_id(padding_idx, num_rows)
        unique, inverse = torch.unique(ids.reshape(-1).to(torch.int64), sorted=True,
                                       return_inverse=True)
        padding = None
        if padding_idx is not None and len(unique):
            at = int(torch.searchsorted(unique, torch.tensor(padding_idx,
                                                              device=unique.device)))
            if at < len(unique) and int(unique[at]) == padding_idx:
                is_pad = inverse == at
                inverse = inverse - (inverse > at).to(inverse.dtype)
                unique = torch.cat([unique[:at], unique[at + 1:]])
                padding = len(unique)
                inverse[is_pad] = padding
        return cls(unique, inverse.reshape(ids.shape), offsets, mode, per_sample_weights,
                   include_last_offset, padding)

    def pool(self, rows: Rows) -> Tensor:
        """One row per bag, reduced from ``rows``, the (U, D) rows of :attr:`unique`.

        Returns:
            (B, D) rows, on the device and of the dtype of ``rows``; autograd leaves on
            ``rows`` their gradients summed per unique id.
        """
        dev = rows.device
        weight = rows if self._padding is None else \
            torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))])
        weights = None if self._weights is None else self._weights.to(dev, rows.dtype)
        return nnf.embedding_bag(self._inverse.to(dev), weight,
                                 None if self._offsets is None else self._offsets.to(dev),
                                 mode=self._mode.value, per_sample_weights=weights,
                                 include_last_offset=self._include_last,
                                 padding_idx=self._padding)


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
