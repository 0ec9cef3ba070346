"""DeviceKVClient: an embedded KVClient whose tables live in torch tensors on one device.

A GPU-resident table is one whole tensor on its device (the partition policy is kept as
metadata, its size checked, and ``init_func`` still fills one shard at a time, so a
table starts as it would on the host): lookups gather with the CUDA kernels and updates run the
rules of :mod:`distemb.rules` with :mod:`distemb.kernels.cuda`, so rows, ids and
gradients never leave the GPU. Arrays crossing this client are torch tensors on its
device (ids int64), where host clients use numpy. Embedded only: a server process holds
numpy shards and never imports torch.

This module imports torch; :mod:`distemb.kvstore` does not import it, so servers never
load it (the context imports it when a table asks for a device).

"""
import numpy as np
import torch

from distemb.errors import KVStoreError
from distemb.kernels import cuda
from distemb.kvstore.types import DataMeta, KVClient
from distemb.rules import RULES, state_name


def cuda_device(device):
    """The ``torch.device`` (with its index) of a CUDA device the kernels can run on.

    Args:
        device: 'cuda', 'cuda:N' or a ``torch.device`` of type cuda.

    Returns:
        ``torch.device('cuda', N)``; ``N`` is torch's current device when not given.

    Raises:
        ValueError: ``device`` is not a CUDA device.
        CudaUnavailableError: the CUDA kernels cannot run here (the reason of
            :func:`distemb.kernels.cuda.require_cuda`).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected None, 'cpu' or a CUDA device such as 'cuda:0', "
                         f"got {device!r} ({exc})") from None
    if dev.type != "cuda":
        raise ValueError(f"device: expected None, 'cpu' or a CUDA device such as 'cuda:0', "
                         f"got {device!r}")
    cuda.require_cuda()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} does not exist, this process sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


class DeviceKVClient(KVClient):
    """Embedded KVClient holding each table as one torch tensor on ``device``.

    Pulls gather with ``ops.gather_rows``; ``push_update`` runs the update rule with
    ``ops`` on the rows in place. Ids, rows and gradients passed in and returned are torch
    tensors on ``device`` (ids int64, in range: the caller validates them, as for host
    clients). One process, one writer: updates are enqueued on the device's current
    stream in call order, so a row and its state have one writer (DESIGN.md).

    Args:
        device: the ``torch.device`` of the tables (:func:`cuda_device` resolves one).
        ops: the kernel module (default :mod:`distemb.kernels.cuda`); anything with its
            functions and keywords works, e.g. a test's CPU twin on a CPU device.

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device but the kernels cannot run here.

    Example:
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.partition import range_policy
        >>> try:
        ...     kv = DeviceKVClient(cuda_device("cuda"))
        ... except CudaUnavailableError as e:  # says why: no library, CPU-only torch, no GPU
        ...     kv = None
        >>> if kv is not None:
        ...     kv.init_data("t", (5, 2), "float32", range_policy(5))
        ...     assert kv.pull("t", torch.tensor([4], device=kv.device)).is_cuda
    """

    ops = cuda

    def __init__(self, device, ops=None):
        self.device = torch.device(device)
        if ops is not None:
            self.ops = ops
        if self.device.type == "cuda":
            cuda.require_cuda()
        self._tables = {}
        self._meta = {}

    def init_data(self, name, shape, dtype, policy, init_func=None):
        """Create ``name``; ``init_func(shard_shape, dtype_name)`` fills each shard.

        Zeros when ``init_func`` is None. It may return numpy arrays or torch tensors; each
        shard's rows land at their global ids, as a host client would place them.
        """
        if name in self._meta:
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        shape = tuple(shape)
        if policy.get_size() != shape[0]:
            raise KVStoreError(f"policy of {name!r}: {policy.policy_str} has "
                               f"{policy.get_size()} ids, but shape[0] is {shape[0]}")
        self._tables[name] = self._initial(name, shape, dtype, policy, init_func)
        self._meta[name] = DataMeta(shape, dtype, policy)

    def _initial(self, name, shape, dtype, policy, init_func):
        tdtype = getattr(torch, dtype)
        if init_func is None:
            return torch.zeros(shape, dtype=tdtype, device=self.device)
        shards = []
        for part in range(policy.num_partitions):
            sshape = (policy.get_part_size(part),) + shape[1:]
            shard = torch.as_tensor(init_func(sshape, dtype)).to(self.device, tdtype)
            if tuple(shard.shape) != sshape:
                raise KVStoreError(f"init_func of {name!r}: returned shape "
                                   f"{tuple(shard.shape)}, expected {sshape}")
            shards.append(shard)
        if len(shards) == 1:
            return shards[0].contiguous()
        table = torch.empty(shape, dtype=tdtype, device=self.device)
        for part, pos, local in policy.split(np.arange(shape[0], dtype=np.int64)):
            table[torch.from_numpy(pos).to(self.device)] = \
                shards[part][torch.from_numpy(local).to(self.device)]
        return table

    def delete_data(self, name):
        self._meta.pop(name, None)
        self._tables.pop(name, None)

    def _meta_of(self, name):
        self._table(name)  # raises the unknown-name error
        return self._meta[name]

    def _table(self, name):
        try:
            return self._tables[name]
        except KeyError:
            raise KVStoreError(f"name {name!r} is not in the KVStore "
                               f"(known: {sorted(self._meta)[:10]})") from None

    def pull(self, name, ids):
        """Rows ``ids`` (int64 tensor on the device) of ``name``, a new tensor there."""
        table = self._table(name)
        if table.dtype == torch.float32 and table.dim() == 2:
            return self.ops.gather_rows(table, ids)
        return table.index_select(0, ids)

    def push(self, name, ids, values):
        """Write ``values`` into rows ``ids``; for a duplicate id the last write wins."""
        table = self._table(name)
        # index_copy_ leaves the winner of duplicate ids unspecified on a GPU: keep the
        # last position of each id, as host clients do.
        uniq, inverse = torch.unique(ids, return_inverse=True)
        positions = torch.arange(ids.shape[0], device=ids.device)
        last = torch.zeros_like(uniq).scatter_reduce_(0, inverse, positions, "amax")
        table.index_copy_(0, uniq, values.to(table.dtype)[last])

    def push_update(self, name, ids, grads, rule, hyper):
        try:
            impl = RULES[rule]
        except KeyError:
            raise KVStoreError(f"rule: expected one of {sorted(RULES)}, got {rule!r}") from None
        states = {s.name: self._table(state_name(name, s.name)) for s in impl.states}
        impl.apply(self.ops, self._table(name), states, ids, grads, hyper)

    def from_host(self, array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_host(self, array):
        return array.cpu().numpy()

    def close(self):
        for name in list(self._meta):
            self.delete_data(name)
