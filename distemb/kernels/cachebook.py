"""The per-step bookkeeping of a trainer cache and of the exact protocol's owners, one
compiled pass per table and step, or its numpy twin.

The compiled module (``csrc/_cachebook.pyx``) is chosen by the same switches as every
kernel: it runs while :func:`distemb.kernels.active` is ``'compiled'``; ``DISTEMB_NO_EXT=1``
or ``kernels.implementation('reference')`` give the twin in
:mod:`distemb.kernels.reference_cachebook`. Both give the same arrays for the same calls.

- :func:`dense_lookup`: a pull's ids of a dense table made unique, counted, and their
  cache slots;
- :func:`held_versions`: what a pull asks for the rows a cache may hold;
- :func:`settle`: a versioned pull's reply stored in the cache, the pull's rows written;
- :func:`held_step`: the gradients an exact step applies to the held copies;
- :func:`held_answer`: an owner's answer about the held rows of one part of an exact
  update (:func:`distemb.kvstore.server.exact.held_reply`).

Callers are :mod:`distemb.kvstore.caches.trainer` and :mod:`distemb.kvstore.server.exact`:
indices (slots, positions) are theirs and trusted, as the other kernels trust range-checked
ids; dtypes and shapes are checked here.

Example:
    >>> import numpy as np
    >>> have, ask, held = held_versions(np.array([2, -1]), np.array([0, 0, 7]),
    ...                                 np.zeros(3, np.int64), step=1, staleness=0)
    >>> have.tolist(), ask.tolist(), held
    ([7, -1], [True, True], 1)
"""
from typing import List, Optional, Sequence, Tuple

import numpy as np

from distemb import kernels
from distemb.kernels import reference_cachebook

if kernels.HAS_EXT:
    from distemb import _cachebook as _compiled  # built with _kernels, same switch
else:
    _compiled = None


def _impl():
    return _compiled if _compiled is not None and kernels.active() == "compiled" \
        else reference_cachebook


def _int64(name, a):
    if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
        raise TypeError(f"{name}: expected a 1-d int64 array, got {type(a).__name__} "
                        f"dtype={getattr(a, 'dtype', None)} ndim={getattr(a, 'ndim', None)}")
    return np.ascontiguousarray(a)


def _buffer(name, a):
    """``a`` (C-contiguous, written in place) as one row of bytes per row."""
    if not isinstance(a, np.ndarray) or a.ndim < 1 or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous array of rows, got "
                        f"{type(a).__name__} ndim={getattr(a, 'ndim', None)}")
    return a.reshape(a.shape[0], -1 if a.shape[0] else int(np.prod(a.shape[1:]))).view(
        np.uint8)


def _rows(name, a, like, what):
    if not isinstance(a, np.ndarray) or a.dtype != like.dtype or \
            a.shape[1:] != like.shape[1:]:
        raise TypeError(f"{name}: expected rows of {like.dtype} {like.shape[1:]} (as "
                        f"{what}), got {getattr(a, 'dtype', None)} "
                        f"{getattr(a, 'shape', (None,))[1:]}")
    return _buffer(name, np.ascontiguousarray(a))


def dense_lookup(ids, slot_map, seen, any_held: bool = True
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A pull's ids of a dense table, ``0 <= id < len(slot_map)`` (checked by the caller).

    Args:
        ids: the pull's ids.
        slot_map: int32 or int64, the cache slot of every id (-1: not held).
        seen: uint8, every id's recent pulls: one more for each unique id, in place.
        any_held: False when the map holds no slot (every slot is -1 then, and the map
            is not read).

    Returns:
        (the unique ids in order of first appearance, ``inverse``: ``uniq[inverse] ==
        ids``, the cache slot of each unique id as int64).
    """
    ids = _int64("ids", ids)
    if not isinstance(slot_map, np.ndarray) or slot_map.dtype not in (np.int32, np.int64) \
            or slot_map.ndim != 1 or not slot_map.flags.c_contiguous:
        raise TypeError(f"slot_map: expected a contiguous 1-d int32 or int64 array, got "
                        f"{getattr(slot_map, 'dtype', type(slot_map).__name__)}")
    if not isinstance(seen, np.ndarray) or seen.dtype != np.uint8 or \
            seen.shape != slot_map.shape:
        raise TypeError(f"seen: expected uint8 counts of shape {slot_map.shape}, got "
                        f"{getattr(seen, 'dtype', None)} {getattr(seen, 'shape', None)}")
    uniq, inverse, slots = (np.empty(len(ids), np.int64) for _ in range(3))
    n = _impl().dense_lookup(ids, slot_map, seen, int(bool(any_held)), uniq, inverse, slots)
    return uniq[:n], inverse, slots[:n]


def held_versions(slots, version, checked, step: int, staleness: int
                  ) -> Tuple[np.ndarray, np.ndarray, int]:
    """What a pull asks about rows whose cache slots are ``slots`` (-1: not held).

    Returns:
        (``have``: the version held, -1 where not held; ``ask``: bool, False only for a
        held row validated less than ``staleness`` steps before ``step``, per
        ``checked``; the number of rows held).
    """
    slots = _int64("slots", slots)
    have = np.empty(len(slots), np.int64)
    ask = np.empty(len(slots), np.uint8)
    held = _impl().held_versions(slots, _int64("version", version),
                                 _int64("checked", checked), int(step), int(staleness),
                                 have, ask)
    return have, ask.view(bool), held


def settle(slots, got, vers, rows, states: Sequence[np.ndarray], have, ask, inverse,
           ready, ready_rows, values, cache_states: Sequence[np.ndarray], version, checked,
           step: int, stamp, tick: int) -> np.ndarray:
    """Store a versioned pull's reply in a cache and return the pull's rows.

    Args:
        slots: the cache slot of each unique id of the pull (-1: not kept), after
            admission.
        got, vers, rows, states: the reply: positions (into ``slots``) of the rows that
            came, their versions, rows, and the state rows of those whose ``have`` is not
            -1, in order.
        have, ask: per unique id, as sent (:func:`held_versions`; -2 for a row to keep).
        inverse: the pull's ids as positions into ``slots``.
        ready, ready_rows: positions and rows served by a prefetch.
        values, cache_states, version, checked, stamp: the cache's arrays by slot,
            written in place: every fetched row with a slot is stored with its state,
            version and ``checked = step``; every asked held row gets ``checked = step``;
            with ``tick >= 0`` (LRU) every held row of the pull gets ``stamp = tick``.

    Returns:
        (len(inverse), D) rows: from the cache where held, else from the reply or the
        prefetch.

    Raises:
        ValueError: a position neither held, fetched nor prefetched.
    """
    slots, got, inverse = _int64("slots", slots), _int64("got", got), \
        _int64("inverse", inverse)
    if len(states) != len(cache_states):
        raise TypeError(f"states: expected {len(cache_states)} state arrays, got "
                        f"{len(states)}")
    out = np.empty((len(inverse),) + values.shape[1:], values.dtype)
    _impl().settle(
        slots, got, _int64("vers", vers), _rows("rows", rows, values, "the cache's values"),
        [_rows("states", s, c, "the cache's state") for s, c in zip(states, cache_states)],
        _int64("have", have), np.ascontiguousarray(ask).view(np.uint8), inverse,
        _int64("ready", ready), _rows("ready_rows", ready_rows, values, "the cache's values"),
        _buffer("values", values), [_buffer("cache_states", c) for c in cache_states],
        _int64("version", version), _int64("checked", checked), int(step),
        _int64("stamp", stamp), int(tick), np.empty(len(slots), np.int64), _buffer("out", out))
    return out


def held_step(slots, grads, summed, sums, summed_versions, drop, skip_drop: bool,
              version) -> Tuple[np.ndarray, np.ndarray]:
    """The gradients an exact step applies to the held copies of an update's rows.

    Args:
        slots: cache slot of each id of the update (-1: not held).
        grads: the update's (len(slots), D) gradients.
        summed, sums, summed_versions: positions of held rows the owner summed with
            other trainers' gradients, those sums and the rows' versions after the step.
        drop: positions of held rows whose copy is void; ``skip_drop``: leave them out.
        version: the cache's versions by slot, written in place: every held row's
            version moves by 1, then the summed rows' become ``summed_versions``.

    Returns:
        (slots to update, their gradients: the owner's sum where it summed, else the
        update's own), in the update's order.
    """
    slots = _int64("slots", slots)
    grads = np.ascontiguousarray(grads)
    if grads.ndim != 2 or len(grads) != len(slots):
        raise TypeError(f"grads: expected ({len(slots)}, D) rows, got shape {grads.shape}")
    at = np.empty(len(slots), np.int64)
    step = np.empty_like(grads)
    k = _impl().held_step(slots, _buffer("grads", grads), _int64("summed", summed),
                          _rows("sums", sums, grads, "grads"),
                          _int64("summed_versions", summed_versions), _int64("drop", drop),
                          int(bool(skip_drop)), _int64("version", version),
                          np.empty(len(slots), np.int64), at, _buffer("step", step))
    return at[:k], step[:k]


def held_answer(uniq, ids, have, before: Optional[np.ndarray], counts, start: int
                ) -> List[np.ndarray]:
    """An owner's answer about the held rows of one part of an exact update.

    Args:
        uniq: the part's sorted unique ids of the step; ``before`` their versions before
            it (None: rows have no versions, every held copy is void); ``counts`` the
            trainers whose gradients reached each.
        ids, have: the update's ids in this part (each in ``uniq``) and the version its
            cache holds of each (-1: not held); ``start``: their first position in the
            update.

    Returns:
        [positions of held rows whose copy is void (the version held is not the one
        before the step), positions of those others' gradients reached too, their
        versions after the step, their indices into ``uniq``].
    """
    ids, have = _int64("ids", ids), _int64("have", have)
    known = before is not None
    before = _int64("before", before) if known else np.empty(0, np.int64)
    n = len(ids)
    drop, pos, vers, at = (np.empty(n, np.int64) for _ in range(4))
    nd, npos = _impl().held_answer(_int64("uniq", uniq), ids, have, before,
                                   _int64("counts", counts), int(known), int(start), drop,
                                   pos, vers, at)
    return [drop[:nd], pos[:npos], vers[:npos], at[:npos]]
