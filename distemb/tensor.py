"""DistTensor: a named, row-sharded tensor; ``t[ids]`` pulls, ``t[ids] = v`` pushes."""
import numpy as np

from distemb.context import current_context
from distemb.errors import KVStoreError
from distemb.partition import range_policy


def _check_shape(shape):
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape: expected a tuple of ints, got {shape!r}") from None
    if not shape or shape[0] <= 0 or any(s < 0 for s in shape[1:]):
        raise ValueError(f"shape: expected a non-empty tuple with shape[0] > 0, got {shape}")
    return shape


class DistTensor:
    """A tensor sharded by rows across the KVStore, addressed by global row ids.

    Args:
        shape: (rows, ...) of the whole tensor.
        dtype: element type (torch, numpy or string dtype).
        name: KVStore name; an existing tensor of that name (same shape and dtype) is
            attached instead of created. Anonymous when None.
        init_func: ``init_func(shape, dtype)`` returns the initial values of one shard.
        part_policy: how rows are sharded (default: even ranges over the servers).
        persistent: keep the data after this object is garbage collected.
        context: the :class:`~distemb.context.DistContext` (default: the current one).

    Example:
        >>> import torch
        >>> t = DistTensor((4, 2), torch.float32, name="doc-t")
        >>> t[torch.tensor([1, 3])] = torch.ones(2, 2)
        >>> t[torch.tensor([3])]
        tensor([[1., 1.]])
    """

    def __init__(self, shape, dtype, name=None, init_func=None, part_policy=None,
                 persistent=False, context=None):
        ctx = context or current_context()
        self._ctx, F = ctx, ctx.F
        self._shape = _check_shape(shape)
        self._dtype = F.dtype_name(dtype)
        if part_policy is None:
            part_policy = range_policy(self._shape[0], ctx.num_servers)
        if part_policy.get_size() != self._shape[0]:
            raise ValueError(f"part_policy: {part_policy.policy_str} has "
                             f"{part_policy.get_size()} ids, but shape[0] is {self._shape[0]}")
        self._policy = part_policy
        self._name = name or ctx.new_name("anonymous")
        self._persistent = persistent
        meta = ctx.client.data_meta(self._name)
        self._owner = meta is None
        if meta is None:
            wrapped = None if init_func is None else (
                lambda s, d: F.to_numpy(init_func(s, F.dtype(d))))
            ctx.client.init_data(self._name, self._shape, self._dtype, part_policy, wrapped)
        elif meta.shape != self._shape or meta.dtype != self._dtype:
            raise KVStoreError(f"name {self._name!r} exists with shape {meta.shape} and dtype "
                               f"{meta.dtype}; got shape {self._shape} and dtype {self._dtype}")

    def _ids(self, ids):
        """Validated int64 numpy ids (flattened) and the shape they came in."""
        arr = self._ctx.F.to_numpy(ids) if self._ctx.F.is_tensor(ids) else np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ids: expected an integer tensor (int32 or int64), got {arr.dtype}")
        flat = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)
        self._policy.check_ids(flat, f"ids of {self._name!r}")
        return flat, arr.shape

    def __getitem__(self, ids):
        flat, shape = self._ids(ids)
        rows = self._ctx.client.pull(self._name, flat)
        return self._ctx.F.from_numpy(rows.reshape(shape + self._shape[1:]))

    def __setitem__(self, ids, values):
        flat, _ = self._ids(ids)
        F = self._ctx.F
        arr = F.to_numpy(values) if F.is_tensor(values) else np.asarray(values)
        if arr.dtype.name != self._dtype:
            raise TypeError(f"values: expected dtype {self._dtype} for {self._name!r}, "
                            f"got {arr.dtype.name}")
        want = (len(flat),) + self._shape[1:]
        if arr.size != int(np.prod(want)):
            raise ValueError(f"values: expected shape {want} for {len(flat)} ids, "
                             f"got {arr.shape}")
        self._ctx.client.push(self._name, flat, np.ascontiguousarray(arr).reshape(want))

    def __len__(self):
        return self._shape[0]

    def __del__(self):
        try:
            if self._owner and not self._persistent and not self._ctx.closed:
                self._ctx.client.delete_data(self._name)
        except Exception:  # interpreter shutdown: the store may already be gone
            pass

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._ctx.F.dtype(self._dtype)

    @property
    def name(self):
        return self._name

    @property
    def part_policy(self):
        return self._policy

    @property
    def context(self):
        return self._ctx

    def __repr__(self):
        return f"DistTensor(name={self._name!r}, shape={self._shape}, dtype={self._dtype})"
