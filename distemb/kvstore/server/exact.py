"""ExactSteps: the buffer of a server's sync_exact updates, one step of one table at a time;
:func:`held_reply`: what a trainer cache's held rows need after such a step.

In ``sync_exact`` mode every trainer sends each step's update of a table to every server
(empty when it has no rows there). A server holds the contributions until every trainer
sent its own, then applies them as one update (their gradients of equal rows summed)
and answers every trainer, so two trainers on half batches equal one trainer on the
whole batch.

Example:
    >>> from types import SimpleNamespace as Msg
    >>> steps = ExactSteps(num_trainers=1, timeout_s=1.0)
    >>> m = Msg(SERVICE=7, name="w", seq=1)
    >>> steps.join(m, None, lambda contribs: {id(c): len(contribs) for c in contribs})
    1
"""
import threading
import time

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import cachebook


class _Step:
    """Contributions of the trainers to one (table, step)."""

    def __init__(self):
        self.contribs, self.done, self.error, self.left = [], False, None, 0
        self.ranks = []  # the rank of each contribution's connection (None: in-process)
        self.replies = {}  # id(message) -> its reply, taken when applied


class ExactSteps:
    """The sync_exact steps a server is collecting; see the module docstring.

    Args:
        num_trainers: contributions that complete a step.
        timeout_s: how long a contribution waits for the others.
    """

    def __init__(self, num_trainers, timeout_s):
        self.num_trainers, self.timeout_s = num_trainers, timeout_s
        self._cond = threading.Condition()
        self._steps = {}

    def pending(self):
        """{(service, table, step): contributions buffered so far} of unfinished steps."""
        with self._cond:
            return {k: len(s.contribs) for k, s in self._steps.items() if not s.done}

    def join(self, m, session, apply):
        """Buffer ``m`` until every trainer sent its step ``m.seq`` of the table, then
        ``apply(contributions) -> {id(message): reply}`` once; answer each with its reply.

        The contributions are applied in rank order, not arrival order: a row's sum of
        three or more trainers' gradients rounds differently in another order, and the
        order the pushes happen to arrive in must not change the table (runs repeat).

        Raises:
            KVStoreError: this connection's rank already sent step ``m.seq`` of the table
                (its second push would stand in for a missing trainer), or the others did
                not send theirs within ``timeout_s``.
        """
        key = (m.SERVICE, m.name, m.seq)
        rank = session.rank if session is not None else None
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            step = self._steps.setdefault(key, _Step())
            if rank is not None and rank in step.ranks:
                raise KVStoreError(f"sync_exact: rank {rank} sent step {m.seq} of "
                                   f"{m.name!r} twice")
            step.contribs.append(m)
            step.ranks.append(rank)
            if len(step.contribs) == self.num_trainers:
                order = sorted(range(len(step.ranks)), key=lambda i: (
                    step.ranks[i] is None, step.ranks[i] or 0, i))
                try:
                    step.replies = apply([step.contribs[i] for i in order])
                except Exception as e:
                    step.error = e
                step.done = True
                self._cond.notify_all()
            while not step.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._steps.pop(key, None)
                    raise KVStoreError(f"sync_exact: step {m.seq} of {m.name!r} got "
                                       f"{len(step.contribs)} of {self.num_trainers} trainers' "
                                       f"pushes within {self.timeout_s} s")
                self._cond.wait(left)
            step.left += 1
            if step.left == len(step.contribs):
                self._steps.pop(key, None)
        if step.error is not None:
            raise step.error
        return step.replies.get(id(m))


def held_reply(m, rows, applied):
    """What keeps a trainer cache's held rows equal to the owner's after a summed step:
    the reply's arrays to update ``m`` (:class:`~distemb.transport.messages.Update` with
    ``have``), whose ``rows`` are ``[(part, ids, slice)]``, the step applied as
    ``applied[part] = (unique ids, summed gradients, contributions, versions before)``.

    For the rows ``m.have`` says the trainer holds: positions (in ``m.ids``) of those
    whose version before the step was not the one held (written outside the step, or
    held with an unknown version: the copy is void), then the positions, new versions
    and summed gradients of those the step summed with other trainers' gradients.
    The rest of the held rows had this trainer's gradient alone: the trainer applies
    it to its copy itself, with the same rule, and adds 1 to the version.
    """
    drop, pos, vers, sums = [], [], [], []
    for part, ids, sl in rows:
        uniq, summed, counts, before = applied[part]
        d, p, v, at = cachebook.held_answer(uniq, ids, m.have[sl], before, counts, sl.start)
        drop.append(d)
        pos.append(p)
        vers.append(v)
        sums.append(summed[at])
    empty = np.empty(0, np.int64)
    return [np.concatenate([empty] + drop), np.concatenate([empty] + pos),
            np.concatenate([empty] + vers),
            np.concatenate([np.empty((0, m.grads.shape[1]), np.float32)] + sums)]
