"""The placement half of a KVClient: how a backend's tensors become a client's arrays
and back, for clients whose arrays are numpy arrays on the host.

A client (:class:`~distemb.kvstore.types.KVClient`) is storage and placement. This module
is the placement, trainer side: ``ids_in``/``values_in``/``tensor_in`` turn the backend's
tensors into the client's arrays (validated), ``rows_out`` turns pulled rows into backend
tensors, ``coalesce`` sums the gradients of duplicate ids on the client's own device with
its own kernels, and ``view_on(device)`` is the client through which rows are looked up
onto ``device`` (:func:`~distemb.kvstore.views.view_on_host` for host clients).
:class:`HostPlacement` is it for host clients (every KVClient inherits it; device clients
override it, :mod:`distemb.kvstore.device`);
a client wrapping another without moving its rows hands it on
(:class:`~distemb.kvstore.wrapper.Wrapper`).

Example:
    >>> import torch
    >>> from distemb.backend import load_backend
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.partition import range_policy
    >>> kv = LocalKVClient()
    >>> kv.init_data("t", (3, 2), "float32", range_policy(3))
    >>> kv.ids_in("t", torch.tensor([[2, 0]]), load_backend("pytorch"))
    (array([2, 0]), (1, 2))
"""
from typing import Optional, Sequence, Tuple

import numpy as np

from distemb import kernels
from distemb.arrays import (Array, GlobalIds, Rows, Shape, Tensor, UniqueIds,
                            check_values_shape)
from distemb.kernels import half


class HostPlacement:
    """The placement half of :class:`~distemb.kvstore.types.KVClient` for host clients
    (numpy arrays in this process's memory, or on servers); it uses the client's
    ``tables``, ``row_dim`` and ``num_threads``."""

    def from_host(self, array: np.ndarray) -> Array:
        """A numpy array as an array of this client (the array itself for host clients)."""
        return array

    def to_host(self, array: Array) -> np.ndarray:
        """An array of this client as a numpy array (the array itself for host clients)."""
        return array

    def tensor_in(self, x: Tensor, F) -> Array:
        """A backend tensor (or numpy array) as an array of this client, unchecked."""
        return F.to_numpy(x) if F.is_tensor(x) else np.asarray(x)

    def ids_in(self, name: str, ids: Tensor, F) -> Tuple[GlobalIds, Shape]:
        """Ids of any shape as flat int64 keys of this client, checked by the table's
        router (ids 0..N-1 of a fixed key space, any int64 key but the two a hash index
        reserves).

        Returns:
            (flat ids, the shape of ``ids``).

        Raises:
            TypeError: ``ids`` is not an integer tensor.
            PartitionError: an id is out of range (the message names it and the table).
            ValueError: a key a hash index reserves.
        """
        table = self.tables.rows(name)[0]
        arr = self.tensor_in(ids, F)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ids: expected an integer tensor (int32 or int64), got {arr.dtype}")
        flat = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)
        table.router.check(flat, f"ids of {name!r}")
        return flat, tuple(arr.shape)

    def values_in(self, name: str, values: Tensor, F, ids_shape: Shape) -> Array:
        """Values for the rows of ids of shape ``ids_shape`` (as :meth:`ids_in` returned
        it) of ``name``, as an array of this client: one row per id, in the order of the
        flat ids.

        Args:
            values: shaped as the ids + the row shape, or (number of ids,) + the row
                shape (:func:`~distemb.arrays.check_values_shape`): the table's dtype, or
                float32 for 16-bit rows (rounded to nearest-even on store).

        Raises:
            TypeError: another dtype.
            ValueError: values of another shape.
        """
        table, column = self.tables.rows(name)
        row_shape, dtype = table.columns()[column]
        arr = self.tensor_in(values, F)
        got = F.dtype_of(arr) if F.is_tensor(arr) else arr.dtype.name
        rows = half.row_dtype(dtype)  # float32 for half tables: rounded on store
        if got != dtype and got != rows:
            also = f" (or {rows})" if rows != dtype else ""
            raise TypeError(f"values: expected dtype {dtype}{also} for {name!r}, "
                            f"got {got}")
        if got != rows:
            arr = arr.astype(rows)  # a half table's own dtype: exact in float32
        return arr.reshape(check_values_shape(name, arr.shape, ids_shape, row_shape))

    def rows_out(self, rows: Array, F) -> Tensor:
        """Pulled rows as a backend tensor (zero-copy on the host)."""
        return F.from_numpy(rows)

    def coalesce(self, name: str, ids: Sequence[GlobalIds], grads: Sequence[Tensor],
                 F) -> Optional[Tuple[UniqueIds, Rows]]:
        """Sum the gradient rows of duplicate ids, with this client's kernels.

        Args:
            name: the table.
            ids: one flat id array per traced lookup (from :meth:`ids_in`, or another
                view's of the same table).
            grads: one (N_i, D) backend tensor per lookup, any device.

        Returns:
            ``(unique ids, summed gradients)`` in this client's arrays, ready for
            :meth:`push_update` (host clients reuse one buffer per table for the sums: it
            is valid until the next call, and is ``push_update``'s to consume: a client
            may reorder its rows as it sends them), or None when there is nothing to push.
        """
        if not ids:
            return None
        dim = self.row_dim(name)
        # ids of a host table are this client's (numpy) whichever view looked them up
        host_ids = [np.asarray(i, dtype=np.int64).reshape(-1) for i in ids]
        host_grads = [np.asarray(F.to_numpy(g), dtype=np.float32).reshape(-1, dim)
                      for g in grads]
        flat = host_ids[0] if len(host_ids) == 1 else np.concatenate(host_ids)
        g = host_grads[0] if len(host_grads) == 1 else np.concatenate(host_grads)
        if len(host_ids) == 1 and _ascending_unique(flat):
            # One lookup of ascending unique ids (a fused loss's rows, e.g. skipgram_loss
            # over torch.unique's ids): each row's gradient is its id's sum already, and
            # the sort and copy of dedup_sum would give back the same rows.
            return flat, np.ascontiguousarray(g)
        return kernels.dedup_sum(flat, np.ascontiguousarray(g), num_threads=self.num_threads,
                                 out=self._sum_buffer(name, flat.shape[0], dim))

    def _sum_buffer(self, name: str, n: int, dim: int) -> np.ndarray:
        """This table's reusable buffer for summed gradients, at least ``n`` rows.

        Reuse is safe: ``push_update`` consumes the sums before it returns; it spares a
        fresh (N, D) allocation, and its first touch, every step.
        """
        buffers = self.__dict__.setdefault("_sum_buffers", {})
        buf = buffers.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != dim:
            buf = np.empty((max(n, 1), dim), dtype=np.float32)
            buffers[name] = buf
        return buf


def _ascending_unique(ids: np.ndarray) -> bool:
    """Whether ``ids`` are strictly ascending (so unique, in dedup_sum's order)."""
    n = len(ids)
    if n >= 4 and not ids[0] < ids[n // 2] < ids[n - 1]:
        return False  # most batches are not sorted: refused without a pass over them
    return n < 2 or bool((ids[1:] > ids[:-1]).all())
