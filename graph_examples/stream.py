"""The batch stream of a training job: each trainer's share of it (:func:`shard`), made
in the calling thread and trained in a second one (:func:`overlapped`).

Example:
    >>> list(shard(range(7), rank=1, num_trainers=3, total=7))
    [1, 4]
    >>> got = []
    >>> overlapped(range(4), got.append, depth=2)
    >>> got
    [0, 1, 2, 3]
"""
import itertools
import queue
import threading


def overlapped(items, consume, depth: int, pipeline=lambda items: items) -> None:
    """Call consume(item) for every item, in order; with depth > 0, in a second thread.

    The calling thread makes the items (DGL's walks stay in the thread that seeded them:
    DGL keeps a generator per thread, so walks made elsewhere would differ from
    gensim's) and keeps up to ``depth`` ready in a queue while the other thread trains,
    so sampling overlaps with training on a second core. The consuming thread takes the
    items through ``pipeline(items)`` (a :class:`~distemb.pipeline.Prefetcher`). An
    exception in either thread is raised here after both have stopped.
    """
    if depth == 0:
        for item in pipeline(items):
            consume(item)
        return
    ready: "queue.Queue" = queue.Queue(maxsize=depth)
    failed = []

    def queued():
        while (item := ready.get()) is not _END:
            yield item

    def worker():
        try:
            for item in pipeline(queued()):
                consume(item)
        except BaseException as exc:  # handed to the calling thread
            failed.append(exc)

    thread = threading.Thread(target=worker, name="deepwalk-trainer", daemon=True)
    thread.start()

    def put(item):  # False once the trainer has stopped (it failed)
        while thread.is_alive():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in items:
            if not put(item):
                break
    finally:  # also when making an item failed: the trainer stops after what it has
        put(_END)
        thread.join()
    if failed:
        raise failed[0]


_END = object()  # the end of overlapped()'s queue


def shard(stream, rank: int, num_trainers: int, total: int):
    """Yield batch ``rank`` of each complete group of ``num_trainers`` consecutive batches
    among the first ``total`` of ``stream``.

    Every trainer of a job then takes the same number of steps (a sync_exact server waits
    for every trainer's push of each step); fewer than ``num_trainers`` batches left at
    the end are dropped.
    """
    batches = itertools.islice(stream, total)
    while True:
        group = list(itertools.islice(batches, num_trainers))
        if len(group) < num_trainers:
            return
        yield group[rank]
