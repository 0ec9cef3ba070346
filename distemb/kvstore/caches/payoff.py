"""Whether a trainer cache pays for itself in time, judged window by window.

Fewer bytes are not always less time: where the wire is fast (loopback, a co-located
job) the cache's own work per step (its lookup, the versioned pull, the update of the
copies, and the servers' version checks) costs more than the rows it keeps off the
wire. So a table's cache times its pulls and updates (the wall time of each, the wait
for the servers included) and compares windows of :data:`~distemb.kvstore.caches.table.DECAY`
pulls: cached ones against plain ones (the cache idle and empty, its pulls and updates
passed through as they came). A cache slower than plain pulls empties itself and stays
idle for :data:`BACKOFF` windows, twice as long after each loss in a row (up to
:data:`MAX_BACKOFF`); one faster measures plain pulls again after :data:`REPROBE`
windows, then twice as long each time (up to :data:`MAX_REPROBE`: the link or the load
may change). The first cached window after a start
refills the cache and is not judged. Results do not depend on it: an idle cache holds
no copy, its pulls read the owners.
"""
from typing import Optional

#: Windows a cache found slower than plain pulls stays idle, the first time.
BACKOFF = 4
#: The longest idle period (in windows) after losses in a row.
MAX_BACKOFF = 64
#: Windows after which a cache found faster measures plain pulls again, the first time;
#: doubled at each such measurement up to :data:`MAX_REPROBE` (back after a loss).
REPROBE = 16
MAX_REPROBE = 128


class Payoff:
    """The timing of one table's cache: time spent this window, the last plain and cached
    windows' mean time per pull (with its update), and the backoff."""

    def __init__(self):
        self.spent = 0.0
        self.plain: Optional[float] = None   # s per pull, the last plain window
        self.cached: Optional[float] = None  # s per pull, the last judged cached window
        self.windows = 0
        self.plain_at = 0                    # the window ``plain`` is from
        self.warm = True                     # the next cached window refills: not judged
        self.backoff, self.reprobe = BACKOFF, REPROBE
        self.losses = 0                      # windows found slower than plain pulls

    def spend(self, seconds: float) -> None:
        """Add the wall time of one pull or update of the table."""
        self.spent += seconds

    def window(self, was_idle: bool, pulls: int) -> int:
        """A window of ``pulls`` pulls (and their updates) ended, idle or cached.

        Returns:
            how many windows the cache should now stay idle (0: it goes on as it is).
        """
        mean, self.spent = self.spent / max(1, pulls), 0.0
        self.windows += 1
        if was_idle:
            self.plain, self.plain_at, self.warm = mean, self.windows, True
            return 0
        if self.warm:
            self.warm = False
            return 0
        self.cached = mean
        if self.plain is None or self.windows - self.plain_at > self.reprobe:
            if self.plain is not None:
                self.reprobe = min(2 * self.reprobe, MAX_REPROBE)
            return 1  # measure plain pulls for one window, then compare
        if self.cached < self.plain:
            self.backoff = BACKOFF
            return 0
        self.losses += 1
        self.reprobe = REPROBE
        idle, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)
        return idle
