"""IdCheck: a device table's out-of-range ids, recorded on the device, read back without a wait.

A lookup's gather validates its ids on the device (:func:`distemb.kernels.cuda.
gather_rows_checked`): a bad id reads zeros and is counted in the table's flags (count,
smallest, largest), which are copied to pinned host memory behind the gather. The next
call that finds the copy landed reports them (:class:`~distemb.stores.device.DeviceDenseStore`).
"""
import torch

from distemb.errors import PartitionError
from distemb.kernels import cuda


class IdCheck:
    """Out-of-range ids seen by one table's device lookups, read back without waiting.

    Args:
        device: the table's ``torch.device``.
        num_rows: the table's rows (valid ids are in [0, num_rows)).
        what: how the error names the ids, e.g. ``"ids of 'emb'"``.

    Example:
        >>> check = IdCheck(torch.device("cpu"), 10, "ids of 't'")
        >>> check.flags[:] = torch.tensor([2, -1, 12])  # what a gather recorded
        >>> check.raise_seen(wait=True)
        Traceback (most recent call last):
        ...
        distemb.errors.PartitionError: ids of 't': 2 out of range, from -1 to 12 ...
    """

    def __init__(self, device, num_rows, what):
        self.num_rows, self.what = num_rows, what
        self.flags = torch.tensor(cuda.CLEAN_ID_FLAGS, dtype=torch.int64, device=device)
        if device.type == "cuda":
            self._host = torch.empty(3, dtype=torch.int64, pin_memory=True)
            self._landed = torch.cuda.Event()
        else:  # host memory already: nothing to copy or wait for
            self._host, self._landed = self.flags, None

    def recorded(self):
        """Enqueue the copy of the flags to the host, behind the kernel that wrote them."""
        if self._landed is None:
            return
        # On the stream of the table's device (the gather's), not the current device's.
        stream = torch.cuda.current_stream(self.flags.device)
        if stream == torch.cuda.current_stream():  # the common case: no stream switch
            self._host.copy_(self.flags, non_blocking=True)
        else:
            with torch.cuda.stream(stream):
                self._host.copy_(self.flags, non_blocking=True)
        self._landed.record(stream)

    def raise_seen(self, wait):
        """Raise if the flags that reached the host show bad ids, and clear them.

        Args:
            wait: wait for the last copy (free right after the device was waited for);
                otherwise look only if it has already landed.

        Raises:
            PartitionError: bad ids were seen: their count and range, and what happened.
        """
        if self._landed is not None:
            if wait:
                self._landed.synchronize()
            elif not self._landed.query():
                return
        count, low, high = self._host.tolist()
        if count == 0:
            return
        self.flags.copy_(torch.tensor(cuda.CLEAN_ID_FLAGS, dtype=torch.int64))
        if self._host is not self.flags:
            self._host.copy_(self.flags.cpu())
        raise PartitionError(
            f"{self.what}: {count} out of range, from {low} to {high} (expected 0 <= id < "
            f"{self.num_rows}); found on the device in lookups since the last check: those "
            "rows read as zeros and are never updated, and this call did nothing")
