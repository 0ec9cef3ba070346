"""Reference twin of the compiled cache bookkeeping (``csrc/_cachebook.pyx``): plain numpy.

Inputs are assumed validated by :mod:`distemb.kernels.cachebook` (dtypes, shapes, index
ranges); rows and state rows come as ``uint8`` views, one row of bytes each.
"""
import numpy as np


def dense_lookup(ids, slot_map, seen, any_held, uniq, inverse, slots):
    u, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # unique ids in order of first appearance
    rank = np.empty(len(u), np.int64)
    rank[order] = np.arange(len(u))
    n = len(u)
    uniq[:n] = u[order]
    inverse[:] = rank[inv.reshape(-1)]
    seen[uniq[:n]] += np.uint8(1)
    slots[:n] = slot_map[uniq[:n]] if any_held else -1
    return n


def held_versions(slots, version, checked, step, staleness, have, ask):
    cached = slots >= 0
    have[:] = -1
    have[cached] = version[slots[cached]]
    ask[:] = 1
    if staleness > 0:
        ask[cached] = step - checked[slots[cached]] >= staleness
    return int(np.count_nonzero(cached))


def settle(slots, got, vers, rows, states, have, ask, inverse, ready, ready_rows, values,
           cache_states, version, checked, step, stamp, tick, source, out):
    checked[slots[ask.view(bool) & (slots >= 0)]] = step
    at = slots[got]
    kept = at >= 0
    values[at[kept]] = rows[kept]
    version[at[kept]] = vers[kept]
    checked[at[kept]] = step
    sub = kept[have[got] != -1]
    for state, cache_state in zip(states, cache_states):
        cache_state[at[kept]] = state[sub]
    source[:] = -1
    source[got[~kept]] = np.flatnonzero(~kept)
    source[ready] = len(got) + np.arange(len(ready))
    if tick >= 0:
        stamp[slots[slots >= 0]] = tick
    cached = slots[inverse] >= 0
    src = source[inverse]
    if np.any(~cached & (src < 0)):
        raise ValueError("settle: a row neither held, fetched nor prefetched")
    out[cached] = values[slots[inverse][cached]]
    fetched = ~cached & (src < len(got))
    out[fetched] = rows[src[fetched]]
    prefetched = ~cached & ~fetched
    out[prefetched] = ready_rows[src[prefetched] - len(got)]


def held_step(slots, grads, summed, sums, summed_versions, drop, skip_drop, version, where,
              at, step):
    where[:] = 0
    if skip_drop:
        where[drop] = -1
    where[summed] = np.arange(1, len(summed) + 1)
    mine = np.flatnonzero(slots >= 0)
    version[slots[mine]] += 1
    use = mine[where[mine] >= 0]
    k = len(use)
    at[:k] = slots[use]
    step[:k] = grads[use]
    from_sums = where[use] > 0
    step[:k][from_sums] = sums[where[use][from_sums] - 1]
    version[slots[summed]] = summed_versions
    return k


def held_answer(uniq, ids, have, before, counts, known, start, drop, pos, vers, at):
    held = np.flatnonzero(have != -1)
    where = np.searchsorted(uniq, ids[held])
    ok = before[where] == have[held] if known else np.zeros(len(held), bool)
    nd = int(np.count_nonzero(~ok))
    drop[:nd] = held[~ok] + start
    co = ok & (counts[where] > 1)
    npos = int(np.count_nonzero(co))
    pos[:npos] = held[co] + start
    vers[:npos] = before[where[co]] + counts[where[co]] if npos else 0
    at[:npos] = where[co]
    return nd, npos
