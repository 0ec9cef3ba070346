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

Example:
    >>> import torch, distemb
    >>> emb = distemb.DistEmbedding(10, 4, name="doc-pipeline")
    >>> opt = distemb.SparseAdagrad([emb], lr=0.1)
    >>> batches = [torch.tensor([1, 2]), torch.tensor([2, 3])]
    >>> for ids in Prefetcher(batches, lambda ids: [(emb, ids)]):
    ...     emb(ids).sum().backward(); opt.step()
"""
from typing import Callable, Iterable, Iterator, Sequence, Tuple, TypeVar

Batch = TypeVar("Batch")


class Prefetcher:
    """Batches of ``batches``, each next batch's rows prefetched (module docstring).

    Args:
        batches: any iterable of batches (a dataloader).
        lookups: ``lookups(batch)`` -> the ``(DistEmbedding, ids)`` a batch will look up.
        enabled: False: the batches pass through unchanged, nothing is prefetched (the
            same loop with prefetch off).

    Raises:
        TypeError: ``lookups`` is not callable, or returns something other than
            ``(DistEmbedding, ids)`` pairs (raised when the batch is prefetched).
    """

    def __init__(self, batches: Iterable[Batch],
                 lookups: Callable[[Batch], Sequence[Tuple[object, object]]],
                 enabled: bool = True):
        if not callable(lookups):
            raise TypeError(f"lookups: expected a function batch -> [(DistEmbedding, ids)], "
                            f"got {type(lookups).__name__}")
        self.batches, self.lookups, self.enabled = batches, lookups, bool(enabled)

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
        for following in it:
            self._prefetch(following)  # read while ``ahead`` computes
            yield ahead
            ahead = following
        yield ahead


__all__ = ["Prefetcher"]
