"""Views: a client seen from another device, changing only the placement half.

A view wraps a client and changes where looked-up rows go and where their gradients are
summed (:mod:`distemb.kvstore.types`); storage, key management and checkpoints are the
wrapped client's:

- :class:`HostTableOnDevice`: a host table (embedded or remote) looked up onto a GPU:
  rows go there, gradients are summed there, only the unique rows' sums cross back;
- :class:`RowsOnDevice`: a device table looked up onto another device;
- :class:`CacheOnDevice`: the lookups of a device cache
  (:mod:`distemb.kvstore.caches.device`).

Torch is imported on demand here (a view is made only where a device is in play), so
server processes, which import :mod:`distemb.kvstore`, never load it.
"""
from typing import Optional, Sequence, Tuple

from distemb.arrays import Array, Rows, Tensor, UniqueIds
from distemb.kvstore.types import KVClient
from distemb.kvstore.wrapper import Wrapper


def cuda_device(device):
    """``device`` resolved to a usable CUDA ``torch.device``
    (:func:`distemb.kernels.cuda.cuda_device`; imported on demand, as torch is)."""
    from distemb.kernels.cuda import cuda_device as resolve
    return resolve(device)


def _cuda_kernels():
    from distemb.kernels import cuda
    return cuda


def view_on_host(client: KVClient, device) -> KVClient:
    """The client through which rows of host client ``client``'s tables are looked up
    onto ``device``: itself for None or 'cpu', a :class:`HostTableOnDevice` for a CUDA
    device (rows copied there, gradients summed there, only the sums moved back).

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device that cannot be used here.
        ValueError: ``device`` is neither.
    """
    if device is None or str(device) == "cpu":
        return client
    return HostTableOnDevice.of(client, device)


def dedup_on(ops, device, num_keys: Optional[int], dim: int, ids: Sequence[Array],
             grads: Sequence[Tensor], padded: bool = False) -> Tuple[UniqueIds, Rows]:
    """Concatenate traced ids and gradients on ``device`` and sum duplicates there.

    Args:
        num_keys: N of a table of the fixed keys 0..N-1, None for any int64 key (no row
            count to sort against).
        padded: with ``ops.dedup_sum_padded`` (no wait for the device; unused slots hold
            the id ``num_keys``, outside the table), for updates on the device itself.
    """
    import torch  # a device is in play: the trainer has torch

    ids = [torch.as_tensor(i).to(device) for i in ids]  # host ids: numpy int64
    grads = [g.reshape(-1, dim).to(device) for g in grads]
    flat = ids[0] if len(ids) == 1 else torch.cat(ids)
    g = (grads[0] if len(grads) == 1 else torch.cat(grads)).to(torch.float32).contiguous()
    if padded:
        return ops.dedup_sum_padded(flat, g, num_rows=num_keys)
    return ops.dedup_sum(flat, g, num_rows=num_keys)


class HostTableOnDevice(Wrapper):
    """A host table looked up onto a GPU: rows go there, gradients are summed there.

    Only the unique ids and their summed gradients come back to the host, where the host
    client pushes the update as usual (to its own shards or to the servers).

    Args:
        inner: the host client holding the table.
        device: the CUDA device (resolved by :func:`cuda_device`).

    Example:
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.kvstore import LocalKVClient
        >>> try:
        ...     view = LocalKVClient().view_on("cuda")
        ... except CudaUnavailableError:  # says why: no library, CPU-only torch, no GPU
        ...     view = None
    """

    #: The kernels that sum on the device (a test may swap in a CPU stand-in).
    ops = property(lambda self: _cuda_kernels())

    def __init__(self, inner: KVClient, device):
        super().__init__(inner)
        self.device = device

    @classmethod
    def of(cls, inner: KVClient, device) -> "HostTableOnDevice":
        """The view of ``inner`` on ``device``, checked before any copy."""
        return cls(inner, cuda_device(device))

    def rows_out(self, rows, F):
        return F.copy_to(self.inner.rows_out(rows, F), self.device)

    def coalesce(self, name, ids, grads, F):
        if not ids:  # nothing summed here; the host client says what an empty step sends
            return self.inner.coalesce(name, ids, grads, F)
        # the table's key space, never its size: a hash table on servers would be asked
        # for that every step
        table = self.inner.table(name)
        uniq, summed = dedup_on(self.ops, self.device, table.num_keys, table.dim, ids, grads)
        return uniq.cpu().numpy(), summed.cpu().numpy()


class RowsOnDevice(Wrapper):
    """A device table looked up onto another device: rows are copied there.

    Gradients come back to the table's device, where its client sums and applies them.

    Example:
        >>> import torch
        >>> from distemb.backend import load_backend
        >>> from distemb.kvstore.device import DeviceKVClient
        >>> from distemb.partition import range_policy
        >>> table = DeviceKVClient("cpu")  # a GPU in real use; 'cpu' shows the wiring
        >>> table.init_data("t", (3, 2), "float32", range_policy(3))
        >>> view = RowsOnDevice(table, torch.device("meta"))
        >>> view.rows_out(torch.zeros(1, 2), load_backend("pytorch")).device
        device(type='meta')
    """

    def __init__(self, inner: KVClient, device):
        super().__init__(inner)
        self.device = device

    def rows_out(self, rows, F):
        return F.copy_to(rows, self.device)


class CacheOnDevice(Wrapper):
    """Lookups onto the device through a device cache
    (:class:`~distemb.kvstore.caches.device.DeviceCachedKVClient`).

    Rows come from the cache (misses fetched and admitted), gradients are summed on the
    device and handed back to the cache client's ``push_update`` as device tensors. The
    cache is any client with ``lookup``, ``device_ops`` and ``cache_device`` (this
    module sits below :mod:`distemb.kvstore.caches.device`, which makes this view).

    Args:
        cache: the cache client.

    Example:
        >>> from distemb.config import parse_cache_config
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.kvstore import LocalKVClient
        >>> from distemb.kvstore.caches.device import DeviceCachedKVClient
        >>> try:
        ...     kv = DeviceCachedKVClient(LocalKVClient(), parse_cache_config({"rows": 8}))
        ...     assert isinstance(kv.view_on("cuda"), CacheOnDevice)
        ... except CudaUnavailableError:  # no GPU here: says why
        ...     pass
    """

    def __init__(self, cache: KVClient):
        super().__init__(cache)
        self.device = cache.cache_device

    @property
    def ops(self):
        """The device kernels (the gradients of a step are summed with them)."""
        return self.inner.device_ops

    def pull(self, name, ids):
        return self.inner.lookup(name, ids)

    def rows_out(self, rows, F):
        return rows

    def coalesce(self, name, ids, grads, F):
        if not ids:  # nothing summed here; the host client says what an empty step sends
            return self.inner.coalesce(name, ids, grads, F)
        table = self.inner.table(name)
        return dedup_on(self.ops, self.device, table.num_keys, table.dim, ids, grads)

    def close(self):
        """Nothing: the cache client belongs to the context."""
