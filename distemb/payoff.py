"""Whether a speed-up pays for itself in time, judged window by window: a trainer cache,
a prefetch.

Fewer bytes or an overlapped read are not always less time: where the wire is fast
(loopback, a co-located job) a trainer cache's own work per step (its lookup, the
versioned pull, the update of the copies, the servers' version checks) costs more than
the rows it keeps off the wire, and a prefetch's reading threads compete for the cores
with the step they should hide behind. So the user of a :class:`Payoff` times the work
it changes (a cache: its table's pulls and updates, the waits for the servers
included; a :class:`~distemb.pipeline.Prefetcher`: each whole iteration) and compares
windows: on against off (plain). Not faster than plain by :data:`MARGIN`, it turns
itself off for :data:`BACKOFF` windows, twice as long after each loss in a row (up to
:data:`MAX_BACKOFF`); faster, it measures a plain window again after :data:`REPROBE`
windows, then twice as long each time (up to :data:`MAX_REPROBE`: the link or the load
may change). With ``refills``, the first window after a start (a cache refilling) is not
judged. Results never depend on it: an idle cache holds no copy, a batch not prefetched
is read at its lookup.
"""
from typing import Optional

#: Windows a cache found slower than plain pulls stays idle, the first time.
BACKOFF = 4
#: The longest idle period (in windows) after losses in a row.
MAX_BACKOFF = 64
#: Kept on only when its windows take at most this share of a plain window's time: two
#: windows of a shared machine differ by a few percent with nothing changed, and a wrong
#: "faster" keeps a losing speed-up on until the next plain window.
MARGIN = 0.95
#: Windows after which a cache found faster measures plain pulls again, the first time;
#: doubled at each such measurement up to :data:`MAX_REPROBE` (back after a loss).
REPROBE = 16
MAX_REPROBE = 128


class Payoff:
    """The timing of one speed-up: time spent this window, the last plain and judged
    windows' mean time per unit (a pull with its update, an iteration), and the backoff.

    Args:
        refills: the first window after each start is not judged (a cache refilling).

    Example:
        >>> p = Payoff(refills=False)
        >>> p.spend(2.0); p.window(False, 1)   # on; no plain figure yet: one window off
        1
        >>> p.spend(1.0); p.window(True, 1)    # off (plain)
        0
        >>> p.spend(2.0); p.window(False, 1)   # on again, slower: off for BACKOFF windows
        4
    """

    def __init__(self, refills: bool = True):
        self.refills = refills
        self.spent = 0.0
        self.plain: Optional[float] = None   # s per unit, the last plain window
        self.on: Optional[float] = None      # s per unit, the last judged window (on)
        self.windows = 0
        self.plain_at = 0                    # the window ``plain`` is from
        self.warm = refills                  # the next window on refills: not judged
        self.backoff, self.reprobe = BACKOFF, REPROBE
        self.losses = 0                      # judged windows slower than plain ones

    def spend(self, seconds: float) -> None:
        """Add the wall time of some of the work judged (a pull, an update, an iteration)."""
        self.spent += seconds

    def window(self, was_idle: bool, units: int) -> int:
        """A window of ``units`` units (pulls with their updates, iterations) ended, off
        (``was_idle``: plain) or on.

        Returns:
            how many windows to stay off from now (0: go on as it is).
        """
        mean, self.spent = self.spent / max(1, units), 0.0
        self.windows += 1
        if was_idle:
            self.plain, self.plain_at, self.warm = mean, self.windows, self.refills
            return 0
        if self.warm:
            self.warm = False
            return 0
        self.on = mean
        if self.plain is None or self.windows - self.plain_at > self.reprobe:
            if self.plain is not None:
                self.reprobe = min(2 * self.reprobe, MAX_REPROBE)
            return 1  # measure a plain window, then compare
        if self.on <= MARGIN * self.plain:
            self.backoff = BACKOFF
            return 0
        self.losses += 1
        self.reprobe = REPROBE
        idle, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)
        return idle
