"""Prefetcher: a dataloader's batches, each next batch's rows read while the current
one computes (torchrec's ``PrefetchTrainPipelineSparseDist``, DGL's prefetching loader).

``for batch in Prefetcher(loader, lookups):`` yields the loader's batches in order;
before it yields batch ``t`` it has taken batch ``t + 1`` from the loader and called
``emb.prefetch(ids)`` for each lookup ``lookups(batch t + 1)`` names
(:meth:`DistEmbedding.prefetch <distemb.embedding.DistEmbedding.prefetch>`). The loop
body looks batch ``t`` up (its rows were prefetched one iteration earlier), trains and
steps as usual; results are the same as without the Prefetcher.

Call it in the thread that trains (a client serves one thread at a time); the loader
may sample in another.

It times its iterations (the loop body, the loader and its own prefetch together), in
windows of :data:`WINDOW`, with prefetch on and off (:class:`~distemb.payoff.Payoff`):
where prefetching makes iterations slower (servers sharing the trainers' cores, a fast
wire: nothing to hide and the reading threads compete), it stops prefetching for a
while and tries again later. ``idle_when_slower=False`` prefetches every batch.

Example:
    >>> import torch, distemb
    >>> emb = distemb.DistEmbedding(10, 4, name="doc-pipeline")
    >>> opt = distemb.SparseAdagrad([emb], lr=0.1)
    >>> batches = [torch.tensor([1, 2]), torch.tensor([2, 3])]
    >>> for ids in Prefetcher(batches, lambda ids: [(emb, ids)]):
    ...     emb(ids).sum().backward(); opt.step()
"""
from time import perf_counter as clock
from typing import Callable, Iterable, Iterator, Optional, Sequence, Tuple, TypeVar

from distemb.payoff import Payoff

Batch = TypeVar("Batch")
#: Iterations per timed window.
WINDOW = 32


class Prefetcher:
    """Batches of ``batches``, each next batch's rows prefetched (module docstring).

    Args:
        batches: any iterable of batches (a dataloader).
        lookups: ``lookups(batch)`` -> the ``(DistEmbedding, ids)`` a batch will look up.
        enabled: False: the batches pass through unchanged, nothing is prefetched (the
            same loop with prefetch off).
        idle_when_slower: stop prefetching for a while where it makes iterations
            slower (module docstring); False: prefetch every batch.

    Raises:
        TypeError: ``lookups`` is not callable, or returns something other than
            ``(DistEmbedding, ids)`` pairs (raised when the batch is prefetched).
    """

    def __init__(self, batches: Iterable[Batch],
                 lookups: Callable[[Batch], Sequence[Tuple[object, object]]],
                 enabled: bool = True, idle_when_slower: bool = True):
        if not callable(lookups):
            raise TypeError(f"lookups: expected a function batch -> [(DistEmbedding, ids)], "
                            f"got {type(lookups).__name__}")
        self.batches, self.lookups, self.enabled = batches, lookups, bool(enabled)
        #: the timing of the last iteration over it (None: not timed)
        self.payoff: Optional[Payoff] = None
        self.idle_when_slower = bool(idle_when_slower)

    def _prefetch(self, batch) -> None:
        pairs = self.lookups(batch)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and
                    hasattr(pair[0], "prefetch")):
                raise TypeError(f"lookups(batch)[{i}]: expected a (DistEmbedding, ids) pair, "
                                f"got {type(pair).__name__}")
            pair[0].prefetch(pair[1])

    def __iter__(self) -> Iterator[Batch]:
        it = iter(self.batches)
        if not self.enabled:
            yield from it
            return
        _END = object()
        ahead = next(it, _END)
        if ahead is _END:
            return
        self._prefetch(ahead)
        payoff = self.payoff = Payoff(refills=False) if self.idle_when_slower else None
        off = left = done = 0  # off: this window without prefetch; left: such windows
        was_off = False
        start = clock()
        for following in it:
            if not off:
                if was_off:  # a lookup takes the oldest prefetch of its table: its own
                    self._prefetch(ahead)
                self._prefetch(following)  # read while ``ahead`` computes
            was_off = off
            yield ahead
            ahead = following
            if payoff is None:
                continue
            now = clock()
            payoff.spend(now - start)
            start, done = now, done + 1
            if done == WINDOW:
                idle = payoff.window(bool(off), WINDOW)
                left = idle or max(0, left - 1)
                off, done = left > 0, 0
        yield ahead


__all__ = ["Prefetcher"]
